// The CPU backend: host memory (cpu/allocator.h) and the CPU attention kernels.
#include "backend.h"
#include "cpu/allocator.h"
#include "cpu/flash/dispatch.h"
#include "cpu/reference/attention.h"

namespace mha {

namespace {

struct CpuBackend final : Backend {
  void* allocate(size_t bytes, const char*) override { return cpu::host_allocate(bytes); }
  void deallocate(void* ptr) override { cpu::host_free(ptr); }

  void attention_forward(const AttentionParams& p, AttentionOutput& r) override {
    if (p.path == AttentionPath::fused) cpu::flash_attention_forward(p, r);
    else cpu::reference_attention_forward(p, r);
  }
  void attention_backward(const AttentionParams& p, const Tensor& dout, const AttentionOutput& fwd,
                          AttentionGradients& g) override {
    if (p.path == AttentionPath::fused) cpu::flash_attention_backward(p, dout, fwd, g);
    else cpu::reference_attention_backward(p, dout, fwd, g);
  }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

Backend& backend_for(Device device, const char* fn) {
  Backend& b = device == Device::cpu ? cpu_backend() : cuda_backend();
  b.check_available(fn);
  return b;
}

}  // namespace mha
