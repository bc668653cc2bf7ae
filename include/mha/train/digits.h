// The 8×8 handwritten digits (UCI "Optical Recognition of Handwritten Digits",
// test set: 1797 images, 16 grey levels), as Debian's python3-sklearn ships
// them: digits.csv.gz, one image a line, 64 pixel values 0-16 then the label.
//
// The split is fixed by a seed: a shuffled `heldout` images are held out, the
// rest train; no image is in both.
#pragma once

#include <string>
#include <vector>

#include "mha/random.h"
#include "mha/tensor.h"

namespace mha::train {

constexpr int64_t kDigitSide = 8, kDigitPixels = 64, kDigitClasses = 10;

struct DigitImages {
  Tensor pixels;                 // (n, 64) float32 in [0, 1] (value / 16)
  std::vector<int64_t> labels;   // n labels in [0, 10)
  int64_t size() const { return int64_t(labels.size()); }
};

// Reads the gzip'd CSV; a missing, truncated or malformed file is refused
// with FormatError naming the line.
DigitImages load_digits(const std::string& path);
// The CSV text itself (decompressed); `path` names it in messages.
DigitImages parse_digits(const std::string& text, const std::string& path);

// Where python3-sklearn put digits.csv.gz when this build was configured, or
// "" if it was not installed then.
std::string default_digits_path();

struct DigitSplit {
  DigitImages train, heldout;
};
DigitSplit split_digits(const DigitImages& all, int64_t heldout, uint64_t seed);

// Rows `index` of `images` (a batch), each shifted by up to ±max_shift pixels
// in x and y (zeros enter at the edge) when gen is given: augmentation.
Tensor digit_batch(const DigitImages& images, const std::vector<int64_t>& index, Generator* gen = nullptr,
                   int64_t max_shift = 1);

}  // namespace mha::train
