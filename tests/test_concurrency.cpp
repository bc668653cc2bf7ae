// Many threads calling the library at once, each on its own inputs —
// attention forward and backward on both paths and in both dtypes, a variant,
// MultiheadAttention and a Transformer layer forward and backward — give the
// serial results bit for bit. scripts/tsan.sh runs this under
// ThreadSanitizer.
#include <cstring>
#include <functional>
#include <thread>

#include "mha/variants.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

using Bits = std::vector<std::vector<double>>;

// One job: builds its inputs from its seed and returns every result.
using Job = std::function<Bits(uint64_t seed)>;

Bits attention_job(uint64_t seed, DType dtype, AttentionPath path, Causal causal) {
  const Tensor q = random_tensor({2, 4, 33, 16}, seed, dtype), k = random_tensor({2, 2, 47, 16}, seed + 1, dtype),
               v = random_tensor({2, 2, 47, 8}, seed + 2, dtype), dout = random_tensor({2, 4, 33, 8}, seed + 3, dtype);
  const AttentionOptions o{.causal = causal, .dropout_p = 0.1, .dropout_seed = seed, .path = path};
  const AttentionOutput f = attention_forward(q, k, v, o);
  const AttentionGradients g = attention_backward(dout, q, k, v, f, o);
  return {f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
}

Bits linear_attention_job(uint64_t seed) {
  const Tensor q = random_tensor({2, 70, 8}, seed, DType::float32), k = random_tensor({2, 70, 8}, seed + 1, DType::float32),
               v = random_tensor({2, 70, 4}, seed + 2, DType::float32), dout = random_tensor({2, 70, 4}, seed + 3, DType::float32);
  const LinearAttentionOptions o{.causal = true};
  const LinearAttentionOutput f = linear_attention_forward(q, k, v, o);
  const AttentionGradients g = linear_attention_backward(dout, q, k, v, f, o);
  return {f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
}

Bits module_job(uint64_t seed) {
  Generator gen(seed);
  nn::MultiheadAttention attn({.embed_dim = 32, .num_heads = 4, .batch_first = true}, gen);
  const Tensor x = random_tensor({3, 21, 32}, seed + 1, DType::float32), dy = random_tensor({3, 21, 32}, seed + 2, DType::float32);
  const nn::MultiheadAttentionOutput y = attn.forward(x, x, x, {.need_weights = false, .is_causal = true});
  const nn::MultiheadAttentionInputGradients g = attn.backward(dy);
  Bits out{y.output.to_vector(), g.dquery.to_vector()};
  for (const nn::NamedParameter& p : attn.named_parameters()) out.push_back(p.grad->to_vector());
  return out;
}

Bits layer_job(uint64_t seed) {
  Generator gen(seed);
  nn::TransformerEncoderLayer layer({.d_model = 32, .nhead = 4, .dim_feedforward = 64, .dropout = 0.1, .batch_first = true,
                                     .norm_first = true},
                                    gen);
  const Tensor x = random_tensor({2, 19, 32}, seed + 1, DType::float32), dy = random_tensor({2, 19, 32}, seed + 2, DType::float32);
  const Tensor y = layer.forward(x);
  const Tensor dx = layer.backward(dy);
  Bits out{y.to_vector(), dx.to_vector()};
  for (const nn::NamedParameter& p : layer.named_parameters()) out.push_back(p.grad->to_vector());
  return out;
}

bool same_bits(const Bits& a, const Bits& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(double)) != 0)
      return false;
  return true;
}

}  // namespace

TEST(Concurrency, ThreadsOnTheirOwnInputsGiveTheSerialResultsBitForBit) {
  const std::vector<std::pair<std::string, Job>> jobs = {
      {"fused float32", [](uint64_t s) { return attention_job(s, DType::float32, AttentionPath::fused, Causal::top_left); }},
      {"fused bfloat16", [](uint64_t s) { return attention_job(s, DType::bfloat16, AttentionPath::fused, Causal::none); }},
      {"reference", [](uint64_t s) { return attention_job(s, DType::float32, AttentionPath::reference, Causal::bottom_right); }},
      {"reference float64", [](uint64_t s) { return attention_job(s, DType::float64, AttentionPath::reference, Causal::none); }},
      {"linear attention", linear_attention_job},
      {"MultiheadAttention", module_job},
      {"TransformerEncoderLayer", layer_job},
  };
  constexpr int kThreads = 8, kRounds = 3;
  // The serial results of each (job, seed).
  std::vector<Bits> serial(kThreads);
  for (int t = 0; t < kThreads; ++t) serial[size_t(t)] = jobs[size_t(t) % jobs.size()].second(uint64_t(100 + t));
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r)
        mismatches[size_t(t)] += !same_bits(jobs[size_t(t) % jobs.size()].second(uint64_t(100 + t)), serial[size_t(t)]);
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(mismatches[size_t(t)], 0) << jobs[size_t(t) % jobs.size()].first << " on thread " << t;
}
