// Position kinds: each encoding against its definition, RoPE and the
// additive bias inside MultiheadAttention (values, finite-difference
// gradients, the KV-cache path against the full forward).
#include "mha/train/trainer.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

double dot(const Tensor& a, const Tensor& b) { return weighted_sum(a, b); }

// x (1, E) rotated to `position`.
Tensor rotated(const Tensor& x, int64_t position) {
  Tensor y = x.clone();
  rotate_positions_(y, position);
  return y;
}

}  // namespace

TEST(Positional, NamesRoundTrip) {
  for (Position p : {Position::sinusoidal, Position::learned, Position::relative, Position::rope, Position::alibi})
    EXPECT_EQ(parse_position(to_string(p)), p);
  try {
    parse_position("absolute");
    ADD_FAILURE() << "no ValueError";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "[mha::nn::parse_position] name: expected sinusoidal, learned, relative, rope or alibi; "
                           "got 'absolute'");
  }
}

TEST(Positional, RotaryDependsOnlyOnRelativePosition) {
  const Tensor q = random_tensor({1, 8}, 1), k = random_tensor({1, 8}, 2);
  // q_m · k_n = q · R(n − m) k: the same for every pair with m − n = 2.
  const double at_2_0 = dot(rotated(q, 2), rotated(k, 0));
  for (int64_t n : {1, 7, 100, 4096}) EXPECT_NEAR(dot(rotated(q, n + 2), rotated(k, n)), at_2_0, 1e-12) << n;
  EXPECT_GT(std::abs(dot(rotated(q, 3), rotated(k, 0)) - at_2_0), 1e-3);  // and it does depend on m − n
  // Position 0 is the identity; a rotation keeps the norm; inverse undoes it.
  EXPECT_EQ(max_abs_diff(rotated(q, 0), q), 0.0);
  EXPECT_NEAR(dot(rotated(q, 37), rotated(q, 37)), dot(q, q), 1e-12);
  Tensor back = rotated(q, 37);
  rotate_positions_(back, 37, 10000.0, true);
  EXPECT_LE(max_abs_diff(back, q), 1e-14);
  // Pair i = 1 of E = 8 at position 5 turns by 5 · 10000^(−2/8).
  const double theta = 5 * std::pow(10000.0, -0.25), a = q.item({0, 2}), b = q.item({0, 3});
  EXPECT_NEAR(rotated(q, 5).item({0, 2}), a * std::cos(theta) - b * std::sin(theta), 1e-14);
  EXPECT_NEAR(rotated(q, 5).item({0, 3}), a * std::sin(theta) + b * std::cos(theta), 1e-14);
  // Rows of a strided view sit at offset + row.
  Tensor rows = random_tensor({2, 3, 8}, 3);
  Tensor expected = rows.slice(1, 2, 3).clone();  // (2, 1, 8): one row, at position 9
  rotate_positions_(expected, 9);
  rotate_positions_(rows.slice(1, 1, 3), 8);
  EXPECT_LE(max_abs_diff(rows.slice(1, 2, 3), expected), 1e-14);
  EXPECT_THROW(rotate_positions_(random_tensor({2, 5}, 1)), ShapeError);
  EXPECT_THROW(rotate_positions_(random_tensor({2, 4}, 1), -1), ValueError);
}

TEST(Positional, AlibiSlopesAndBias) {
  const std::vector<double> eight = alibi_slopes(8);
  for (size_t h = 0; h < 8; ++h) EXPECT_EQ(eight[h], 1.0 / double(2 << h));  // 1/2 … 1/256
  // Not a power of two: the slopes of 4, then every other slope of 8.
  EXPECT_EQ(alibi_slopes(6), (std::vector<double>{1.0 / 4, 1.0 / 16, 1.0 / 64, 1.0 / 256, 1.0 / 2, 1.0 / 8}));
  const Tensor bias = alibi_bias(2, 3, 7, 4, DType::float64);  // (1, H, L, S); queries at 4, 5, 6
  EXPECT_EQ(bias.shape(), (Shape{1, 2, 3, 7}));
  EXPECT_EQ(bias.item({0, 0, 1, 5}), 0.0);
  EXPECT_EQ(bias.item({0, 0, 1, 2}), -3 * std::exp2(-4.0));
  EXPECT_EQ(bias.item({0, 1, 2, 0}), -6 * std::exp2(-8.0));
  EXPECT_THROW(alibi_slopes(0), ValueError);
}

TEST(Positional, T5Buckets) {
  // transformers' T5Attention._relative_position_bucket with 32 buckets, max_distance 128.
  const std::vector<std::pair<int64_t, int64_t>> causal{{0, 0},   {-1, 1},   {-15, 15},  {-16, 16}, {-20, 17},
                                                        {-32, 21}, {-64, 26}, {-127, 31}, {-500, 31}, {3, 0}};
  for (auto [distance, bucket] : causal) EXPECT_EQ(relative_position_bucket(distance), bucket) << distance;
  const std::vector<std::pair<int64_t, int64_t>> both{{0, 0},    {-3, 3},   {3, 19},   {-8, 8},     {-16, 10},
                                                      {16, 26},  {-64, 14}, {100, 31}, {-128, 15}};
  for (auto [distance, bucket] : both) EXPECT_EQ(relative_position_bucket(distance, true), bucket) << distance;
  // The table for queries at 5, 6 against keys 0 … 7: bucket of key − query.
  const Tensor table = relative_position_buckets(2, 8, 5, false, 8, 20);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 8; ++j)
      EXPECT_EQ(table.item({i, j}), double(relative_position_bucket(j - 5 - i, false, 8, 20)));
  EXPECT_THROW(relative_position_bucket(0, false, 1), ValueError);
  EXPECT_THROW(relative_position_bucket(0, true, 32, 8), ValueError);
}

TEST(MultiheadAttention, AttnBiasIsAnAdditiveMaskWithAGradient) {
  Generator g(1);
  MultiheadAttention attention({.embed_dim = 6, .num_heads = 3, .batch_first = true, .dtype = DType::float64}, g);
  const Tensor x = random_tensor({2, 4, 6}, 2), bias = random_tensor({1, 3, 4, 4}, 3);
  // The same numbers as torch's per-head float attn_mask (N·H, L, S).
  const Tensor as_mask = bias.expand({2, 3, 4, 4}).contiguous().view({6, 4, 4});
  const Tensor want = attention.forward(x, x, x, {.attn_mask = as_mask, .is_causal = true}).output;
  EXPECT_LE(max_abs_diff(attention.forward(x, x, x, {.is_causal = true, .attn_bias = bias}).output, want), 1e-14);
  // Gradients, alone and combined with a key padding mask (another code path).
  const Tensor r = random_tensor({2, 4, 6}, 4);
  const Tensor kpm = Tensor::from_bools({false, false, false, false, false, false, true, false}, {2, 4});
  for (bool padded : {false, true}) {
    SCOPED_TRACE(padded ? "with key_padding_mask" : "bias alone");
    const MultiheadAttentionInputs in{.key_padding_mask = padded ? kpm : Tensor(), .is_causal = true,
                                      .attn_bias = bias, .attn_bias_grad = true};
    attention.forward(x, x, x, in);
    const Tensor dbias = attention.backward(r).dattn_bias;
    auto loss = [&] { return weighted_sum(attention.forward(x, x, x, in).output, r); };
    EXPECT_LT(gradient_error(bias, dbias, loss), 1e-7);
  }
  EXPECT_THROW(attention.forward(x, x, x, {.attn_bias = random_tensor({3, 4, 4}, 1)}), ShapeError);
  EXPECT_THROW(attention.forward(x, x, x, {.attn_bias = bias.to(DType::float32)}), DtypeError);
}

TEST(MultiheadAttention, RotaryGradientsAndParityWhenOff) {
  Generator g1(5), g2(5);
  MultiheadAttention plain({.embed_dim = 8, .num_heads = 2, .dtype = DType::float64}, g1);
  MultiheadAttention rope({.embed_dim = 8, .num_heads = 2, .dtype = DType::float64, .rotary_base = 10000.0}, g2);
  const Tensor x = random_tensor({5, 2, 8}, 1), r = random_tensor({5, 2, 8}, 2);
  // At one position (L = S = 1) every rotation is the identity.
  const Tensor first = x.slice(0, 0, 1);
  EXPECT_LE(max_abs_diff(rope.forward(first, first, first).output, plain.forward(first, first, first).output), 1e-15);
  EXPECT_GT(max_abs_diff(rope.forward(x, x, x).output, plain.forward(x, x, x).output), 1e-3);
  rope.zero_grad();
  rope.forward(x, x, x, {.is_causal = true});
  const MultiheadAttentionInputGradients d = rope.backward(r);
  auto loss = [&] { return weighted_sum(rope.forward(x, x, x, {.is_causal = true}).output, r); };
  EXPECT_LT(gradient_error(x, add(add(d.dquery, d.dkey), d.dvalue), loss), 1e-7);
  for (NamedParameter& p : rope.named_parameters()) EXPECT_LT(gradient_error(*p.value, *p.grad, loss), 1e-7) << p.name;
  EXPECT_THROW(MultiheadAttention({.embed_dim = 6, .num_heads = 2, .rotary_base = 10000.0}, g1), ValueError);
}

TEST(MultiheadAttention, CachedDecodingEqualsTheFullForward) {
  for (bool with_rope : {false, true}) {
    SCOPED_TRACE(with_rope ? "rope" : "no rope");
    Generator g(7);
    MultiheadAttention attention({.embed_dim = 8, .num_heads = 2, .batch_first = true, .dtype = DType::float64,
                                  .rotary_base = with_rope ? std::optional(100.0) : std::nullopt},
                                 g);
    const Tensor x = random_tensor({2, 7, 8}, 1), bias = alibi_bias(2, 7, 7, 0, DType::float64);
    const Tensor full = attention.forward(x, x, x, {.is_causal = true, .attn_bias = bias}).output;
    // Rows 0-2 in one call, then one row at a time: the cache grows past its first capacity.
    KVCache cache;
    for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}}) {
      const Tensor rows = x.slice(1, begin, end), step_bias = bias.slice(2, begin, end).slice(3, 0, end);
      const Tensor out = attention.forward_cached(rows, cache, {.is_causal = true, .attn_bias = step_bias});
      EXPECT_LE(max_abs_diff(out, full.slice(1, begin, end)), 1e-13) << "rows " << begin << "-" << end;
    }
    EXPECT_EQ(cache.length, 7);
  }
  Generator g(1);
  MultiheadAttention attention({.embed_dim = 4, .num_heads = 2, .add_bias_kv = true}, g);
  KVCache cache;
  EXPECT_THROW(attention.forward_cached(Tensor::zeros({3, 4}), cache), ValueError);
}

namespace {

constexpr Position kPositions[] = {Position::sinusoidal, Position::learned, Position::relative, Position::rope,
                                   Position::alibi};

LanguageModel small_model(Position position, DType dtype, int64_t vocab = 7, int64_t max_len = 8) {
  Generator g(5);
  return LanguageModel({.vocab_size = vocab, .d_model = 4, .nhead = 2, .num_layers = 2, .dim_feedforward = 6,
                        .dtype = dtype, .position = position, .max_len = max_len, .num_buckets = 6, .max_distance = 5},
                       g);
}

Tensor ids_of(const std::vector<int64_t>& ids, int64_t rows) {
  Tensor t = Tensor::empty({rows, int64_t(ids.size()) / rows}, DType::int64);
  std::copy(ids.begin(), ids.end(), t.data<int64_t>());
  return t;
}

// Greedy decoding the slow way: the whole sequence through forward() per token.
std::vector<int64_t> greedy_without_cache(LanguageModel& model, const std::vector<int64_t>& input, int64_t max_new) {
  std::vector<int64_t> seq{train::kBos}, out;
  seq.insert(seq.end(), input.begin(), input.end());
  seq.push_back(train::kSep);
  for (int64_t step = 0; step < max_new; ++step) {
    const Tensor logits = model.forward(ids_of(seq, 1));
    const std::vector<double> last = logits.select(1, logits.size(1) - 1).to_vector();
    const int64_t next = int64_t(std::max_element(last.begin(), last.end()) - last.begin());
    if (next == train::kEos) break;
    out.push_back(next);
    seq.push_back(next);
  }
  return out;
}

}  // namespace

// One test per kind, so that each stays short.
class LanguageModelPositions : public ::testing::TestWithParam<Position> {};

TEST_P(LanguageModelPositions, GradientsOfEveryParameter) {
  const Tensor ids = ids_of({1, 2, 3, 4, 5, 6, 0, 1, 2, 3}, 2);
  const Tensor targets = Tensor::from_values(std::vector<double>{2, 3, -100, 5, 6, 0, 1, 2, 3, 4}, {2, 5}, DType::int64);
  LanguageModel model = small_model(GetParam(), DType::float64);
  model.zero_grad();
  model.backward(cross_entropy(model.forward(ids), targets).dlogits);
  auto loss = [&] { return cross_entropy(model.forward(ids), targets).loss; };
  double worst = 0;
  for (NamedParameter& p : model.named_parameters()) {
    const double e = gradient_error(*p.value, *p.grad, loss);
    EXPECT_LT(e, 1e-6) << p.name;
    worst = std::max(worst, e);
  }
  std::printf("  %s positions: worst relative gradient error %.1e\n", to_string(GetParam()).c_str(), worst);
}

INSTANTIATE_TEST_SUITE_P(Kinds, LanguageModelPositions, ::testing::ValuesIn(kPositions),
                         [](const ::testing::TestParamInfo<Position>& kind) { return to_string(kind.param); });

TEST(LanguageModel, DecodingWithTheCacheEqualsTheFullForward) {
  const Tensor ids = ids_of({1, 2, 3, 4, 5, 6, 0, 1, 2, 6, 5, 4, 3, 2, 1, 0, 6, 5}, 2);  // (2, 9)
  for (Position position : kPositions) {
    SCOPED_TRACE(to_string(position));
    LanguageModel model = small_model(position, DType::float32, 7, 16);
    model.eval();
    const Tensor full = model.forward(ids);
    model.begin_decode();
    for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 5}, {5, 6}, {6, 8}, {8, 9}}) {
      const Tensor step = model.decode_step(ids.slice(1, begin, end).contiguous());
      EXPECT_LE(max_abs_diff(step, full.slice(1, begin, end)), 1e-5) << "tokens " << begin << "-" << end;
    }
    EXPECT_EQ(model.decoded_length(), 9);
    EXPECT_THROW(model.decode_step(ids_of({1}, 1)), ShapeError);  // another batch size mid-sequence
  }
}

TEST(LanguageModel, GenerateWithTheCacheEqualsGreedyDecodingWithout) {
  const std::vector<std::vector<int64_t>> inputs{{3, 1, 4}, {2, 7}, {5, 5, 5}, {9}};
  for (Position position : kPositions) {
    SCOPED_TRACE(to_string(position));
    LanguageModel model = small_model(position, DType::float64, train::kVocab, 16);
    train::DecoderOnly task_model(model);
    const auto outputs = train::generate(task_model, inputs, 6);
    model.eval();
    for (size_t i = 0; i < inputs.size(); ++i) EXPECT_EQ(outputs[i], greedy_without_cache(model, inputs[i], 6)) << i;
  }
}

TEST(LanguageModel, LongerThanTrainedWorksExceptForALearnedTable) {
  const Tensor ids = ids_of(std::vector<int64_t>(20, 3), 1);  // L = 20 > max_len = 8
  for (Position position : kPositions) {
    LanguageModel model = small_model(position, DType::float32);
    if (position != Position::learned) {
      EXPECT_TRUE(all_finite(model.forward(ids))) << to_string(position);
      continue;
    }
    try {
      model.forward(ids);
      ADD_FAILURE() << "no ValueError";
    } catch (const ValueError& e) {
      EXPECT_STREQ(e.what(), "[mha::nn::LanguageModel::forward] ids: expected at most max_len = 8 positions "
                             "(learned position embedding); got positions up to 20");
    }
    model.decode_step(ids.slice(1, 0, 8).contiguous());
    EXPECT_THROW(model.decode_step(ids.slice(1, 0, 1).contiguous()), ValueError);  // position 8
  }
}

TEST(LanguageModel, PositionSettingsAreChecked) {
  Generator g(1);
  auto make = [&](Position position, int64_t d_model, int64_t num_buckets, int64_t max_len = 8) {
    LanguageModel({.vocab_size = 5, .d_model = d_model, .nhead = 2, .num_layers = 1, .position = position,
                   .max_len = max_len, .num_buckets = num_buckets, .max_distance = 5},
                  g);
  };
  EXPECT_THROW(make(Position::rope, 6, 32), ValueError);        // head dim 3: no pairs
  EXPECT_THROW(make(Position::relative, 4, 1), ValueError);     // one bucket
  EXPECT_THROW(make(Position::relative, 4, 12), ValueError);    // max_distance 5 <= 12 / 2
  EXPECT_THROW(make(Position::learned, 4, 32, 0), ValueError);  // empty table
  make(Position::rope, 8, 32);
  make(Position::relative, 4, 8);
}
