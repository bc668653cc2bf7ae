// Cross-entropy with log-softmax computed stably per row (max subtracted), on
// the fused softmax + cross-entropy kernel (float32) or its reference loops.
#include "mha/nn/loss.h"

#include <cmath>

#include "cpu/layers/layers.h"
#include "cpu/reference/layers.h"
#include "nn/layer_util.h"

namespace mha::nn {

CrossEntropyResult cross_entropy(const Tensor& logits_in, const Tensor& targets_in, const CrossEntropyOptions& o) {
  const char* fn = "mha::nn::cross_entropy";
  check_defined(logits_in, fn, "logits");
  check_defined(targets_in, fn, "targets");
  check_layer_dtype(logits_in.dtype(), fn);
  if (logits_in.dim() < 1 || logits_in.size(-1) == 0)
    raise<ShapeError>(fn, "logits", "(…, C) with C > 0", shape_string(logits_in.shape()));
  if (targets_in.dtype() != DType::int64) raise<DtypeError>(fn, "targets", "int64", to_string(targets_in.dtype()));
  const Shape want(logits_in.shape().begin(), logits_in.shape().end() - 1);
  if (targets_in.shape() != want) raise<ShapeError>(fn, "targets", "shape " + shape_string(want), shape_string(targets_in.shape()));
  if (!(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0))
    raise<ValueError>(fn, "label_smoothing", "in [0, 1]", std::to_string(o.label_smoothing));
  const Tensor logits = logits_in.contiguous(), targets = targets_in.contiguous();
  const int64_t C = logits.size(-1), rows = targets.numel();
  const int64_t* t = targets.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    if (t[r] != o.ignore_index && (t[r] < 0 || t[r] >= C))
      raise<ValueError>(fn, "targets", "values in [0, " + std::to_string(C) + ") or ignore_index " + std::to_string(o.ignore_index),
                        std::to_string(t[r]) + " at flat index " + std::to_string(r));
  CrossEntropyResult res;
  res.dlogits = Tensor::empty(logits.shape(), logits.dtype());
  for (int64_t r = 0; r < rows; ++r) res.count += t[r] != o.ignore_index;
  if (res.count == 0) {
    res.dlogits.fill_(0.0);
    return res;
  }
  dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const cpu::CrossEntropyOf<T> p{.logits = logits.data<T>(), .targets = t, .dlogits = res.dlogits.data<T>(),
                                   .rows = rows, .C = C, .ignore_index = o.ignore_index,
                                   .label_smoothing = o.label_smoothing, .grad_scale = 1.0 / double(res.count)};
    double total;
    if constexpr (std::is_same_v<T, float>) total = cpu::cross_entropy_forward_backward(p, &res.count, &res.correct);
    else total = cpu::reference::cross_entropy_forward_backward(p, &res.count, &res.correct);
    res.loss = total / double(res.count);
  });
  return res;
}

}  // namespace mha::nn
