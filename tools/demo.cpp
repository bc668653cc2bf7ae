// The demo: random token embeddings plus sinusoidal positions, one
// MultiheadAttention layer in evaluation mode, and each head's weights.
#include "demo.h"

#include <iomanip>
#include <map>

#include "mha/mha.h"

namespace mha::tools {

namespace {

// x[l] = embedding(token_l) + PE(l): a random vector per distinct token plus
// the sinusoidal position encoding.
Tensor embed(const std::vector<std::string>& tokens, int64_t D, Generator& gen) {
  std::map<std::string, Tensor> table;
  const int64_t L = int64_t(tokens.size());
  Tensor x = Tensor::empty({L, D});
  for (int64_t l = 0; l < L; ++l) {
    auto it = table.find(tokens[size_t(l)]);
    if (it == table.end()) it = table.emplace(tokens[size_t(l)], randn({D}, gen)).first;
    x.select(0, l).copy_(it->second);
  }
  return nn::add_sinusoidal_encoding(x);
}

}  // namespace

void run_demo(const DemoOptions& o, std::ostream& out) {
  Generator gen(o.seed);
  nn::MultiheadAttention attention({.embed_dim = o.embed_dim, .num_heads = o.num_heads}, gen);
  attention.eval();
  const Tensor x = embed(o.tokens, o.embed_dim, gen);
  const auto result = attention.forward(x, x, x, {.need_weights = true, .average_attn_weights = false});
  const int64_t L = x.size(0);

  out << "mha " << version << " demo: multi-head self-attention, embed_dim " << o.embed_dim << ", "
      << o.num_heads << " heads of dim " << attention.head_dim() << ", seed " << o.seed << "\n";
  out << "input  " << shape_string(x.shape()) << "  (tokens × embed_dim)\n";
  out << "output " << shape_string(result.output.shape()) << "\n";
  out << "weights " << shape_string(result.weights.shape()) << "  (heads × queries × keys)\n";
  size_t width = 6;
  for (const std::string& t : o.tokens) width = std::max(width, t.size() + 1);
  for (int64_t h = 0; h < o.num_heads; ++h) {
    out << "\nhead " << h << ": row = query, column = key, each row sums to 1\n";
    out << std::setw(int(width)) << "";
    for (const std::string& t : o.tokens) out << std::setw(int(width)) << t;
    out << "\n";
    for (int64_t i = 0; i < L; ++i) {
      out << std::setw(int(width)) << o.tokens[size_t(i)];
      for (int64_t j = 0; j < L; ++j)
        out << std::setw(int(width)) << std::fixed << std::setprecision(3) << result.weights.item({h, i, j});
      out << "\n";
    }
  }
}

}  // namespace mha::tools
