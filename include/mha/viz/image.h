// Pictures of attention: an RGB image type, PNG encoding (libpng), and a grid
// of attention heatmaps (one panel per layer × head) with the tokens written
// on both axes and a colour scale.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha::viz {

struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // row-major, 3 bytes a pixel

  Image() = default;
  Image(int64_t w, int64_t h, uint8_t gray = 255) : width(w), height(h), rgb(size_t(w * h * 3), gray) {}
  void set(int64_t x, int64_t y, uint8_t r, uint8_t g, uint8_t b);
  const uint8_t* at(int64_t x, int64_t y) const { return &rgb[size_t((y * width + x) * 3)]; }
};

std::string encode_png(const Image& image);
Image decode_png(const std::string& bytes);  // FormatError when not a PNG this library can read
void save_png(const std::string& path, const Image& image);  // atomic

// The colour of a weight in [0, 1] (a viridis-like map: dark blue → yellow).
void colour_of(double w, uint8_t rgb[3]);

// weights: one (H, L, L) tensor per layer (queries in rows, keys in columns);
// tokens: L labels. Rows of panels are layers, columns are heads.
Image attention_grid(const std::vector<Tensor>& weights, const std::vector<std::string>& tokens);
// The same for (H, L, S) weights (cross-attention): L query and S key labels.
Image attention_grid(const std::vector<Tensor>& weights, const std::vector<std::string>& query_tokens,
                     const std::vector<std::string>& key_tokens);

// One panel of values in [0, 1] (rows × columns, e.g. a layers × heads table
// of importances) with its row and column labels and the colour scale; NaN
// cells (no value: a pruned head) are grey. attention_grid draws NaN grey too.
Image value_grid(const Tensor& values, const std::vector<std::string>& row_labels,
                 const std::vector<std::string>& column_labels);
// Pictures one under another, each under its title (ShapeError unless there
// is one title per picture).
Image stack_pictures(const std::vector<Image>& images, const std::vector<std::string>& titles);

// Geometry of attention_grid, for tests and tools: the top-left pixel of
// panel (layer, head) and the size of one cell.
struct GridLayout {
  int64_t cell, panel_x0, panel_y0, panel_stride_x, panel_stride_y;
};
GridLayout attention_grid_layout(int64_t layers, int64_t heads, const std::vector<std::string>& tokens);
GridLayout attention_grid_layout(int64_t layers, int64_t heads, const std::vector<std::string>& query_tokens,
                                  const std::vector<std::string>& key_tokens);

}  // namespace mha::viz
