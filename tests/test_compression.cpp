// Compressing attention: head gates (their gradient, the importance of a
// head), gated decoding, what a gate of 0 means, and the head report.
#include <cmath>

#include "mha/nn/loss.h"
#include "mha/nn/multihead_attention.h"
#include "mha/train/heads.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

MultiheadAttention gated_module(DType dtype, const std::vector<double>& gates, uint64_t seed = 3) {
  Generator gen(seed);
  MultiheadAttention m({.embed_dim = 12, .num_heads = 4, .batch_first = true, .dtype = dtype}, gen);
  m.set_head_gates(Tensor::from_values(gates, {4}).to(dtype));
  return m;
}

}  // namespace

// ∂L/∂gate_h against central differences, with the inputs' and parameters'
// gradients still right through the gates (one gate 0, one above 1).
TEST(HeadGates, GradientsByFiniteDifferences) {
  const std::vector<double> gates{0.5, 1.3, 0.0, 2.0};
  MultiheadAttention m = gated_module(DType::float64, gates);
  const Tensor x = random_tensor({2, 5, 12}, 1), r = random_tensor({2, 5, 12}, 2);
  const MultiheadAttentionInputs in{.need_weights = false, .is_causal = true};
  Tensor gate = Tensor::from_values(gates, {4}).to(DType::float64);
  auto loss = [&] {
    m.set_head_gates(gate);  // the gate being perturbed (and its gradient zeroed)
    return weighted_sum(m.forward(x, x, x, in).output, r);
  };
  m.zero_grad();
  m.zero_head_gate_grad();
  m.forward(x, x, x, in);
  const MultiheadAttentionInputGradients g = m.backward(r);
  const Tensor analytic = m.head_gate_grad().clone();
  EXPECT_LT(gradient_error(gate, analytic, loss), 1e-7);
  EXPECT_GT(max_abs(analytic), 0.0);
  for (NamedParameter& p : m.named_parameters()) EXPECT_LT(gradient_error(*p.value, *p.grad, loss), 1e-6) << p.name;
  Tensor dx = g.dquery.clone();
  for (int64_t i = 0; i < dx.numel(); ++i) dx.data<double>()[i] += g.dkey.data<double>()[i] + g.dvalue.data<double>()[i];
  EXPECT_LT(gradient_error(x, dx, loss), 1e-6);
  // Backward adds into the gate gradient.
  m.set_head_gates(gate);
  for (int k = 0; k < 2; ++k) {
    m.forward(x, x, x, in);
    m.backward(r);
  }
  const std::vector<double> once = analytic.to_vector(), twice = m.head_gate_grad().to_vector();
  for (size_t h = 0; h < 4; ++h) EXPECT_NEAR(twice[h], 2 * once[h], 1e-12) << h;
}

// A head whose gate is 0 contributes nothing: its projections can change
// freely without changing the output, and its gate gradient still measures it.
TEST(HeadGates, AGateOfZeroRemovesTheHead) {
  MultiheadAttention m = gated_module(DType::float64, {1, 0, 1, 1});
  const Tensor x = random_tensor({2, 6, 12}, 4);
  const Tensor before = m.forward(x, x, x, {.need_weights = false}).output;
  // Head 1's rows of Wq, Wk, Wv (rows 3..5 of each block of in_proj_weight).
  for (int64_t block = 0; block < 3; ++block)
    for (int64_t row = 3; row < 6; ++row)
      for (int64_t e = 0; e < 12; ++e) m.in_proj_weight.data<double>()[(block * 12 + row) * 12 + e] += 0.7;
  EXPECT_EQ(max_abs_diff(m.forward(x, x, x, {.need_weights = false}).output, before), 0.0);
  m.backward(random_tensor({2, 6, 12}, 5));
  EXPECT_GT(std::abs(m.head_gate_grad().to_vector()[1]), 0.0);
  // Ungated again: the head is back.
  m.set_head_gates({});
  EXPECT_GT(max_abs_diff(m.forward(x, x, x, {.need_weights = false}).output, before), 1e-3);
  EXPECT_FALSE(m.head_gate_grad().defined());
}

// Decoding one token at a time against the KV cache applies the gates as forward does.
TEST(HeadGates, CachedDecodingIsGatedToo) {
  for (DType dtype : {DType::float64, DType::float32}) {
    MultiheadAttention m = gated_module(dtype, {0.0, 1.0, 0.25, 3.0});
    m.eval();
    const Tensor x = random_tensor({1, 7, 12}, 6, dtype);
    const Tensor whole = m.forward(x, x, x, {.need_weights = false, .is_causal = true}).output;
    KVCache cache;
    for (int64_t t = 0; t < 7; ++t) {
      const Tensor row = m.forward_cached(x.slice(1, t, t + 1).contiguous(), cache, {.is_causal = true});
      EXPECT_LT(max_abs_diff(row, whole.slice(1, t, t + 1)), dtype == DType::float64 ? 1e-12 : 1e-5) << t;
    }
  }
}

TEST(HeadGates, BadGatesAreRefused) {
  MultiheadAttention m = gated_module(DType::float32, {1, 1, 1, 1});
  expect_error<ShapeError>([&] { m.set_head_gates(Tensor::full({3}, 1.0)); }, {"set_head_gates", "gates", "(4,)"});
  expect_error<DtypeError>([&] { m.set_head_gates(Tensor::full({4}, 1.0, DType::float64)); }, {"gates", "float32"});
  expect_error<ValueError>([&] { m.set_head_gates(Tensor::full({4}, NAN)); }, {"gates", "NaN"});
}

namespace {

LanguageModelConfig tiny_model(DType dtype = DType::float64) {
  return {.vocab_size = train::kVocab, .d_model = 12, .nhead = 3, .num_layers = 2, .dim_feedforward = 16,
          .dtype = dtype};
}

// The mean cross-entropy of one batch of the examples.
double batch_loss(train::TaskModel& model, const std::vector<train::Example>& examples) {
  const train::Batch b = model.make_batch(examples);
  return cross_entropy(model.forward(b), train::token_tensor(b.targets, b.rows, b.length)).loss;
}

}  // namespace

// With one batch, a head's importance is |∂L/∂gate| over its layer's ℓ2 norm:
// against central differences of the loss in each gate. Entropy and
// confidence against the model's own attention of each example.
TEST(HeadReport, ImportanceIsTheGateGradientNormalisedPerLayer) {
  const train::TaskData data({.task = train::Task::reverse, .min_length = 2, .max_length = 5, .heldout = 12}, 1);
  for (train::Architecture arch : {train::Architecture::decoder, train::Architecture::encoder_decoder,
                                   train::Architecture::encoder}) {
    SCOPED_TRACE(train::to_string(arch));
    Generator g(2);
    std::unique_ptr<train::TaskModel> model = train::make_task_model(arch, tiny_model(), 1, g);
    const std::vector<train::Example>& examples = data.heldout();
    const train::HeadReport report = train::head_report(*model, examples, int64_t(examples.size()));
    std::vector<train::AttentionSite> sites = train::attention_sites(*model);
    ASSERT_EQ(report.sites.size(), arch == train::Architecture::encoder_decoder ? 3u : 1u);
    ASSERT_EQ(report.examples, 12);
    for (size_t s = 0; s < sites.size(); ++s) {
      SCOPED_TRACE(sites[s].name);
      EXPECT_EQ(report.sites[s].name, sites[s].name);
      for (size_t l = 0; l < sites[s].layers.size(); ++l) {
        nn::MultiheadAttention& m = *sites[s].layers[l];
        EXPECT_FALSE(m.head_gates().defined());  // cleared afterwards
        std::vector<double> numeric;
        double norm = 0;
        for (int64_t h = 0; h < 3; ++h) {
          auto loss_at = [&](double gate) {
            Tensor gates = Tensor::full({3}, 1.0, DType::float64);
            gates.data<double>()[h] = gate;
            m.set_head_gates(gates);
            const double loss = batch_loss(*model, examples);
            m.set_head_gates({});
            return loss;
          };
          numeric.push_back(std::abs(loss_at(1 + 1e-6) - loss_at(1 - 1e-6)) / 2e-6);
          norm += numeric.back() * numeric.back();
        }
        for (int64_t h = 0; h < 3; ++h)
          EXPECT_NEAR(report.sites[s].heads[l][size_t(h)].importance, numeric[size_t(h)] / std::sqrt(norm), 1e-5)
              << "layer " << l << " head " << h;
      }
    }
    // Entropy and confidence of the first site's first head from the model's attention.
    double entropy = 0, top = 0, rows = 0;
    for (const train::Example& e : examples) {
      const Tensor w = model->attention(e.input, e.output)[0].weights[0].select(0, 0).contiguous();
      const std::vector<double> v = w.to_vector();
      const int64_t n = w.size(1);
      for (int64_t i = 0; i < w.size(0); ++i, ++rows) {
        double best = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double p = v[size_t(i * n + j)];
          if (p > 0) entropy -= p * std::log(p);
          best = std::max(best, p);
        }
        top += best;
      }
    }
    EXPECT_NEAR(report.sites[0].heads[0][0].entropy, entropy / rows, 1e-9);
    EXPECT_NEAR(report.sites[0].heads[0][0].confidence, top / rows, 1e-9);
    for (const nn::NamedParameter& p : model->named_parameters()) EXPECT_EQ(max_abs(*p.grad), 0.0) << p.name;
  }
}

// Batches: the importance sums each batch's |∂L/∂gate|, so a split changes
// it; the normalisation keeps each layer's scores a unit vector.
TEST(HeadReport, BatchesAndBadArguments) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 4, .heldout = 10}, 3);
  Generator g(4);
  std::unique_ptr<train::TaskModel> model =
      train::make_task_model(train::Architecture::decoder, tiny_model(DType::float32), 0, g);
  const train::HeadReport report = train::head_report(*model, data.heldout(), 3);
  for (const std::vector<train::HeadStats>& layer : report.sites[0].heads) {
    double norm = 0;
    for (const train::HeadStats& h : layer) {
      norm += h.importance * h.importance;
      EXPECT_GT(h.entropy, 0.0);
      EXPECT_LE(h.confidence, 1.0);
      EXPECT_GT(h.offset_share, 0.0);
    }
    EXPECT_NEAR(norm, 1.0, 1e-6);
  }
  expect_error<ValueError>([&] { train::head_report(*model, {}, 3); }, {"head_report", "examples"});
  expect_error<ValueError>([&] { train::head_report(*model, data.heldout(), 0); }, {"head_report", "batch"});
}

namespace {

// A decoder-only model whose attention (what the head report reads) is
// scripted: layer 0 head 0 on the previous token, layer 0 head 1 uniform;
// on the rows that predict the answer, layer 1 head 0 at offset n (copy)
// and layer 1 head 1 on the anti-diagonal i + j = 2n + 2 (reverse), uniform
// on the other rows.
class ScriptedAttention : public train::DecoderOnly {
 public:
  using DecoderOnly::DecoderOnly;
  std::vector<train::AttentionView> attention(const std::vector<int64_t>& input,
                                              const std::vector<int64_t>& output) override {
    const int64_t n = int64_t(input.size()), L = 2 + n + int64_t(output.size());
    std::vector<int64_t> tokens{train::kBos};
    tokens.insert(tokens.end(), input.begin(), input.end());
    tokens.push_back(train::kSep);
    tokens.insert(tokens.end(), output.begin(), output.end());
    std::vector<Tensor> layers{Tensor::zeros({2, L, L}, DType::float64), Tensor::zeros({2, L, L}, DType::float64)};
    for (int64_t i = 0; i < L; ++i) {
      const bool answer = i >= n + 1 && i < n + 1 + int64_t(output.size());
      for (int64_t j = 0; j <= i; ++j) {
        layers[0].set_item({1, i, j}, 1.0 / double(i + 1));
        for (int64_t h = 0; h < 2; ++h) layers[1].set_item({h, i, j}, answer ? 0.0 : 1.0 / double(i + 1));
      }
      layers[0].set_item({0, i, std::max<int64_t>(i - 1, 0)}, 1.0);
      if (answer) {
        layers[1].set_item({0, i, i - n}, 1.0);
        layers[1].set_item({1, i, 2 * n + 2 - i}, 1.0);
      }
    }
    return {{"self-attention", "self", layers, tokens, tokens}};
  }
};

}  // namespace

// Positional heads: a fixed offset (the previous token), and the patterns
// that the input's length n fixes (copy's offset n, reverse's mirror), over
// examples of several lengths; a uniform head is none of them.
TEST(HeadReport, LabelsPositionalHeads) {
  const train::TaskData data({.task = train::Task::reverse, .min_length = 3, .max_length = 7, .heldout = 20}, 5);
  Generator g(6);
  LanguageModelConfig c = tiny_model(DType::float32);
  c.nhead = 2;  // as the script's
  ScriptedAttention model(std::make_unique<LanguageModel>(c, g));
  const train::HeadReport report = train::head_report(model, data.heldout(), 8);
  const std::vector<std::vector<train::HeadStats>>& heads = report.sites[0].heads;
  ASSERT_EQ(heads.size(), 2u);
  EXPECT_TRUE(heads[0][0].positional);
  EXPECT_EQ(heads[0][0].pattern, "previous token");
  EXPECT_EQ(heads[0][0].offset, 1);
  EXPECT_FALSE(heads[0][1].positional);
  EXPECT_EQ(heads[0][1].pattern, "");
  EXPECT_TRUE(heads[1][0].positional);
  EXPECT_EQ(heads[1][0].pattern, "offset n");
  EXPECT_LT(heads[1][0].offset_share, 0.9);  // no one offset serves every length
  EXPECT_NEAR(heads[1][0].pattern_share, 1.0, 1e-12);
  EXPECT_TRUE(heads[1][1].positional);
  EXPECT_EQ(heads[1][1].pattern, "mirror: i + j = 2n + 2");
}
