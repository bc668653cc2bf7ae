// Cross-entropy with log-softmax computed stably per row (max subtracted).
#include "mha/nn/loss.h"

#include <cmath>

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
  res.dlogits = Tensor::zeros(logits.shape(), logits.dtype());
  for (int64_t r = 0; r < rows; ++r) res.count += t[r] != o.ignore_index;
  if (res.count == 0) return res;
  const double eps = o.label_smoothing, inv_count = 1.0 / double(res.count);
  dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = logits.data<T>();
    T* d = res.dlogits.data<T>();
    double total = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (t[r] == o.ignore_index) continue;
      const T* row = x + r * C;
      double max = row[0];
      int64_t argmax = 0;
      for (int64_t c = 1; c < C; ++c)
        if (row[c] > max) max = row[c], argmax = c;
      double sum = 0, sum_logits = 0;
      for (int64_t c = 0; c < C; ++c) sum += std::exp(double(row[c]) - max), sum_logits += double(row[c]);
      const double lse = max + std::log(sum);
      // -log p_target and mean_c(-log p_c) = lse - mean_c(logit_c)
      total += (1 - eps) * (lse - double(row[t[r]])) + eps * (lse - sum_logits / double(C));
      res.correct += argmax == t[r];
      for (int64_t c = 0; c < C; ++c) {
        const double q = (c == t[r] ? 1 - eps : 0.0) + eps / double(C);
        d[r * C + c] = T((std::exp(double(row[c]) - lse) - q) * inv_count);
      }
    }
    res.loss = total * inv_count;
  });
  return res;
}

}  // namespace mha::nn
