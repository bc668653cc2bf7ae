// Dropout with a regenerated pattern: element i is kept when word i % 4 of
// Philox block (seed, stream 2, i / 4) is >= p·2³².
#include "mha/nn/dropout.h"

#include "nn/layer_util.h"
#include "random/philox.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::Dropout";

// out[i] = in[i] · (keep(i) ? 1/(1-p) : 0).
Tensor apply(const Tensor& in_t, uint64_t seed, double p) {
  const Tensor in = in_t.contiguous();
  Tensor out = Tensor::empty(in.shape(), in.dtype());
  const uint32_t threshold = dropout_threshold(p);
  dispatch_float(in.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T scale = T(1.0 / (1.0 - p));
    const T* x = in.data<T>();
    T* y = out.data<T>();
    const int64_t n = in.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t b = 0; b < (n + 3) / 4; ++b) {
      const PhiloxBlock words = philox_block(seed, 2, uint64_t(b));
      for (int64_t k = 0; k < 4 && 4 * b + k < n; ++k) y[4 * b + k] = words[size_t(k)] >= threshold ? x[4 * b + k] * scale : T(0);
    }
  });
  return out;
}

}  // namespace

Dropout::Dropout(double p, Generator& gen) : p_(p), gen_(gen.next_u64()) {
  if (!(p >= 0.0 && p < 1.0)) raise<ValueError>(kCtor, "p", "a probability in [0, 1)", std::to_string(p));
}

Tensor Dropout::forward(const Tensor& x) {
  check_defined(x, "mha::nn::Dropout::forward", "x");
  applied_ = active();
  if (!applied_ && x.dtype() == DType::bfloat16) return x;  // a bf16-mixed operand passes through
  check_layer_dtype(x.dtype(), "mha::nn::Dropout::forward");
  if (!applied_) return x;
  seed_ = gen_.next_u64();
  return apply(x, seed_, p_);
}

Tensor Dropout::backward(const Tensor& dy) {
  check_defined(dy, "mha::nn::Dropout::backward", "dy");
  return applied_ ? apply(dy, seed_, p_) : dy;
}

}  // namespace mha::nn
