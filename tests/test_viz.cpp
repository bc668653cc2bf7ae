// Attention pictures: PNG round trip, colours and the grid's geometry.
#include <filesystem>

#include "mha/viz/image.h"
#include "testing.h"

using namespace mha;
using namespace mha::viz;

TEST(Viz, PngRoundTrip) {
  Image img(7, 5);
  img.set(3, 2, 250, 10, 20);
  const Image back = decode_png(encode_png(img));
  ASSERT_EQ(back.width, 7);
  ASSERT_EQ(back.height, 5);
  EXPECT_EQ(back.rgb, img.rgb);
  EXPECT_THROW(decode_png("not a png"), FormatError);
  std::string truncated = encode_png(img);
  truncated.resize(truncated.size() / 2);
  EXPECT_THROW(decode_png(truncated), FormatError);
}

TEST(Viz, ColourScaleEnds) {
  uint8_t lo[3], hi[3], mid[3];
  colour_of(0.0, lo);
  colour_of(1.0, hi);
  colour_of(0.5, mid);
  EXPECT_EQ(lo[0], 68);  // dark blue-violet
  EXPECT_EQ(hi[0], 253);  // yellow
  EXPECT_GT(hi[1], mid[1]);
  uint8_t nan[3];
  colour_of(NAN, nan);
  EXPECT_EQ(nan[0], lo[0]);
}

TEST(Viz, GridDrawsEachCellInItsColour) {
  // Two layers, two heads, L = 3: head 1 of layer 1 is the identity, the rest uniform.
  const std::vector<std::string> tokens{"<s>", "1", "="};
  std::vector<Tensor> weights{Tensor::full({2, 3, 3}, 1.0 / 3, DType::float64), Tensor::full({2, 3, 3}, 1.0 / 3, DType::float64)};
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 3; ++j) weights[1].set_item({1, i, j}, i == j ? 1.0 : 0.0);
  const Image img = decode_png(encode_png(attention_grid(weights, tokens)));
  const GridLayout g = attention_grid_layout(2, 2, tokens);
  auto cell = [&](int64_t layer, int64_t head, int64_t i, int64_t j) {
    return img.at(g.panel_x0 + head * g.panel_stride_x + j * g.cell + g.cell / 2,
                  g.panel_y0 + layer * g.panel_stride_y + i * g.cell + g.cell / 2);
  };
  uint8_t one[3], zero[3], third[3];
  colour_of(1.0, one);
  colour_of(0.0, zero);
  colour_of(1.0 / 3, third);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 3; ++j) {
      const uint8_t* want = i == j ? one : zero;
      EXPECT_TRUE(std::equal(want, want + 3, cell(1, 1, i, j))) << i << "," << j;
      EXPECT_TRUE(std::equal(third, third + 3, cell(0, 0, i, j)));
    }
  EXPECT_THROW(attention_grid({Tensor::zeros({2, 3, 4})}, tokens), ShapeError);
  EXPECT_THROW(attention_grid({}, tokens), ShapeError);
}
