// Where the fused forward keeps its scores for the backward
// (AttentionOptions::keep_scores_bytes): per batch entry, each query tile's
// S_T tiles (kFlashKeyTile × br floats) for the key tiles its band reaches,
// from key 0, the query tiles one after another, so that a causal entry holds
// about half of L × S; as a Tensor (batch, key tiles per entry, Bc·br). Kept
// only where every query tile's keys start at key 0 (no left window), so that
// the forward's key tiles are the backward's.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "attention_params.h"

namespace mha::cpu {

struct ScoreLayout {
  std::vector<int64_t> first;  // per query tile: its key tile 0, in tiles from the entry's start
  int64_t per_entry = 0;       // key tiles per entry
  int64_t br = 0;              // query tile width
  Shape shape(int64_t batch) const;
  // Entry b's kept scores in a tensor of shape(batch).
  template <class T>
  T* entry(T* scores, int64_t b) const { return scores + b * per_entry * tile_floats(); }
  int64_t tile_floats() const;
};

// The layout for p's query tiles of width br, when p asks to keep scores,
// has no left window, and they fit in p.keep_scores_bytes; else none.
std::optional<ScoreLayout> score_layout(const AttentionParams& p, int64_t br);

}  // namespace mha::cpu
