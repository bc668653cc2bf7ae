// What each head of a trained model does, and how much the loss needs it.
//
// Importance (Michel, Levy and Neubig 2019): every head's output gets a gate
// ξ_h = 1 before the output projection; over batches of held-out examples,
// I_h = Σ_batches |∂L/∂ξ_h| (L the batch's mean cross-entropy), then divided
// by the ℓ2 norm of its layer's scores, so that heads compare within a layer
// and layers on one scale.
// Entropy and confidence over the same examples' attention: the mean over
// query rows of −Σ_j p_j ln p_j, and of max_j p_j.
// Positional heads: for offset d (query position − key position, self-
// attention only), the mean over rows of the weight on key i − d; a head
// whose best offset takes ≥ 90% of the weight is positional (d = 1: the
// previous token, d = 0: itself). Patterns set by the input's length n count
// too: an offset n + c the same for every example (what copies), or keys on
// the anti-diagonal i + j = 2n + c (what reverses), each with ≥ 90% of the
// weight of the rows that predict the answer (from the separator on, one
// per output token), on average over every example.
#pragma once

#include <string>
#include <vector>

#include "mha/nn/multihead_attention.h"
#include "mha/train/task_model.h"

namespace mha::train {

// One kind of attention of a model, layer by layer: "self" (decoder-only and
// encoder models), or "encoder", "decoder" and "cross" (encoder–decoder).
struct AttentionSite {
  std::string name;
  std::vector<nn::MultiheadAttention*> layers;
};
std::vector<AttentionSite> attention_sites(TaskModel& model);

struct HeadStats {
  double importance = 0;  // normalised per layer (see above)
  double entropy = 0, confidence = 0;
  int64_t offset = 0;         // the offset with the most weight (self-attention)
  double offset_share = 0;    // the mean weight there
  bool positional = false;    // offset_share >= 0.9, or a pattern of the input length (below)
  // What it attends to, when positional: "itself", "previous token",
  // "offset d"; or, over examples of input length n, "offset n + c" (every
  // row's weight at i − j = n + c: copy) or "mirror: i + j = 2n + c"
  // (reverse), each with a mean share ≥ 0.9 (pattern_share).
  std::string pattern;
  double pattern_share = 0;
};

struct SiteReport {
  std::string name;
  std::vector<std::vector<HeadStats>> heads;  // [layer][head]
  std::vector<std::vector<int64_t>> ids;      // [layer][head]: each head's id (pruning.h)
};

struct HeadReport {
  std::vector<SiteReport> sites;
  int64_t examples = 0;
};

// Over `examples` (held-out ones), in batches of `batch`; the model is left
// in eval mode with its gates cleared and its gradients zero.
HeadReport head_report(TaskModel& model, const std::vector<Example>& examples, int64_t batch = 32);

}  // namespace mha::train
