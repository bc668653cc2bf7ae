// The attention variants as the attention of MultiheadAttention and of the
// models: equal to full attention under the equivalent mask where the variant
// is exact, finite-difference gradients of the input and every parameter,
// typed errors for what each refuses, checkpoints, decoding without a KV
// cache, and every kind training through the trainer. Also ListOps and the
// encoder's batch layout.
#include <cstdio>
#include <filesystem>

#include "mha/train/checkpoint.h"
#include "variants_testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

constexpr AttentionKind kVariants[] = {AttentionKind::window,    AttentionKind::strided,   AttentionKind::bigbird,
                                       AttentionKind::linear,    AttentionKind::performer, AttentionKind::linformer,
                                       AttentionKind::lsh,       AttentionKind::axial};

// Settings small enough that a sequence of 6 spans several blocks, chunks and rows.
AttentionVariant small_variant(AttentionKind kind) {
  return {.kind = kind, .window = 2, .block = 2, .local_blocks = 1, .stride_blocks = 2, .global_blocks = 1,
          .window_blocks = 1, .random_blocks = 1, .features = 16, .redraw_every = 2, .projected = 4,
          .max_length = 12, .buckets = 2, .hashes = 2, .chunk = 3, .axial_width = 3, .seed = 5};
}

MultiheadAttentionConfig attention_config(AttentionKind kind, DType dtype = DType::float64) {
  return {.embed_dim = 8, .num_heads = 2, .batch_first = true, .dtype = dtype, .attention = small_variant(kind)};
}

MultiheadAttentionInputs self_inputs(bool causal, const Tensor& mask = {}) {
  return {.need_weights = false, .attn_mask = mask, .is_causal = causal};
}

// A bool attn_mask in torch's convention (true = may NOT attend) from a
// "may attend" predicate.
template <class Visible>
Tensor blocked_mask(int64_t L, Visible visible) {
  std::vector<bool> blocked;
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) blocked.push_back(!visible(i, j));
  return Tensor::from_bools(blocked, {L, L});
}

}  // namespace

// Each variant in a MultiheadAttention: the gradient of self-attention's one
// input (the sum of dquery, dkey and dvalue) and of every parameter, causal
// too where the variant has a causal form. Eval mode keeps Performer's
// features fixed between the loss evaluations.
TEST(VariantAttention, GradientsOfTheInputAndEveryParameter) {
  for (AttentionKind kind : kVariants)
    for (bool causal : {false, true}) {
      const AttentionVariant variant = small_variant(kind);
      if (causal && !variant.supports_causal()) continue;
      SCOPED_TRACE(to_string(kind) + (causal ? " causal" : ""));
      Generator g(3);
      MultiheadAttention m(attention_config(kind), g);
      m.eval();
      Tensor x = random_tensor({2, 6, 8}, 11);
      const Tensor r = random_tensor({2, 6, 8}, 12);
      const Tensor y = m.forward(x, x, x, self_inputs(causal)).output;
      m.zero_grad();
      const MultiheadAttentionInputGradients d = m.backward(r);
      Tensor dx = Tensor::empty(x.shape(), DType::float64);
      std::vector<double> sum = d.dquery.to_vector(), dk = d.dkey.to_vector(), dv = d.dvalue.to_vector();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += dk[i] + dv[i];
      dx = Tensor::from_values(sum, x.shape(), DType::float64);
      auto loss = [&] { return weighted_sum(m.forward(x, x, x, self_inputs(causal)).output, r); };
      double worst = gradient_error(x, dx, loss);
      EXPECT_LT(worst, 1e-6) << "x";
      for (NamedParameter& p : m.named_parameters()) {
        const double e = gradient_error(*p.value, *p.grad, loss);
        EXPECT_LT(e, 1e-6) << p.name;
        worst = std::max(worst, e);
      }
      std::printf("  %-18s worst relative gradient error %.1e\n",
                  (to_string(kind) + (causal ? " causal" : "")).c_str(), worst);
    }
}

// Window, strided and BigBird are exact within their patterns: the module
// with the variant equals the same module with full attention and the
// pattern as attn_mask, outputs and gradients.
TEST(VariantAttention, ExactPatternsEqualFullAttentionWithTheirMask) {
  const int64_t L = 7;
  for (AttentionKind kind : {AttentionKind::window, AttentionKind::strided, AttentionKind::bigbird})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(to_string(kind) + (causal ? " causal" : ""));
      const AttentionVariant v = small_variant(kind);
      Tensor mask;
      if (kind == AttentionKind::window) {
        mask = blocked_mask(L, [&](int64_t i, int64_t j) { return std::abs(i - j) <= v.window; });
      } else {
        const BlockSparseLayout layout =
            kind == AttentionKind::strided
                ? strided_layout(L, {.block = v.block, .local_blocks = v.local_blocks, .stride_blocks = v.stride_blocks},
                                 causal)
                : bigbird_layout(L, {.block = v.block, .global_blocks = v.global_blocks,
                                     .window_blocks = v.window_blocks, .random_blocks = v.random_blocks,
                                     .seed = v.seed},
                                 causal);
        const Tensor visible = block_sparse_mask(layout, L, L, causal);
        mask = blocked_mask(L, [&](int64_t i, int64_t j) { return visible.item({i, j}) != 0.0; });
      }
      Generator g1(4), g2(4);
      MultiheadAttention variant(attention_config(kind), g1), full(attention_config(AttentionKind::full), g2);
      const Tensor x = random_tensor({2, L, 8}, 21), r = random_tensor({2, L, 8}, 22);
      const Tensor a = variant.forward(x, x, x, self_inputs(causal)).output;
      const Tensor b = full.forward(x, x, x, self_inputs(causal, mask)).output;
      EXPECT_LT(max_abs_diff(a, b), 1e-12);
      variant.zero_grad(), full.zero_grad();
      const MultiheadAttentionInputGradients da = variant.backward(r), db = full.backward(r);
      EXPECT_LT(max_abs_diff(da.dquery, db.dquery), 1e-12);
      EXPECT_LT(max_abs_diff(da.dkey, db.dkey), 1e-12);
      EXPECT_LT(max_abs_diff(da.dvalue, db.dvalue), 1e-12);
      EXPECT_LT(max_abs_diff(variant.in_proj_weight_grad, full.in_proj_weight_grad), 1e-12);
    }
}

// Performer draws its features once per redraw_every training forwards;
// eval keeps the last training draw.
TEST(VariantAttention, PerformerRedrawsItsFeaturesOnSchedule) {
  Generator g(6);
  MultiheadAttention m(attention_config(AttentionKind::performer), g);  // redraw_every = 2
  const Tensor x = random_tensor({1, 6, 8}, 31);
  auto run = [&] { return m.forward(x, x, x, self_inputs(false)).output; };
  const Tensor t0 = run(), t1 = run(), t2 = run();
  EXPECT_EQ(max_abs_diff(t0, t1), 0.0);
  EXPECT_GT(max_abs_diff(t1, t2), 1e-6);
  m.eval();
  EXPECT_EQ(max_abs_diff(run(), t2), 0.0);
  EXPECT_EQ(max_abs_diff(run(), t2), 0.0);
}

TEST(VariantAttention, RefusesWhatItCannotCompute) {
  Generator g(7);
  const Tensor x = random_tensor({1, 6, 8}, 41), y = random_tensor({1, 6, 8}, 42);
  MultiheadAttention linear(attention_config(AttentionKind::linear), g);
  expect_error<ValueError>([&] { linear.forward(x, x, x); }, "need_weights: expected false with linear attention");
  expect_error<ValueError>([&] { linear.forward(x, x, x, self_inputs(false, blocked_mask(6, [](int64_t, int64_t) { return true; }))); },
               "no attn_mask, key_padding_mask or attn_bias with linear attention");
  KVCache cache;
  expect_error<ValueError>([&] { linear.forward_cached(x, cache); }, "config.attention: expected full or window");
  MultiheadAttentionConfig dropout = attention_config(AttentionKind::performer);
  dropout.dropout = 0.1;
  expect_error<ValueError>([&] { MultiheadAttention m(dropout, g); }, "dropout: expected 0 with performer attention");
  MultiheadAttention linformer(attention_config(AttentionKind::linformer), g);
  expect_error<ValueError>([&] { linformer.forward(x, x, x, self_inputs(true)); }, "linformer attention has no causal form");
  const Tensor long_x = random_tensor({1, 13, 8}, 43);
  EXPECT_THROW(linformer.forward(long_x, long_x, long_x, self_inputs(false)), ShapeError);  // 13 > max_length 12
  MultiheadAttention lsh(attention_config(AttentionKind::lsh), g);
  expect_error<ValueError>([&] { lsh.forward(x, y, y, self_inputs(false)); }, "lsh attention is self-attention");
  MultiheadAttention axial(attention_config(AttentionKind::axial), g);
  const Tensor odd = random_tensor({1, 7, 8}, 44);
  EXPECT_THROW(axial.forward(odd, odd, odd, self_inputs(false)), ShapeError);  // 7 is no multiple of width 3
  MultiheadAttentionConfig bad = attention_config(AttentionKind::lsh);
  bad.attention.buckets = 3;
  expect_error<ValueError>([&] { MultiheadAttention m(bad, g); }, "attention.buckets");
  LanguageModelConfig lm{.vocab_size = 5, .d_model = 8, .nhead = 2, .num_layers = 1, .dim_feedforward = 8,
                         .dtype = DType::float64};
  lm.attention = small_variant(AttentionKind::axial);
  expect_error<ValueError>([&] { LanguageModel model(lm, g); }, "one with a causal form for a causal model");
  lm.attention = small_variant(AttentionKind::linear);
  lm.position = Position::alibi;
  expect_error<ValueError>([&] { LanguageModel model(lm, g); }, "sinusoidal, learned or rope with linear attention");
}

namespace {

train::TaskConfig reverse_task() {
  return {.task = train::Task::reverse, .min_length = 3, .max_length = 5, .heldout = 16};
}

LanguageModelConfig small_model(AttentionKind kind, int64_t max_length) {
  LanguageModelConfig c{.vocab_size = train::kVocab, .d_model = 16, .nhead = 2, .num_layers = 1, .dim_feedforward = 32};
  c.attention = small_variant(kind);
  c.attention.max_length = max_length;
  return c;
}

}  // namespace

// Every kind trains through the trainer on the (bidirectional) encoder: within
// 150 steps of reverse the training loss falls by a fifth. (A one-layer
// strided or window pattern cannot see every position a reversal reads, so
// the bar is learning, not solving.)
TEST(VariantAttention, EveryKindTrainsOnTheEncoder) {
  const train::TaskData data(reverse_task(), 1);
  for (AttentionKind kind : kVariants) {
    SCOPED_TRACE(to_string(kind));
    Generator g(8);
    auto model = train::make_task_model(train::Architecture::encoder, small_model(kind, train::max_sequence(data.config())), 0, g);
    std::vector<double> losses;
    const train::TrainResult r = train::train(
        *model, data, {.steps = 150, .batch_size = 16, .lr = 1e-2, .min_lr = 1e-3, .warmup = 5, .eval_every = 150},
        [&](const train::TrainProgress& p) { losses.push_back(p.loss); });
    ASSERT_EQ(losses.size(), 150u);
    const double first = (losses[0] + losses[1] + losses[2]) / 3, last = (losses[147] + losses[148] + losses[149]) / 3;
    EXPECT_LT(last, 0.8 * first) << first << " -> " << last;
    EXPECT_GE(r.heldout_token_accuracy, 0.0);
    std::printf("  %-10s loss %.3f -> %.3f, held-out token accuracy %.0f%%\n", to_string(kind).c_str(), first, last,
                100 * r.heldout_token_accuracy);
  }
}

// A decoder-only model whose attention has no KV cache decodes by running
// the whole sequence again: its answers are the greedy argmaxes of full
// forwards, token by token.
TEST(VariantAttention, DecodingWithoutACacheIsGreedyOverFullForwards) {
  Generator g(9);
  const LanguageModelConfig c = small_model(AttentionKind::linear, 64);
  train::DecoderOnly model(std::make_unique<LanguageModel>(c, g));
  model.eval();
  const std::vector<int64_t> input{3, 1, 4, 1};
  const std::vector<int64_t> got = train::generate(model, {input}, 6)[0];
  std::vector<int64_t> sequence{train::kBos, 3, 1, 4, 1, train::kSep}, want;
  for (int step = 0; step < 6; ++step) {
    const Tensor logits = model.model().forward(train::token_tensor(sequence, 1, int64_t(sequence.size())));
    const int64_t T = logits.size(1), V = logits.size(2);
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (logits.item({0, T - 1, v}) > logits.item({0, T - 1, best})) best = v;
    if (best == train::kEos) break;
    want.push_back(best);
    sequence.push_back(best);
  }
  EXPECT_EQ(got, want);
}

// The attention settings and Linformer's projections survive a checkpoint:
// the reloaded model gives the same logits.
TEST(VariantAttention, CheckpointsKeepTheVariantAndItsParameters) {
  const train::TaskData data(reverse_task(), 2);
  for (AttentionKind kind : {AttentionKind::linformer, AttentionKind::performer, AttentionKind::lsh}) {
    SCOPED_TRACE(to_string(kind));
    Generator g(10);
    const LanguageModelConfig c = small_model(kind, train::max_sequence(data.config()));
    auto model = train::make_task_model(train::Architecture::encoder, c, 0, g);
    train::train(*model, data, {.steps = 3, .batch_size = 4, .eval_every = 0});
    const std::string dir = temp_dir("mha_variant_");
    train::save_checkpoint(dir, *model,
                           {.model = c, .task = reverse_task(), .seed = 2, .architecture = train::Architecture::encoder});
    train::LoadedCheckpoint loaded = train::load_checkpoint(dir);
    EXPECT_EQ(loaded.info.model.attention.kind, kind);
    EXPECT_EQ(loaded.info.model.attention.max_length, c.attention.max_length);
    model->eval();
    const train::Batch b = model->make_batch(data.heldout());
    EXPECT_EQ(max_abs_diff(model->forward(b), loaded.model->forward(b)), 0.0);
    std::filesystem::remove_all(dir);
  }
}

TEST(ListOps, EvaluatesExpressions) {
  using namespace train;
  EXPECT_EQ(evaluate_listops({7}), 7);
  EXPECT_EQ(evaluate_listops({kMax, 3, kMin, 4, 7, kClose, 1, kClose}), 4);
  EXPECT_EQ(evaluate_listops({kMed, 1, 9, 4, kClose}), 4);
  EXPECT_EQ(evaluate_listops({kMed, 1, 8, 4, 9, kClose}), 6);  // (4 + 8) / 2
  EXPECT_EQ(evaluate_listops({kSumMod, 9, 8, kMax, 5, 2, kClose, kClose}), 2);  // (9 + 8 + 5) mod 10
  EXPECT_THROW(evaluate_listops({kMax, 3}), ValueError);
  EXPECT_THROW(evaluate_listops({kClose}), ValueError);
  EXPECT_THROW(evaluate_listops({3, 4}), ValueError);
  EXPECT_EQ(parse_tokens("[MAX 3 [MIN 4 7 ] 1 ]", "test"), (std::vector<int64_t>{kMax, 3, kMin, 4, 7, kClose, 1, kClose}));
  EXPECT_EQ(format_tokens({kMax, 3, kMin, 4, 7, kClose, 1, kClose}), "[MAX 3 [MIN 4 7 ] 1 ]");
  EXPECT_THROW(parse_tokens("[AVG 3 ]", "test"), ValueError);
}

// Generated expressions have the lengths asked for, nest at most max_depth
// deep, are well formed, and their output is their value.
TEST(ListOps, GeneratesExpressionsOfTheLengthsAskedFor) {
  using namespace train;
  const TaskData data({.task = Task::listops, .min_length = 40, .max_length = 300, .heldout = 64, .max_args = 4,
                       .max_depth = 5},
                      3);
  Generator g(4);
  std::vector<int64_t> counts(10, 0);
  for (int i = 0; i < 200; ++i) {
    const Example e = i < 64 ? data.heldout()[size_t(i)] : data.sample(g);
    EXPECT_GE(int64_t(e.input.size()), 40);
    EXPECT_LE(int64_t(e.input.size()), 300);
    ASSERT_EQ(e.output.size(), 1u);
    EXPECT_EQ(e.output[0], evaluate_listops(e.input));
    int64_t depth = 0, deepest = 0;
    for (int64_t t : e.input) {
      if (t >= kMax && t <= kSumMod) deepest = std::max(deepest, ++depth);
      if (t == kClose) --depth;
    }
    EXPECT_LE(deepest, 5);
    EXPECT_GE(deepest, 2);
    ++counts[size_t(e.output[0])];
  }
  EXPECT_EQ(output_length(data.config(), data.heldout()[0].input), 1);
  int64_t answers = 0;
  for (int64_t c : counts) answers += c > 0;
  EXPECT_GE(answers, 6);  // not a constant answer
}

// The encoder's layout: BOS input SEP and one MASK per output token, PAD up
// to a multiple; targets at the MASKs only.
TEST(ListOps, EncoderBatchLayout) {
  using namespace train;
  const Batch b = make_encoder_batch({{{3, 1, 4}, {4, 1, 3}}, {{5}, {5}}}, 4);
  ASSERT_EQ(b.rows, 2);
  ASSERT_EQ(b.length, 8);  // 3 + 3 + 2 = 8
  EXPECT_EQ(std::vector<int64_t>(b.ids.begin(), b.ids.begin() + 8),
            (std::vector<int64_t>{kBos, 3, 1, 4, kSep, kMask, kMask, kMask}));
  EXPECT_EQ(std::vector<int64_t>(b.targets.begin(), b.targets.begin() + 8),
            (std::vector<int64_t>{-100, -100, -100, -100, -100, 4, 1, 3}));
  EXPECT_EQ(std::vector<int64_t>(b.ids.begin() + 8, b.ids.end()),
            (std::vector<int64_t>{kBos, 5, kSep, kMask, kPad, kPad, kPad, kPad}));
  EXPECT_EQ(std::vector<int64_t>(b.targets.begin() + 8, b.targets.end()),
            (std::vector<int64_t>{-100, -100, -100, 5, -100, -100, -100, -100}));
}
