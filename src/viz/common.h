// What the PNG grid and the HTML page share: the colour scale's anchors and
// the check of the attention weights they draw.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "check.h"

namespace mha::viz {

// A viridis-like map from 0 (dark blue-violet) to 1 (yellow): five colours at
// 0, 1/4, 1/2, 3/4 and 1, interpolated linearly in between.
inline constexpr uint8_t kColourAnchors[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};

// Checks that `weights` holds at least one layer and that every layer is an
// (H, L, S) tensor with the same H ≥ 1; returns H. Raises ShapeError naming `fn`.
inline int64_t check_attention_weights(const std::string& fn, const std::vector<Tensor>& weights, int64_t L, int64_t S) {
  if (weights.empty()) raise<ShapeError>(fn, "weights", "at least one layer", "none");
  const int64_t heads = weights[0].defined() && weights[0].dim() == 3 ? weights[0].size(0) : 0;
  for (const Tensor& w : weights)
    if (heads < 1 || !w.defined() || w.dim() != 3 || w.size(0) != heads || w.size(1) != L || w.size(2) != S)
      raise<ShapeError>(fn, "weights",
                        "(H, L, S) per layer, H ≥ 1 the same in every layer, with L = " + std::to_string(L) +
                            " query tokens and S = " + std::to_string(S) + " key tokens",
                        describe(w));
  return heads;
}

}  // namespace mha::viz
