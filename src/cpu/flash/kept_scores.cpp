// The kept scores' layout (kept_scores.h).
#include "cpu/flash/kept_scores.h"

#include <algorithm>

#include "cpu/flash/flash.h"

namespace mha::cpu {

int64_t ScoreLayout::tile_floats() const { return kFlashKeyTile * br; }

Shape ScoreLayout::shape(int64_t batch) const { return {batch, per_entry, tile_floats()}; }

std::optional<ScoreLayout> score_layout(const AttentionParams& p, int64_t br) {
  if (p.keep_scores_bytes <= 0 || p.L <= 0 || (p.L - 1) + p.lo_shift > 0) return std::nullopt;
  ScoreLayout layout;
  layout.br = br;
  for (int64_t i0 = 0; i0 < p.L; i0 += br) {
    const int64_t hi = p.key_end(std::min(p.L, i0 + br) - 1);  // key_range's end, as the kernels take it
    layout.first.push_back(layout.per_entry);
    layout.per_entry += (hi + kFlashKeyTile - 1) / kFlashKeyTile;
  }
  const double bytes = double(p.batch) * double(layout.per_entry) * double(layout.tile_floats()) * sizeof(float);
  if (bytes > double(p.keep_scores_bytes)) return std::nullopt;
  return layout;
}

}  // namespace mha::cpu
