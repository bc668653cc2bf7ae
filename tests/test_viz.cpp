// Attention pictures: PNG round trip, colours and the grid's geometry; the
// HTML page's data, escaping and self-containment.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <regex>

#include "mha/io/safetensors.h"
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

TEST(Viz, CrossAttentionGridAndStackedPictures) {
  // L = 3 queries, S = 4 keys (an encoder-decoder's cross-attention): the diagonal set.
  const std::vector<std::string> queries{"<s>", "3", "1"}, keys{"3", "1", "4", "1"};
  std::vector<Tensor> weights{Tensor::zeros({1, 3, 4}, DType::float64)};
  for (int64_t i = 0; i < 3; ++i) weights[0].set_item({0, i, i}, 1.0);
  const Image img = attention_grid(weights, queries, keys);
  const GridLayout g = attention_grid_layout(1, 1, queries, keys);
  uint8_t one[3], zero[3];
  colour_of(1.0, one);
  colour_of(0.0, zero);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      const uint8_t* want = i == j ? one : zero;
      EXPECT_TRUE(std::equal(want, want + 3, img.at(g.panel_x0 + j * g.cell + g.cell / 2, g.panel_y0 + i * g.cell + g.cell / 2)))
          << i << "," << j;
    }
  EXPECT_THROW(attention_grid(weights, keys, queries), ShapeError);
  // One under the other, each under a title line.
  const Image both = stack_pictures({img, img}, {"encoder self-attention", "cross-attention"});
  EXPECT_EQ(both.width, img.width);
  const int64_t title = (both.height - 2 * img.height) / 2;
  EXPECT_GT(title, 0);
  for (int64_t y : {int64_t(0), img.height / 2, img.height - 1})
    for (int64_t x : {int64_t(0), g.panel_x0 + g.cell / 2, img.width - 1}) {
      EXPECT_TRUE(std::equal(img.at(x, y), img.at(x, y) + 3, both.at(x, title + y)));
      EXPECT_TRUE(std::equal(img.at(x, y), img.at(x, y) + 3, both.at(x, 2 * title + img.height + y)));
    }
  EXPECT_THROW(stack_pictures({img}, {}), ShapeError);
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

// Which heads a layer has and each head's importance travel with the page;
// notes of the wrong shape are refused.
TEST(VizHtml, EmbedsHeadNotes) {
  const HeadNotes notes{.present = {{0, 1}, {0}}, .importance = {{0.25, 0.75}, {0.5, NAN}}};
  const nlohmann::json data = embedded_data(attention_html(small_weights(), kQueries, kKeys, "t", notes));
  EXPECT_EQ(data["present"], nlohmann::json::parse("[[0, 1], [0]]"));
  EXPECT_EQ(data["importance"], nlohmann::json::parse("[[0.25, 0.75], [0.5, null]]"));
  EXPECT_TRUE(embedded_data(attention_html(small_weights(), kQueries, kKeys))["importance"].is_null());
  mha::testing::expect_error<ShapeError>(
      [&] { attention_html(small_weights(), kQueries, kKeys, "t", {.importance = {{0.1, 0.2}}}); },
      {"attention_html", "notes.importance", "one entry per layer (2)"});
  mha::testing::expect_error<ShapeError>(
      [&] { attention_html(small_weights(), kQueries, kKeys, "t", {.importance = {{0.1}, {0.2}}}); },
      {"notes.importance", "one value per head (2)"});
  mha::testing::expect_error<ShapeError>(
      [&] { attention_html(small_weights(), kQueries, kKeys, "t", {.present = {{0}, {2}}}); },
      {"notes.present", "head ids in [0, 2)", "2"});
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

#ifdef MHA_CHROMIUM
namespace {

std::string unescape_text(std::string text) {  // what the DOM serializer escapes in a text node
  for (const auto& [from, to] : {std::pair{"&lt;", "<"}, {"&gt;", ">"}, {"&nbsp;", "\xc2\xa0"}, {"&amp;", "&"}})
    for (size_t at; (at = text.find(from)) != std::string::npos;) text.replace(at, std::string(from).size(), to);
  return text;
}

struct Rendered {
  nlohmann::json status;  // what the page reported in <pre id="status">
  Image screenshot;
};

// Opens the page in headless Chromium (no sandbox: the test may run as root; the
// page is our own file), lets its script run and returns its report and a screenshot.
Rendered render(const std::string& dir, const std::string& page, const std::string& fragment) {
  io::write_file_atomically(dir + "/page.html", page);
  const std::string command = "timeout 30 '" MHA_CHROMIUM "' --headless --disable-gpu --no-sandbox --no-first-run"
                              " --user-data-dir='" + dir + "/profile' --virtual-time-budget=5000 --window-size=900,700"
                              " --screenshot='" + dir + "/shot.png' --dump-dom 'file://" + dir + "/page.html#" + fragment +
                              "' 2>'" + dir + "/chromium.log'";
  std::string dom;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char buffer[4096];
    for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) dom.append(buffer, n);
    pclose(pipe);
  }
  const std::smatch found = [&] {
    std::smatch m;
    std::regex_search(dom, m, std::regex(R"(<pre id="status"[^>]*>([^<]*)</pre>)"));
    return m;
  }();
  Rendered out;
  if (found.empty()) {
    ADD_FAILURE() << "no status in the page Chromium dumped; its log:\n" << mha::testing::read_bytes(dir + "/chromium.log");
    return out;
  }
  out.status = nlohmann::json::parse(unescape_text(found[1].str()));
  out.screenshot = decode_png(mha::testing::read_bytes(dir + "/shot.png"));
  return out;
}

bool near(const uint8_t* pixel, double weight) {
  uint8_t want[3];
  colour_of(weight, want);
  for (int k = 0; k < 3; ++k)
    if (std::abs(int(pixel[k]) - int(want[k])) > 1) return false;
  return true;
}

}  // namespace

TEST(VizBrowser, DrawsTheChosenHeadAndReportsAHover) {
  const std::string dir = mha::testing::temp_dir("mha_viz_browser_");
  const Rendered r = render(dir, attention_html(small_weights(), kQueries, kKeys, "<b>title</b>"), "layer=1&head=1&hover=1,2");
  const nlohmann::json& s = r.status;
  ASSERT_TRUE(s.is_object());
  EXPECT_EQ(s["errors"], nlohmann::json::array());
  EXPECT_EQ(s["layer"], 1);
  EXPECT_EQ(s["head"], 1);
  EXPECT_EQ(s["cells"], 2 * 3);       // L × S
  EXPECT_EQ(s["thumbnails"], 2 * 3);  // layers × (heads + the mean)
  const nlohmann::json& hover = s["hover"];
  ASSERT_TRUE(hover.is_object()) << s.dump();
  EXPECT_EQ(hover["query"], 1);
  EXPECT_EQ(hover["key"], 2);
  EXPECT_EQ(hover["query_token"], kQueries[1]);  // the tokens come back as they went in
  EXPECT_EQ(hover["key_token"], kKeys[2]);
  EXPECT_DOUBLE_EQ(hover["weight"].get<double>(), 0.6);  // (l + h + i + j + 1) / 10
  EXPECT_NE(hover["text"].get<std::string>().find("0.6000"), std::string::npos) << hover["text"];
  const std::vector<uint8_t> pixel = hover["pixel"];
  EXPECT_TRUE(near(pixel.data(), 0.6)) << hover["pixel"];  // the canvas holds the weight's colour
  // The screenshot is not blank: it holds the colour of every weight of the head shown.
  const Image& shot = r.screenshot;
  ASSERT_GT(shot.width * shot.height, 0);
  for (double w : {0.3, 0.4, 0.5, 0.6, 0.7}) {
    bool seen = false;
    for (int64_t y = 0; y < shot.height && !seen; ++y)
      for (int64_t x = 0; x < shot.width && !seen; ++x) seen = near(shot.at(x, y), w);
    EXPECT_TRUE(seen) << "no pixel of the colour of " << w;
  }
  std::filesystem::remove_all(dir);
}

TEST(VizBrowser, DrawsTheMeanOfTheHeads) {
  const std::string dir = mha::testing::temp_dir("mha_viz_browser_");
  const nlohmann::json s = render(dir, attention_html(small_weights(), kQueries, kKeys), "layer=1&head=mean&hover=1,2").status;
  ASSERT_TRUE(s.is_object());
  EXPECT_EQ(s["errors"], nlohmann::json::array());
  EXPECT_EQ(s["layer"], 1);
  EXPECT_EQ(s["head"], "mean");
  EXPECT_EQ(s["cells"], 2 * 3);
  const nlohmann::json& hover = s["hover"];
  ASSERT_TRUE(hover.is_object()) << s.dump();
  EXPECT_NEAR(hover["weight"].get<double>(), 0.55, 1e-12);  // (0.5 + 0.6) / 2
  EXPECT_NE(hover["text"].get<std::string>().find("0.5500"), std::string::npos) << hover["text"];
  const std::vector<uint8_t> pixel = hover["pixel"];
  EXPECT_TRUE(near(pixel.data(), 0.55)) << hover["pixel"];
  std::filesystem::remove_all(dir);
}

// A pruned head: grey, "pruned" beside the selector, left out of its layer's
// mean; the importance of the others beside the selector.
TEST(VizBrowser, ShowsImportanceAndPrunedHeads) {
  const std::string dir = mha::testing::temp_dir("mha_viz_browser_");
  std::vector<Tensor> weights = small_weights();
  weights[1].select(0, 1).fill_(NAN);  // layer 1, head 1 pruned
  const HeadNotes notes{.present = {{0, 1}, {0}}, .importance = {{0.25, 0.75}, {0.5, NAN}}};
  const std::string page = attention_html(weights, kQueries, kKeys, "t", notes);
  nlohmann::json s = render(dir, page, "layer=0&head=1").status;
  ASSERT_TRUE(s.is_object());
  EXPECT_EQ(s["errors"], nlohmann::json::array());
  EXPECT_EQ(s["importance"], "importance 0.750");
  s = render(dir, page, "layer=1&head=1").status;
  EXPECT_EQ(s["importance"], "pruned");
  s = render(dir, page, "layer=1&head=mean&hover=1,2").status;
  EXPECT_TRUE(s["importance"].is_null());
  ASSERT_TRUE(s["hover"].is_object()) << s.dump();
  EXPECT_NEAR(s["hover"]["weight"].get<double>(), 0.5, 1e-12);  // head 0 alone: (1 + 0 + 1 + 2 + 1) / 10
  std::filesystem::remove_all(dir);
}
#else
TEST(VizBrowser, Skipped) { GTEST_SKIP() << "Chromium was not found when the build was configured"; }
#endif
