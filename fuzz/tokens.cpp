// Fuzzes the token parser behind `--input` of viz and generate: refused with
// ValueError or parsed into valid ids, which format and parse back the same.
#include <cstdint>
#include <string>

#include "fuzz.h"
#include "mha/train/tasks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mha;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::refusals_allowed([&] {
    const std::vector<int64_t> ids = train::parse_tokens(text, "fuzz");
    for (int64_t id : ids)
      if (id < 0 || id >= train::kVocab) fuzz::finding("token id " + std::to_string(id) + " outside the vocabulary");
    if (train::parse_tokens(train::format_tokens(ids), "fuzz") != ids) fuzz::finding("format then parse changed the ids");
  });
  return 0;
}
