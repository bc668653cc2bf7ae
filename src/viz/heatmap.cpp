// The attention grid: panels of heatmaps, token labels in a 5×7 font, and a
// colour scale. Layout (pixels): a left margin for row labels, a top margin
// for the panel titles and the column labels written downwards.
#include <algorithm>
#include <cmath>

#include "mha/viz/image.h"
#include "viz/common.h"
#include "viz/font.h"

namespace mha::viz {

namespace {

constexpr int64_t kCell = 12, kGap = 14, kChar = 6, kLine = 9, kBar = 12;

void draw_text(Image& img, int64_t x, int64_t y, const std::string& text, bool vertical = false) {
  for (char c : text) {
    if (const Glyph* g = glyph_of(c))
      for (int64_t r = 0; r < 7; ++r)
        for (int64_t b = 0; b < 5; ++b)
          if (g->rows[r] & (1 << (4 - b))) img.set(x + b, y + r, 20, 20, 20);
    (vertical ? y : x) += vertical ? kLine : kChar;
  }
}

int64_t longest(const std::vector<std::string>& tokens) {
  size_t n = 1;
  for (const std::string& t : tokens) n = std::max(n, t.size());
  return int64_t(n);
}

}  // namespace

void colour_of(double w, uint8_t rgb[3]) {
  w = std::clamp(std::isfinite(w) ? w : 0.0, 0.0, 1.0) * 4;
  const int i = std::min(3, int(w));
  const double f = w - i;
  for (int k = 0; k < 3; ++k) rgb[k] = uint8_t(std::lround(kColourAnchors[i][k] * (1 - f) + kColourAnchors[i + 1][k] * f));
}

GridLayout attention_grid_layout(int64_t layers, int64_t heads, const std::vector<std::string>& query_tokens,
                                  const std::vector<std::string>& key_tokens) {
  (void)layers, (void)heads;
  const int64_t L = int64_t(query_tokens.size()), S = int64_t(key_tokens.size());
  const int64_t row_label = longest(query_tokens), column_label = longest(key_tokens);
  GridLayout g;
  g.cell = kCell;
  g.panel_x0 = 4 + row_label * kChar + 4;
  g.panel_y0 = 4 + kLine + 4 + column_label * kLine + 2;
  g.panel_stride_x = S * kCell + kGap + row_label * kChar + 4;
  g.panel_stride_y = L * kCell + kGap + kLine + 4 + column_label * kLine + 2;
  return g;
}

GridLayout attention_grid_layout(int64_t layers, int64_t heads, const std::vector<std::string>& tokens) {
  return attention_grid_layout(layers, heads, tokens, tokens);
}

namespace {

// attention_grid's picture; panel_titles false leaves out the "L0 H0" over each panel.
Image draw_grid(const std::vector<Tensor>& weights, const std::vector<std::string>& query_tokens,
                const std::vector<std::string>& key_tokens, bool panel_titles) {
  const int64_t L = int64_t(query_tokens.size()), S = int64_t(key_tokens.size()), layers = int64_t(weights.size());
  const int64_t heads = check_attention_weights("mha::viz::attention_grid", weights, L, S);
  const GridLayout g = attention_grid_layout(layers, heads, query_tokens, key_tokens);
  const int64_t column_label = longest(key_tokens);
  const int64_t width = g.panel_x0 + heads * g.panel_stride_x + kBar + 8 * kChar;
  const int64_t height = g.panel_y0 + layers * g.panel_stride_y;
  Image img(width, height);
  uint8_t c[3];
  for (int64_t layer = 0; layer < layers; ++layer) {
    const std::vector<double> w = weights[size_t(layer)].to_vector();
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t x0 = g.panel_x0 + h * g.panel_stride_x, y0 = g.panel_y0 + layer * g.panel_stride_y;
      std::string title = "L";  // built step by step: GCC 12 warns (-Wrestrict) on the chained form
      title += std::to_string(layer);
      title += " H";
      title += std::to_string(h);
      if (panel_titles) draw_text(img, x0, y0 - column_label * kLine - 2 - kLine - 4, title);
      for (int64_t j = 0; j < S; ++j)
        draw_text(img, x0 + j * kCell + 3, y0 - column_label * kLine - 2, key_tokens[size_t(j)], true);
      for (int64_t i = 0; i < L; ++i) {
        draw_text(img, x0 - int64_t(query_tokens[size_t(i)].size()) * kChar - 3, y0 + i * kCell + 2,
                  query_tokens[size_t(i)]);
        for (int64_t j = 0; j < S; ++j) {
          const double v = w[size_t((h * L + i) * S + j)];
          if (std::isfinite(v)) colour_of(v, c);
          else c[0] = c[1] = c[2] = 160;  // no value (a pruned head): grey, as on the HTML page
          for (int64_t dy = 0; dy < kCell - 1; ++dy)
            for (int64_t dx = 0; dx < kCell - 1; ++dx) img.set(x0 + j * kCell + dx, y0 + i * kCell + dy, c[0], c[1], c[2]);
        }
      }
    }
  }
  // The colour scale: 0 at the bottom, 1 at the top.
  const int64_t bx = g.panel_x0 + heads * g.panel_stride_x, by = g.panel_y0, bh = std::max<int64_t>(L * kCell, 40);
  for (int64_t y = 0; y < bh; ++y) {
    colour_of(1.0 - double(y) / double(bh - 1), c);
    for (int64_t x = 0; x < kBar; ++x) img.set(bx + x, by + y, c[0], c[1], c[2]);
  }
  draw_text(img, bx + kBar + 3, by, "1");
  draw_text(img, bx + kBar + 3, by + bh - 7, "0");
  return img;
}

}  // namespace

Image attention_grid(const std::vector<Tensor>& weights, const std::vector<std::string>& query_tokens,
                     const std::vector<std::string>& key_tokens) {
  return draw_grid(weights, query_tokens, key_tokens, true);
}

Image attention_grid(const std::vector<Tensor>& weights, const std::vector<std::string>& tokens) {
  return attention_grid(weights, tokens, tokens);
}

Image value_grid(const Tensor& values, const std::vector<std::string>& row_labels,
                 const std::vector<std::string>& column_labels) {
  if (values.dim() != 2)
    raise<ShapeError>("mha::viz::value_grid", "values", "(rows, columns)", shape_string(values.shape()));
  return draw_grid({values.unsqueeze(0)}, row_labels, column_labels, false);
}

Image stack_pictures(const std::vector<Image>& images, const std::vector<std::string>& titles) {
  if (titles.size() != images.size())
    raise<ShapeError>("mha::viz::stack_pictures", "titles", "one per image (" + std::to_string(images.size()) + ")",
                      std::to_string(titles.size()));
  const int64_t title_height = 4 + kLine + 4;
  int64_t width = 0, height = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    width = std::max({width, images[i].width, 8 + int64_t(titles[i].size()) * kChar});
    height += title_height + images[i].height;
  }
  Image out(width, height);
  int64_t y = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    draw_text(out, 4, y + 4, titles[i]);
    y += title_height;
    for (int64_t row = 0; row < images[i].height; ++row)
      std::copy_n(images[i].at(0, row), images[i].width * 3, &out.rgb[size_t((y + row) * width * 3)]);
    y += images[i].height;
  }
  return out;
}

}  // namespace mha::viz
