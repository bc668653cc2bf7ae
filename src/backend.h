// Device backends: the table that tensors and ops dispatch to by Device.
// The CPU backend is always built; the CUDA backend is a stub that throws
// "not built with CUDA" until a real one is added in src/cuda/.
#pragma once

#include <cstddef>

#include "mha/attention.h"
#include "mha/dtype.h"

namespace mha {

struct AttentionParams;

struct Backend {
  virtual ~Backend() = default;
  // Throws DeviceError when this backend cannot run in this build.
  virtual void check_available(const char* fn) { (void)fn; }
  virtual void* allocate(size_t bytes, const char* fn) = 0;
  virtual void deallocate(void* ptr) = 0;
  virtual void attention_forward(const AttentionParams& p, AttentionOutput& result) = 0;
  virtual void attention_backward(const AttentionParams& p, const Tensor& dout,
                                  const AttentionOutput& forward, AttentionGradients& grads) = 0;
};

Backend& cpu_backend();
Backend& cuda_backend();

// The backend for `device`, checked available; `fn` names the public
// function for error messages.
Backend& backend_for(Device device, const char* fn);

}  // namespace mha
