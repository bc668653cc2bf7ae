// Pruning heads out of MultiheadAttention and the models: a head dim of its
// own (the heads I = H·hd wide, not D), prune_heads against gates of 0, a
// module without heads, head counts per layer, and what pruning refuses.
#include <cmath>
#include <filesystem>
#include <tuple>

#include "mha/nn/encoder_decoder.h"
#include "mha/nn/language_model.h"
#include "mha/nn/multihead_attention.h"
#include "mha/nn/vision_transformer.h"
#include "mha/train/checkpoint.h"
#include "mha/train/pruning.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

// Every parameter's gradient, by name.
std::vector<std::pair<std::string, Tensor>> gradients(MultiheadAttention& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (NamedParameter& p : m.named_parameters()) out.push_back({p.name, p.grad->clone()});
  return out;
}

struct PruneCase {
  const char* name;
  MultiheadAttentionConfig config;
  bool self = true;  // query = key = value
};

std::vector<PruneCase> prune_cases(DType dtype) {
  const MultiheadAttentionConfig base{.embed_dim = 12, .num_heads = 4, .batch_first = true, .dtype = dtype};
  std::vector<PruneCase> out{{"packed", base}};
  MultiheadAttentionConfig c = base;
  c.bias = false, c.batch_first = false;
  out.push_back({"no bias, sequence first", c});
  c = base, c.kdim = 5, c.vdim = 7;
  out.push_back({"kdim and vdim", c, false});
  c = base, c.add_bias_kv = true, c.add_zero_attn = true;
  out.push_back({"bias_kv and zero attention", c});
  c = base, c.rotary_base = 10000.0, c.head_dim = 4;  // I = 16 ≠ D
  out.push_back({"rope, head dim 4", c});
  c = base, c.attention = {.kind = AttentionKind::linear};
  out.push_back({"linear attention", c});
  return out;
}

}  // namespace

// The module with heads 1 and 3 gated to 0 and the same module with them
// pruned: the same output, the same remaining weights, the same gradients of
// the inputs and of what remains (the gated module's gradients pruned
// afterwards), on every configuration that carries heads.
TEST(PruneHeads, EqualsGatesOfZero) {
  for (DType dtype : {DType::float64, DType::float32}) {
    const double tol = dtype == DType::float64 ? 1e-12 : 1e-6;
    for (const PruneCase& pc : prune_cases(dtype)) {
      SCOPED_TRACE(std::string(pc.name) + " " + to_string(dtype));
      Generator g1(7), g2(7);
      MultiheadAttention gated(pc.config, g1), pruned(pc.config, g2);
      gated.set_head_gates(Tensor::from_values(std::vector<double>{0.5, 0.0, 1.5, 0.0}, {4}).to(dtype));
      pruned.set_head_gates(Tensor::from_values(std::vector<double>{0.5, 0.0, 1.5, 0.0}, {4}).to(dtype));
      pruned.prune_heads({3, 1, 3});
      ASSERT_EQ(pruned.num_heads(), 2);
      EXPECT_EQ(pruned.head_dim(), gated.head_dim());
      EXPECT_EQ(pruned.head_gates().to_vector(), (std::vector<double>{0.5, 1.5}));
      const int64_t D = 12;
      const Shape qshape = pc.config.batch_first ? Shape{2, 5, D} : Shape{5, 2, D};
      const Tensor q = random_tensor(qshape, 1, dtype);
      const Tensor k = pc.self ? q : random_tensor(pc.config.batch_first ? Shape{2, 6, 5} : Shape{6, 2, 5}, 2, dtype);
      const Tensor v = pc.self ? q : random_tensor(pc.config.batch_first ? Shape{2, 6, 7} : Shape{6, 2, 7}, 3, dtype);
      const bool weights = pc.config.attention.computes_weights();
      const MultiheadAttentionInputs in{.need_weights = weights, .average_attn_weights = false};
      const MultiheadAttentionOutput a = gated.forward(q, k, v, in), b = pruned.forward(q, k, v, in);
      EXPECT_LT(max_abs_diff(a.output, b.output), tol);
      if (weights) {
        EXPECT_EQ(b.weights.size(1), 2);
        EXPECT_LT(max_abs_diff(a.weights.select(1, 0), b.weights.select(1, 0)), tol);
        EXPECT_LT(max_abs_diff(a.weights.select(1, 2), b.weights.select(1, 1)), tol);
      }
      const Tensor dy = random_tensor(a.output.shape(), 4, dtype);
      gated.zero_grad(), pruned.zero_grad();
      const MultiheadAttentionInputGradients ga = gated.backward(dy), gb = pruned.backward(dy);
      EXPECT_LT(max_abs_diff(ga.dquery, gb.dquery), tol);
      if (!pc.self) {
        EXPECT_LT(max_abs_diff(ga.dkey, gb.dkey), tol);
        EXPECT_LT(max_abs_diff(ga.dvalue, gb.dvalue), tol);
      }
      const std::vector<double> gate_grad = gated.head_gate_grad().to_vector();
      gated.prune_heads({1, 3});  // the gradients of what remains, pruned with it
      EXPECT_EQ(pruned.head_gate_grad().to_vector().size(), 2u);
      EXPECT_NEAR(pruned.head_gate_grad().to_vector()[1], gate_grad[2], tol * 10);
      const auto want = gradients(gated), got = gradients(pruned);
      ASSERT_EQ(want.size(), got.size());
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(want[i].second.shape(), got[i].second.shape()) << want[i].first;
        EXPECT_LT(max_abs_diff(want[i].second, got[i].second), tol) << want[i].first;
      }
      for (size_t i = 0; i < want.size(); ++i)  // and the values: pruning one or the other prunes the same
        EXPECT_EQ(max_abs_diff(*gated.named_parameters()[i].value, *pruned.named_parameters()[i].value), 0.0);
    }
  }
}

// head_dim set (I = H·hd ≠ D): gradients of every parameter and input by
// central differences; cached decoding and memory attention equal forward.
TEST(PruneHeads, AHeadDimOfItsOwn) {
  Generator gen(11);
  MultiheadAttention m({.embed_dim = 10, .num_heads = 3, .head_dim = 4, .batch_first = true, .dtype = DType::float64},
                       gen);
  EXPECT_EQ(m.inner_dim(), 12);
  EXPECT_EQ(m.in_proj_weight.shape(), (Shape{36, 10}));
  EXPECT_EQ(m.out_proj_weight.shape(), (Shape{10, 12}));
  const Tensor x = random_tensor({2, 5, 10}, 1), r = random_tensor({2, 5, 10}, 2);
  const MultiheadAttentionInputs in{.need_weights = false, .is_causal = true};
  auto loss = [&] { return weighted_sum(m.forward(x, x, x, in).output, r); };
  m.zero_grad();
  m.forward(x, x, x, in);
  const MultiheadAttentionInputGradients g = m.backward(r);
  for (NamedParameter& p : m.named_parameters()) EXPECT_LT(gradient_error(*p.value, *p.grad, loss), 1e-6) << p.name;
  Tensor dx = g.dquery.clone();
  for (int64_t i = 0; i < dx.numel(); ++i) dx.data<double>()[i] += g.dkey.data<double>()[i] + g.dvalue.data<double>()[i];
  EXPECT_LT(gradient_error(x, dx, loss), 1e-6);

  m.eval();
  const Tensor whole = m.forward(x, x, x, in).output;
  KVCache cache;
  for (int64_t t = 0; t < 5; ++t)
    EXPECT_LT(max_abs_diff(m.forward_cached(x.slice(1, t, t + 1).contiguous(), cache, {.is_causal = true}),
                           whole.slice(1, t, t + 1)), 1e-12) << t;
  EXPECT_EQ(cache.key.size(2), 12);
  const Tensor memory = random_tensor({2, 4, 10}, 3);
  const Tensor full = m.forward(x, memory, memory, {.need_weights = false}).output;
  EXPECT_LT(max_abs_diff(m.forward_memory(x, m.project_memory(memory, memory)), full), 1e-12);
}

// Every head pruned: the output is out_proj's bias in every row; only that
// bias has a gradient; decoding and memory attention do the same.
TEST(PruneHeads, AModuleWithoutHeads) {
  Generator gen(5);
  MultiheadAttention m({.embed_dim = 6, .num_heads = 2, .batch_first = true, .dtype = DType::float64}, gen);
  m.out_proj_bias = random_tensor({6}, 9);
  m.prune_heads({0, 1});
  EXPECT_EQ(m.num_heads(), 0);
  EXPECT_EQ(m.in_proj_weight.shape(), (Shape{0, 6}));
  EXPECT_EQ(m.out_proj_weight.shape(), (Shape{6, 0}));
  const Tensor x = random_tensor({2, 3, 6}, 1), memory = random_tensor({2, 4, 6}, 2);
  const MultiheadAttentionOutput out = m.forward(x, memory, memory, {.average_attn_weights = false});
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(max_abs_diff(out.output.select(0, n).select(0, l), m.out_proj_bias), 0.0);
  EXPECT_EQ(out.weights.shape(), (Shape{2, 0, 3, 4}));
  EXPECT_EQ(m.forward(x, x, x).weights.shape(), (Shape{2, 3, 3}));
  const Tensor r = random_tensor({2, 3, 6}, 3);
  m.zero_grad();
  m.forward(x, memory, memory, {.need_weights = false});
  const MultiheadAttentionInputGradients g = m.backward(r);
  EXPECT_EQ(max_abs(g.dquery) + max_abs(g.dkey) + max_abs(g.dvalue), 0.0);
  auto loss = [&] { return weighted_sum(m.forward(x, memory, memory, {.need_weights = false}).output, r); };
  EXPECT_LT(gradient_error(m.out_proj_bias, m.out_proj_bias_grad, loss), 1e-8);
  EXPECT_GT(max_abs(m.out_proj_bias_grad), 0.0);
  m.eval();
  KVCache cache;
  EXPECT_EQ(max_abs_diff(m.forward_cached(x, cache, {.is_causal = true}), out.output), 0.0);
  EXPECT_EQ(cache.length, 3);
  EXPECT_EQ(max_abs_diff(m.forward_memory(x, m.project_memory(memory, memory)), out.output), 0.0);
  // A module built without heads is the same thing.
  Generator gen2(5);
  MultiheadAttention none({.embed_dim = 6, .num_heads = 0, .head_dim = 3, .batch_first = true, .dtype = DType::float64},
                          gen2);
  EXPECT_EQ(none.inner_dim(), 0);
  EXPECT_EQ(max_abs(none.forward(x, x, x).output), 0.0);  // bias 0 at initialisation
}

TEST(PruneHeads, BadArgumentsAreRefused) {
  Generator gen(1);
  MultiheadAttention m({.embed_dim = 8, .num_heads = 2}, gen);
  expect_error<ValueError>([&] { m.prune_heads({2}); }, {"prune_heads", "heads", "[0, 2)", "2"});
  expect_error<ValueError>([&] { m.prune_heads({-1}); }, {"prune_heads", "heads", "-1"});
  EXPECT_EQ(m.num_heads(), 2);  // refused: nothing changed
  expect_error<ValueError>([&] { MultiheadAttention({.embed_dim = 8, .num_heads = 0}, gen); },
                           {"MultiheadAttention", "head_dim", "num_heads = 0"});
  expect_error<ValueError>([&] { MultiheadAttention({.embed_dim = 8, .num_heads = 2, .head_dim = -1}, gen); },
                           {"head_dim", ">= 0", "-1"});
  expect_error<ValueError>([&] { MultiheadAttention({.embed_dim = 8, .num_heads = 3}, gen); },
                           {"embed_dim", "multiple of num_heads = 3", "head_dim"});
  MultiheadAttention(MultiheadAttentionConfig{.embed_dim = 8, .num_heads = 3, .head_dim = 5}, gen);  // I = 15: fine
  expect_error<ValueError>(
      [&] { MultiheadAttention({.embed_dim = 8, .num_heads = 3, .head_dim = 3, .rotary_base = 100.0}, gen); },
      {"rotary_base", "even head dim", "3"});
}

namespace {

Tensor random_ids(const Shape& shape, uint64_t seed, int64_t vocab) {
  Generator g(seed);
  std::vector<double> v(size_t(shape[0] * shape[1]));
  for (double& x : v) x = double(g.next_u64() % uint64_t(vocab));
  return Tensor::from_values(v, shape, DType::int64);
}

Tensor gate_values(int64_t H, const std::vector<int64_t>& gone) {
  std::vector<double> g(size_t(H), 1.0);
  for (int64_t h : gone) g[size_t(h)] = 0.0;
  return Tensor::from_values(g, {H}, DType::float64);
}

// Every gradient of `a` (pruned after its backward) equals that of `b`.
void expect_same_gradients(Module& a, Module& b, double tol) {
  std::vector<NamedParameter> pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].grad->shape(), pb[i].grad->shape()) << pa[i].name;
    EXPECT_LT(max_abs_diff(*pa[i].grad, *pb[i].grad), tol) << pa[i].name;
  }
}

struct Cut {
  int64_t layer;
  std::vector<int64_t> ids;
};

LanguageModelConfig small_lm(Position position, bool causal) {
  return {.vocab_size = 11, .d_model = 16, .nhead = 4, .num_layers = 2, .dim_feedforward = 16, .dtype = DType::float64,
          .position = position, .causal = causal};
}

}  // namespace

// Models with some heads gated to 0 and the same models with them pruned (a
// layer losing every head among them): the same logits, the same gradients
// of what remains, decoding with the KV cache as the full forward; decoder-
// only and encoder models at every position kind (relative and alibi: each
// layer reads its heads' planes of the shared bias), the encoder-decoder at
// all three sites, the ViT.
TEST(PruneHeads, ModelsEqualTheirGatedSelves) {
  const std::vector<Cut> cuts{{0, {1, 3}}, {1, {0, 1, 2, 3}}};
  for (bool causal : {true, false})
    for (Position position : {Position::sinusoidal, Position::rope, Position::relative, Position::alibi}) {
      SCOPED_TRACE(to_string(position) + (causal ? " causal" : " bidirectional"));
      Generator g1(3), g2(3);
      LanguageModel a(small_lm(position, causal), g1), b(small_lm(position, causal), g2);
      for (const Cut& cut : cuts) {
        a.transformer.layers[size_t(cut.layer)]->self_attn.set_head_gates(gate_values(4, cut.ids));
        b.prune_heads(cut.layer, cut.ids);
      }
      EXPECT_EQ(b.config().heads, (std::vector<std::vector<int64_t>>{{0, 2}, {}}));
      const Tensor ids = random_ids({2, 7}, 1, 11);
      const Tensor la = a.forward(ids), lb = b.forward(ids);
      EXPECT_LT(max_abs_diff(la, lb), 1e-12);
      const Tensor dl = random_tensor(la.shape(), 2);
      a.zero_grad(), b.zero_grad();
      a.backward(dl), b.backward(dl);
      for (const Cut& cut : cuts) a.prune_heads(cut.layer, cut.ids);
      expect_same_gradients(a, b, 1e-12);
      if (!causal) continue;
      b.eval();
      b.begin_decode();
      for (int64_t t = 0; t < 7; ++t)
        EXPECT_LT(max_abs_diff(b.decode_step(ids.slice(1, t, t + 1).contiguous()), lb.slice(1, t, t + 1)), 1e-12) << t;
    }

  Generator g1(4), g2(4);
  EncoderDecoderConfig ec{.decoder = small_lm(Position::relative, true), .num_encoder_layers = 2};
  EncoderDecoderModel a(ec, g1), b(ec, g2);
  const std::vector<std::tuple<Site, int64_t, std::vector<int64_t>>> sites{
      {Site::encoder, 0, {0, 2}}, {Site::decoder, 1, {3}}, {Site::cross, 0, {0, 1, 2, 3}}, {Site::cross, 1, {2}}};
  for (const auto& [site, layer, gone] : sites) {
    MultiheadAttention& m = site == Site::encoder ? a.encoder.layers[size_t(layer)]->self_attn
                            : site == Site::decoder ? a.decoder.layers[size_t(layer)]->self_attn
                                                    : a.decoder.layers[size_t(layer)]->multihead_attn;
    Tensor gates = m.head_gates().defined() ? m.head_gates() : gate_values(4, {});
    for (int64_t h : gone) gates.data<double>()[h] = 0.0;
    m.set_head_gates(gates);
    b.prune_heads(site, layer, gone);
  }
  EXPECT_EQ(b.config().encoder_heads, (std::vector<std::vector<int64_t>>{{1, 3}, {0, 1, 2, 3}}));
  EXPECT_EQ(b.config().cross_heads, (std::vector<std::vector<int64_t>>{{}, {0, 1, 3}}));
  const Tensor src = random_ids({2, 5}, 3, 11), tgt = random_ids({2, 6}, 4, 11);
  const Tensor la = a.forward(src, tgt), lb = b.forward(src, tgt);
  EXPECT_LT(max_abs_diff(la, lb), 1e-12);
  const Tensor dl = random_tensor(la.shape(), 5);
  a.zero_grad(), b.zero_grad();
  a.backward(dl), b.backward(dl);
  for (const auto& [site, layer, gone] : sites) a.prune_heads(site, layer, gone);
  expect_same_gradients(a, b, 1e-12);
  b.eval();
  b.begin_decode(src);
  for (int64_t t = 0; t < 6; ++t)
    EXPECT_LT(max_abs_diff(b.decode_step(tgt.slice(1, t, t + 1).contiguous()), lb.slice(1, t, t + 1)), 1e-12) << t;

  Generator v1(6), v2(6);
  const VisionTransformerConfig vc{.d_model = 12, .nhead = 4, .num_layers = 2, .dim_feedforward = 16, .dtype = DType::float64};
  VisionTransformer va(vc, v1), vb(vc, v2);
  va.layers[1]->self_attn.set_head_gates(gate_values(4, {0, 3}));
  vb.prune_heads(1, {0, 3});
  const Tensor images = random_tensor({3, 64}, 7);
  const Tensor ya = va.forward(images), yb = vb.forward(images);
  EXPECT_LT(max_abs_diff(ya, yb), 1e-12);
  const Tensor dy = random_tensor(ya.shape(), 8);
  va.zero_grad(), vb.zero_grad();
  va.backward(dy), vb.backward(dy);
  va.prune_heads(1, {0, 3});
  expect_same_gradients(va, vb, 1e-12);
}

// Head counts per layer from the start (3, 1 and 0 heads of nhead = 4):
// gradients by central differences through the shared relative bias, whose
// planes each layer reads by its heads' ids; bad lists are refused.
TEST(PruneHeads, HeadsPerLayerFromTheStart) {
  LanguageModelConfig c = small_lm(Position::relative, true);
  c.num_layers = 3;
  c.heads = {{0, 1, 3}, {2}, {}};
  Generator gen(9);
  LanguageModel m(c, gen);
  EXPECT_EQ(m.transformer.layers[0]->self_attn.in_proj_weight.shape(), (Shape{36, 16}));
  EXPECT_EQ(m.transformer.layers[1]->self_attn.num_heads(), 1);
  EXPECT_EQ(m.transformer.layers[2]->self_attn.num_heads(), 0);
  const Tensor ids = random_ids({2, 5}, 1, 11), r = random_tensor({2, 5, 11}, 2);
  auto loss = [&] { return weighted_sum(m.forward(ids), r); };
  m.zero_grad();
  m.forward(ids);
  m.backward(r);
  for (NamedParameter& p : m.named_parameters())
    if (p.name.find("relative") != std::string::npos || p.name.find("layers.1.self_attn") != std::string::npos) {
      EXPECT_LT(gradient_error(*p.value, *p.grad, loss), 1e-6) << p.name;
    }
  const Tensor weights = (m.forward(ids, true), m.attention_weights()[1]);
  EXPECT_EQ(weights.size(1), 1);

  const char* fn = "mha::nn::TransformerEncoder";
  for (const auto& [lists, want] : std::vector<std::pair<std::vector<std::vector<int64_t>>, const char*>>{
           {{{0}, {1}}, "one list of heads per layer (3)"}, {{{0}, {2, 1}, {}}, "ascending head ids in [0, 4)"},
           {{{0}, {4}, {}}, "id 4"}}) {
    LanguageModelConfig bad = c;
    bad.heads = lists;
    expect_error<ValueError>([&] { LanguageModel(bad, gen); }, {fn, "heads", want});
  }
  expect_error<ValueError>([&] { m.prune_heads(1, {0}); }, {"prune_heads", "ids", "head 0, which it does not have"});
  expect_error<ValueError>([&] { m.prune_heads(3, {0}); }, {"prune_heads", "layer", "[0, 3)"});
}

// A pruned model's checkpoint records each site's heads by id and loads back
// into the same model (decoder-only with relative positions, encoder-decoder,
// ViT); an unpruned model's config holds no lists, as before pruning existed.
TEST(PruneHeads, CheckpointsRoundTrip) {
  const train::TaskConfig task{.task = train::Task::copy, .min_length = 2, .max_length = 5, .heldout = 8};
  const train::TaskData data(task, 1);
  const std::vector<train::Example> examples(data.heldout().begin(), data.heldout().begin() + 4);
  LanguageModelConfig c{.vocab_size = train::kVocab, .d_model = 16, .nhead = 4, .num_layers = 2,
                        .dim_feedforward = 16, .position = Position::relative};
  for (train::Architecture arch : {train::Architecture::decoder, train::Architecture::encoder_decoder}) {
    SCOPED_TRACE(train::to_string(arch));
    Generator gen(2);
    std::unique_ptr<train::TaskModel> model = train::make_task_model(arch, c, 2, gen);
    const std::string dir = temp_dir();
    const train::Checkpoint info{.model = c, .task = task, .seed = 1, .steps = 3, .architecture = arch,
                                 .num_encoder_layers = arch == train::Architecture::encoder_decoder ? 2 : 0};
    train::save_checkpoint(dir + "/full", *model, info);
    EXPECT_EQ(read_bytes(dir + "/full/config.json").find("heads\""), std::string::npos);
    const std::string site = arch == train::Architecture::decoder ? "self" : "cross";
    train::prune_heads(*model, site, 1, {0, 2});
    if (arch == train::Architecture::encoder_decoder) train::prune_heads(*model, "encoder", 0, {0, 1, 2, 3});
    model->eval();
    const Tensor want = model->forward(model->make_batch(examples));
    train::save_checkpoint(dir + "/pruned", *model, info);
    train::LoadedCheckpoint loaded = train::load_checkpoint(dir + "/pruned");
    EXPECT_EQ(train::head_ids(*loaded.model, site), (train::HeadLists{{0, 1, 2, 3}, {1, 3}}));
    if (arch == train::Architecture::encoder_decoder) {
      EXPECT_EQ(loaded.info.encoder_heads, (train::HeadLists{{}, {0, 1, 2, 3}}));
    }
    EXPECT_EQ(max_abs_diff(loaded.model->forward(loaded.model->make_batch(examples)), want), 0.0);
    EXPECT_EQ(train::count_heads(*loaded.model), arch == train::Architecture::decoder ? 6 : 18);
    std::filesystem::remove_all(dir);
  }
  Generator gen(3);
  VisionTransformer vit({.d_model = 16, .nhead = 4, .num_layers = 2, .dim_feedforward = 16}, gen);
  vit.prune_heads(0, {3});
  vit.eval();
  const Tensor images = random_tensor({2, 64}, 4, DType::float32);
  const std::string dir = temp_dir();
  train::save_vision_checkpoint(dir, vit, {.model = vit.config(), .seed = 1});
  const train::LoadedVisionCheckpoint loaded = train::load_vision_checkpoint(dir);
  EXPECT_EQ(loaded.model->config().heads, (std::vector<std::vector<int64_t>>{{0, 1, 2}, {0, 1, 2, 3}}));
  EXPECT_EQ(max_abs_diff(loaded.model->forward(images), vit.forward(images)), 0.0);
  std::filesystem::remove_all(dir);
}

// Iterative pruning: the target reached in K rounds of round(P·i/K), the
// least important head first (importance against head_report's), a random
// draw reproducible from its seed; bad arguments refused.
TEST(PruneHeads, IterativePruning) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 5, .heldout = 8}, 1);
  const std::vector<train::Example> examples(data.heldout().begin(), data.heldout().end());
  const LanguageModelConfig c{.vocab_size = train::kVocab, .d_model = 16, .nhead = 4, .num_layers = 2, .dim_feedforward = 16};
  Generator gen(5);
  auto model = train::make_task_model(train::Architecture::decoder, c, 0, gen);
  const train::HeadReport report = train::head_report(*model, examples, 4);
  double least = 1e9;
  int64_t least_layer = -1, least_id = -1;
  for (size_t l = 0; l < 2; ++l)
    for (size_t h = 0; h < 4; ++h)
      if (report.sites[0].heads[l][h].importance < least)
        least = report.sites[0].heads[l][h].importance, least_layer = int64_t(l), least_id = int64_t(h);
  const std::vector<train::PrunedHead> pruned = train::prune_model(*model, examples, {.heads = 5, .iterations = 3, .batch = 4});
  ASSERT_EQ(pruned.size(), 5u);
  EXPECT_EQ(pruned[0].layer, least_layer);
  EXPECT_EQ(pruned[0].id, least_id);
  EXPECT_NEAR(pruned[0].importance, least, 1e-12);
  const std::vector<int64_t> rounds{pruned[0].iteration, pruned[1].iteration, pruned[2].iteration, pruned[3].iteration,
                                    pruned[4].iteration};
  EXPECT_EQ(rounds, (std::vector<int64_t>{1, 1, 2, 3, 3}));  // round(5·i/3) = 2, 3, 5
  EXPECT_EQ(train::count_heads(*model), 3);
  auto draw = [&](uint64_t seed) {
    Generator g(5);
    auto m = train::make_task_model(train::Architecture::decoder, c, 0, g);
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const train::PrunedHead& h : train::prune_model(*m, {}, {.heads = 4, .random = true, .seed = seed}))
      out.push_back({h.layer, h.id});
    return out;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
  expect_error<ValueError>([&] { train::prune_model(*model, examples, {.heads = 4}); },
                           {"prune_model", "heads", "[0, 3]", "4"});
  expect_error<ValueError>([&] { train::prune_model(*model, examples, {.heads = 1, .iterations = 0}); },
                           {"iterations", ">= 1"});
  expect_error<ValueError>([&] { train::prune_heads(*model, "cross", 0, {0}); }, {"prune_heads", "site", "self"});
}
