// Cross-entropy over the last dim, as torch.nn.functional.cross_entropy with
// reduction "mean", ignore_index and label_smoothing.
//   logits (…, C) float32/float64; targets int64 (…), each in [0, C) or ignore_index.
//   loss = mean over counted rows of (1-ε)·(-log p_target) + ε·mean_c(-log p_c)
//   dlogits = (softmax - q) / count,  q = (1-ε)·onehot(target) + ε/C; 0 on ignored rows.
// One call gives the loss and its gradient (the classifier's forward and backward).
#pragma once

#include "mha/tensor.h"

namespace mha::nn {

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;  // in [0, 1]
};

struct CrossEntropyResult {
  double loss = 0.0;    // 0 when every row is ignored
  Tensor dlogits;       // shaped like logits
  int64_t count = 0;    // rows that counted
  int64_t correct = 0;  // counted rows whose argmax is the target
};

CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& options = {});

}  // namespace mha::nn
