// Attention pictures: PNG round trip, colours and the grid's geometry; the
// HTML page's data, escaping and self-containment.
#include <nlohmann/json.hpp>
#include <regex>

#include "mha/viz/html.h"
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

namespace {

// Two layers of (H = 2, L = 2, S = 3) weights: entry (l, h, i, j) = (l + h + i + j + 1) / 10.
std::vector<Tensor> small_weights() {
  std::vector<Tensor> weights;
  for (int64_t l = 0; l < 2; ++l) {
    weights.push_back(Tensor::zeros({2, 2, 3}, DType::float32));
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 2; ++i)
        for (int64_t j = 0; j < 3; ++j) weights.back().set_item({h, i, j}, double(l + h + i + j + 1) / 10);
  }
  return weights;
}

// The JSON the page embeds in <script type="application/json" id="attention-data">.
nlohmann::json embedded_data(const std::string& page) {
  const std::string open = "<script type=\"application/json\" id=\"attention-data\">";
  const size_t begin = page.find(open);
  EXPECT_NE(begin, std::string::npos);
  const size_t end = page.find("</script>", begin);
  return nlohmann::json::parse(page.substr(begin + open.size(), end - begin - open.size()));
}

const std::vector<std::string> kQueries{"<b>&\"'", "</script><script>alert(1)</script>"};
const std::vector<std::string> kKeys{"a", "<!--", "\xc3\xa9t\xc3\xa9"};

}  // namespace

TEST(VizHtml, EmbedsTokensAndWeights) {
  const nlohmann::json data = embedded_data(attention_html(small_weights(), kQueries, kKeys, "t"));
  EXPECT_EQ(data["query_tokens"].get<std::vector<std::string>>(), kQueries);
  EXPECT_EQ(data["key_tokens"].get<std::vector<std::string>>(), kKeys);
  EXPECT_EQ(data["title"], "t");
  ASSERT_EQ(data["weights"].size(), 2u);
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 2; ++i)
        for (int64_t j = 0; j < 3; ++j)
          EXPECT_DOUBLE_EQ(data["weights"][l][h][i][j].get<double>(), double(l + h + i + j + 1) / 10) << l << h << i << j;
  uint8_t top[3];
  colour_of(1.0, top);
  EXPECT_EQ(data["colours"][4], nlohmann::json({top[0], top[1], top[2]}));  // the PNG's colour scale
}

TEST(VizHtml, EscapesTokensAndTitle) {
  const std::string page = attention_html(small_weights(), kQueries, kKeys, "A <i>title</i> & \"quotes\" 'too'");
  EXPECT_NE(page.find("<title>A &lt;i&gt;title&lt;/i&gt; &amp; &quot;quotes&quot; &#39;too&#39;</title>"), std::string::npos);
  EXPECT_NE(page.find("<h1>A &lt;i&gt;title&lt;/i&gt; &amp; &quot;quotes&quot; &#39;too&#39;</h1>"), std::string::npos);
  EXPECT_EQ(page.find("<i>"), std::string::npos);
  EXPECT_EQ(page.find("<b>&"), std::string::npos);
  EXPECT_EQ(page.find("alert(1)</script>"), std::string::npos);
  EXPECT_EQ(page.find("<!--\""), std::string::npos);
  EXPECT_NE(page.find(R"("\u003cb\u003e\u0026\"'")"), std::string::npos);  // the first token, as JSON
  // Exactly two scripts (the data and the code): no token closed one early or opened another.
  const std::regex open_script("<script[ >]"), close_script("</script>");
  EXPECT_EQ(std::distance(std::sregex_iterator(page.begin(), page.end(), open_script), std::sregex_iterator()), 2);
  EXPECT_EQ(std::distance(std::sregex_iterator(page.begin(), page.end(), close_script), std::sregex_iterator()), 2);
  EXPECT_EQ(page.find("{{"), std::string::npos);  // every marker filled
  // Bytes that are not UTF-8 become U+FFFD instead of breaking the JSON.
  const nlohmann::json data = embedded_data(attention_html(small_weights(), {"\xff", "b"}, kKeys));
  EXPECT_EQ(data["query_tokens"][0], "\xef\xbf\xbd");
}

TEST(VizHtml, LoadsNothingFromElsewhere) {
  const std::string page = attention_html(small_weights(), kQueries, kKeys);
  for (const char* outside : {"http:", "https:", "\"//", "'//", "url(", "@import", "<link", "<iframe", "<img", "fetch(",
                              "XMLHttpRequest", "import("})
    EXPECT_EQ(page.find(outside), std::string::npos) << outside;
  EXPECT_FALSE(std::regex_search(page, std::regex(R"(\b(src|href|srcset|action)\s*=)", std::regex::icase)));
}

TEST(VizHtml, RoundsAndStoresNonFiniteAsNull) {
  Tensor w = Tensor::full({1, 1, 3}, 0.123456, DType::float64);
  w.set_item({0, 0, 1}, NAN);
  w.set_item({0, 0, 2}, INFINITY);
  const nlohmann::json data = embedded_data(attention_html({w}, {"q"}, {"a", "b", "c"}));
  EXPECT_EQ(data["weights"][0][0][0], nlohmann::json::parse("[0.1235, null, null]"));
}

TEST(VizHtml, SavesTheSamePage) {
  const std::string dir = mha::testing::temp_dir("mha_viz_"), path = dir + "/attention.html";
  save_attention_html(path, small_weights(), kQueries, kKeys, "t");
  EXPECT_EQ(mha::testing::read_bytes(path), attention_html(small_weights(), kQueries, kKeys, "t"));
  std::filesystem::remove_all(dir);
}

