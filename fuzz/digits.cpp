// Fuzzes the digits loader's CSV parser: refused with FormatError or parsed
// into n images of 64 pixels in [0, 1] with labels in [0, 10).
#include <cstdint>
#include <string>

#include "fuzz.h"
#include "mha/train/digits.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::refusals_allowed([&] {
    const train::DigitImages d = train::parse_digits(text, "digits.csv");
    if (d.pixels.shape() != Shape{d.size(), train::kDigitPixels}) fuzz::finding("pixels of the wrong shape");
    for (double x : d.pixels.to_vector())
      if (!(x >= 0 && x <= 1)) fuzz::finding("a pixel outside [0, 1]");
    for (int64_t l : d.labels)
      if (l < 0 || l >= train::kDigitClasses) fuzz::finding("a label outside [0, 10)");
  });
  return 0;
}
