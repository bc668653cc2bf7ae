// The CPU backend: 64-byte aligned host memory and the CPU attention kernels.
#include <cstdlib>
#include <new>

#include "backend.h"
#include "cpu/flash/dispatch.h"
#include "cpu/reference/attention.h"

namespace mha {

namespace {

struct CpuBackend final : Backend {
  void* allocate(size_t bytes, const char*) override {
    // Round up: aligned_alloc needs a multiple of the alignment; never 0 bytes.
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* ptr) override { std::free(ptr); }

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
