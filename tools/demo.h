// `mha demo`: multi-head self-attention over a short sentence, printed head by head.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace mha::tools {

struct DemoOptions {
  std::vector<std::string> tokens{"the", "cat", "sat", "on", "the", "mat"};
  int64_t embed_dim = 16;
  int64_t num_heads = 4;
  uint64_t seed = 0;
};

void run_demo(const DemoOptions& options, std::ostream& out);

}  // namespace mha::tools
