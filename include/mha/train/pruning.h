// Removing heads from a task model (Michel, Levy and Neubig 2019): heads by
// id at each attention site, and iterative pruning by importance or at
// random.
//
// Iterative pruning to a target of P heads in K iterations: in iteration
// i = 1 … K, score the heads still there (head_report's importance,
// normalised per layer, over the scoring examples), then prune the lowest
// scored until round(P · i / K) are gone, ranking across every layer and site
// (so a layer may lose all of its heads). At random: the heads to prune are
// drawn uniformly from those still there, from `seed`.
#pragma once

#include <string>
#include <vector>

#include "mha/train/checkpoint.h"
#include "mha/train/heads.h"

namespace mha::train {

using HeadLists = std::vector<std::vector<int64_t>>;  // [layer] → ids of its heads

// The ids of each layer's heads at `site` (attention_sites' names).
HeadLists head_ids(TaskModel& model, const std::string& site);
// Removes heads (ids) from one layer of `site`; the model's config follows.
void prune_heads(TaskModel& model, const std::string& site, int64_t layer, const std::vector<int64_t>& ids);
// The model's head lists into `info` (model.heads, encoder_heads,
// cross_heads), left empty where every layer has all nhead heads.
void record_heads(TaskModel& model, Checkpoint& info);
// Every head of the model, counted over its sites and layers.
int64_t count_heads(TaskModel& model);
// Per-layer weights (H_l, L, S) of the heads `ids` as (nhead, L, S) by id,
// the missing (pruned) heads' planes NaN: for pictures whose panels are ids.
std::vector<Tensor> weights_by_id(const std::vector<Tensor>& weights, const HeadLists& ids, int64_t nhead);

struct PruneConfig {
  int64_t heads = 0;       // how many heads to prune in all (at most all of them)
  bool random = false;     // at random instead of by importance
  int64_t iterations = 1;  // K above
  uint64_t seed = 0;       // the random draw
  int64_t batch = 32;      // scoring batch
};

struct PrunedHead {
  std::string site;
  int64_t layer = 0, id = 0;
  double importance = 0;  // its score when it was pruned (0 at random)
  int64_t iteration = 0;  // 1 … K
};

// Prunes config.heads heads from `model`, scoring on `examples` (importance
// only; training examples, so that held-out ones stay unseen). Returns them
// in the order pruned.
std::vector<PrunedHead> prune_model(TaskModel& model, const std::vector<Example>& examples, const PruneConfig& config);

}  // namespace mha::train
