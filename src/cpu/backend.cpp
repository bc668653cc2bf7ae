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

  // The fused kernels multiply whole tiles, excluded (masked) entries
  // included as weight 0, so a NaN or infinity in Q, K or V reaches outputs
  // that do not depend on it (0·NaN = NaN); and once it shows, nothing tells
  // which outputs it reached rightly. The reference path computes exactly the
  // outputs that depend on each input. So a fused call whose outputs hold a
  // NaN or infinity runs again on the reference path: the same results for
  // finite inputs, the exact dependency for non-finite ones, at the price of
  // a look at each tile of the outputs as it is written, in cache.
  void attention_forward(const AttentionParams& p, AttentionOutput& r) override {
    if (p.path == AttentionPath::fused) {
      if (cpu::flash_attention_forward(p, r)) return;
      r.path = AttentionPath::reference;
    }
    if (r.out.is_contiguous()) return cpu::reference_attention_forward(p, r);
    // out is a view (attention_forward_into): the reference path writes whole rows, then copied in.
    AttentionOutput whole = r;
    whole.out = Tensor::empty(r.out.shape(), r.out.dtype());
    cpu::reference_attention_forward(p, whole);
    r.out.copy_(whole.out);
  }
  void attention_backward(const AttentionParams& p, const Tensor& dout, const AttentionOutput& fwd,
                          AttentionGradients& g) override {
    if (p.path == AttentionPath::fused) {
      if (cpu::flash_attention_backward(p, dout, fwd, g)) return;
    }
    cpu::reference_attention_backward(p, dout, fwd, g);
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
