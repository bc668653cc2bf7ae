// Loading, splitting and batching the 8×8 digits.
#include "mha/train/digits.h"

#include <zlib.h>

#include <algorithm>
#include <numeric>

#include "check.h"
#include "mha/errors.h"

namespace mha::train {

namespace {

constexpr const char* kLoad = "mha::train::load_digits";

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw FormatError(std::string("[") + kLoad + "] " + path + ": " + what);
}

// The whole decompressed file.
std::string read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) bad(path, "cannot open (the digits come with Debian's python3-sklearn)");
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, size_t(n));
  // A stream cut short ends reading without a negative count: zlib reports it
  // as Z_BUF_ERROR ("unexpected end of file").
  int err = Z_OK;
  const std::string message = gzerror(f, &err);
  gzclose(f);
  if (n < 0 || err != Z_OK) bad(path, "corrupt or truncated gzip data: " + message);
  return text;
}

}  // namespace

DigitImages load_digits(const std::string& path) { return parse_digits(read_gzip(path), path); }

DigitImages parse_digits(const std::string& text, const std::string& path) {
  std::vector<float> pixels;
  DigitImages out;
  size_t line_start = 0;
  int64_t line = 0;
  while (line_start < text.size()) {
    size_t end = text.find('\n', line_start);
    if (end == std::string::npos) end = text.size();
    ++line;
    std::vector<int64_t> values;
    const char* p = text.data() + line_start;
    const char* stop = text.data() + end;
    while (p < stop) {
      char* next = nullptr;
      const long v = std::strtol(p, &next, 10);
      // strtol skips leading whitespace, newlines too: a number it finds past the line's end is not this line's.
      if (next == p || next > stop) bad(path, "line " + std::to_string(line) + ": expected integers separated by commas");
      values.push_back(v);
      p = next;
      if (p < stop && *p == ',') ++p;
      while (p < stop && (*p == '\r' || *p == ' ')) ++p;
    }
    line_start = end + 1;
    if (values.empty()) continue;
    if (values.size() != size_t(kDigitPixels + 1))
      bad(path, "line " + std::to_string(line) + ": expected 65 values (64 pixels, a label); got " +
                    std::to_string(values.size()));
    for (int64_t i = 0; i < kDigitPixels; ++i) {
      if (values[size_t(i)] < 0 || values[size_t(i)] > 16)
        bad(path, "line " + std::to_string(line) + ": pixel values must be in [0, 16]");
      pixels.push_back(float(values[size_t(i)]) / 16.0f);
    }
    if (values.back() < 0 || values.back() >= kDigitClasses)
      bad(path, "line " + std::to_string(line) + ": the label must be in [0, 10)");
    out.labels.push_back(values.back());
  }
  if (out.labels.empty()) bad(path, "no images");
  out.pixels = Tensor::from_values(pixels, {out.size(), kDigitPixels});
  return out;
}

std::string default_digits_path() {
#ifdef MHA_DIGITS_PATH
  return MHA_DIGITS_PATH;
#else
  return "";
#endif
}

DigitSplit split_digits(const DigitImages& all, int64_t heldout, uint64_t seed) {
  if (heldout < 1 || heldout >= all.size())
    raise<ValueError>("mha::train::split_digits", "heldout", "in [1, " + std::to_string(all.size()) + ")",
                      std::to_string(heldout));
  std::vector<int64_t> order(size_t(all.size()));
  std::iota(order.begin(), order.end(), 0);
  Generator gen(seed);
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[size_t(gen.next_u64() % i)]);
  const auto take = [&](size_t first, size_t last) {
    DigitImages part;
    std::vector<float> px;
    const float* src = all.pixels.data<float>();
    for (size_t i = first; i < last; ++i) {
      px.insert(px.end(), src + order[i] * kDigitPixels, src + (order[i] + 1) * kDigitPixels);
      part.labels.push_back(all.labels[size_t(order[i])]);
    }
    part.pixels = Tensor::from_values(px, {part.size(), kDigitPixels});
    return part;
  };
  return {take(size_t(heldout), order.size()), take(0, size_t(heldout))};
}

Tensor digit_batch(const DigitImages& images, const std::vector<int64_t>& index, Generator* gen, int64_t max_shift) {
  Tensor out = Tensor::zeros({int64_t(index.size()), kDigitPixels});
  float* dst = out.data<float>();
  const float* src = images.pixels.data<float>();
  const auto shift = [&] { return gen ? int64_t(gen->next_u64() % uint64_t(2 * max_shift + 1)) - max_shift : 0; };
  for (size_t b = 0; b < index.size(); ++b) {
    const int64_t dy = shift(), dx = shift();
    const float* img = src + index[b] * kDigitPixels;
    for (int64_t y = 0; y < kDigitSide; ++y)
      for (int64_t x = 0; x < kDigitSide; ++x) {
        const int64_t sy = y - dy, sx = x - dx;
        if (sy >= 0 && sy < kDigitSide && sx >= 0 && sx < kDigitSide)
          dst[int64_t(b) * kDigitPixels + y * kDigitSide + x] = img[sy * kDigitSide + sx];
      }
  }
  return out;
}

}  // namespace mha::train
