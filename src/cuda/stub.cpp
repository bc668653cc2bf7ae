// The CUDA backend of a build without CUDA: every entry point throws
// DeviceError. A real backend replaces this file (selected by CMake).
#include <string>

#include "backend.h"
#include "mha/errors.h"

namespace mha {

namespace {

[[noreturn]] void not_built(const char* fn) {
  throw DeviceError(std::string("[") + fn + "] device: expected a device this build supports; got cuda "
                    "(mha was not built with CUDA)");
}

struct CudaStubBackend final : Backend {
  void check_available(const char* fn) override { not_built(fn); }
  void* allocate(size_t, const char* fn) override { not_built(fn); }
  void deallocate(void*) override {}
  void attention_forward(const AttentionParams&, AttentionOutput&) override {
    not_built("mha::attention_forward");
  }
  void attention_backward(const AttentionParams&, const Tensor&, const AttentionOutput&,
                          AttentionGradients&) override {
    not_built("mha::attention_backward");
  }
};

}  // namespace

Backend& cuda_backend() {
  static CudaStubBackend backend;
  return backend;
}

}  // namespace mha
