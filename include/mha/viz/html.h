// Attention as an interactive web page, in the spirit of bertviz's head view:
// one self-contained HTML file (inline CSS and JavaScript, the weights embedded
// as JSON, nothing fetched) that works offline in any browser.
//
// The page shows one layer and head at a time as a matrix (queries in rows,
// keys in columns, the tokens written on both axes) with a colour scale, a
// clickable thumbnail of every layer × head plus each layer's mean over its
// heads, and the weight of the cell under the pointer (query token, key token,
// value). The fragment selects what is shown, so a link can point at one head:
//   page.html#layer=1&head=2          layer 1, head 2 (0-based)
//   page.html#layer=0&head=mean       the mean over layer 0's heads
//   page.html#layer=1&head=2&hover=3,4  and the cell of query 3, key 4 as if hovered
// Weights are stored rounded to 4 decimals; NaN and ±inf are stored as null and
// drawn grey. The page reports what it drew, as JSON, in <pre id="status">
// (layer, head, cells, thumbnails, hover, errors), for tests and tools.
#pragma once

#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha::viz {

// weights: one (H, L, S) tensor per layer, H ≥ 1 the same in every layer
// (queries in rows, keys in columns), any floating dtype; query_tokens: L
// labels; key_tokens: S labels (for self-attention, the same list twice).
// Labels and title are UTF-8 and may hold any characters: they are escaped.
// ShapeError when the shapes and the token counts disagree.
// What the page can say of each head beyond its weights: which heads each
// layer has (ids; the others' panels are pruned, grey, and left out of the
// mean) and each head's importance (shown beside the head selector and under
// its thumbnail; NaN = none). Empty: every head there, no importance.
struct HeadNotes {
  std::vector<std::vector<int64_t>> present;    // [layer] → head ids
  std::vector<std::vector<double>> importance;  // [layer][head]
};
std::string attention_html(const std::vector<Tensor>& weights, const std::vector<std::string>& query_tokens,
                           const std::vector<std::string>& key_tokens, const std::string& title = "Attention",
                           const HeadNotes& notes = {});

// attention_html written to `path` atomically (temporary file, fsync, rename).
void save_attention_html(const std::string& path, const std::vector<Tensor>& weights,
                         const std::vector<std::string>& query_tokens, const std::vector<std::string>& key_tokens,
                         const std::string& title = "Attention", const HeadNotes& notes = {});

}  // namespace mha::viz
