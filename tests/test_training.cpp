// Loss, optimizers, clipping and schedules against hand computations.
#include <filesystem>

#include "cpu/allocator.h"
#include "mha/train/checkpoint.h"
#include "mha/train/trainer.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

TEST(CrossEntropy, ValuesGradientIgnoreAndSmoothing) {
  Tensor logits = random_tensor({2, 3, 5}, 1);
  Tensor targets = Tensor::from_values(std::vector<double>{4, 0, -100, 2, 1, 3}, {2, 3}, DType::int64);
  for (double eps : {0.0, 0.1}) {
    SCOPED_TRACE("label_smoothing " + std::to_string(eps));
    const CrossEntropyOptions o{.label_smoothing = eps};
    CrossEntropyResult r = cross_entropy(logits, targets, o);
    EXPECT_EQ(r.count, 5);
    // By hand: mean over counted rows of (1-ε)(lse - x_t) + ε(lse - mean x).
    double want = 0;
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t l = 0; l < 3; ++l) {
        const int64_t t = int64_t(targets.item({n, l}));
        if (t == -100) continue;
        double sum = 0, mean = 0;
        for (int64_t c = 0; c < 5; ++c) sum += std::exp(logits.item({n, l, c})), mean += logits.item({n, l, c}) / 5;
        want += (1 - eps) * (std::log(sum) - logits.item({n, l, t})) + eps * (std::log(sum) - mean);
      }
    EXPECT_NEAR(r.loss, want / 5, 1e-14);
    for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(r.dlogits.item({0, 2, c}), 0.0);  // ignored row
    auto loss = [&] { return cross_entropy(logits, targets, o).loss; };
    EXPECT_LT(gradient_error(logits, r.dlogits, loss), 1e-6);
  }
  EXPECT_THROW(cross_entropy(logits, Tensor::from_values(std::vector<double>{5, 0, 0, 0, 0, 0}, {2, 3}, DType::int64)),
               ValueError);
  EXPECT_THROW(cross_entropy(logits, Tensor::zeros({2, 3})), DtypeError);
  EXPECT_THROW(cross_entropy(logits, Tensor::zeros({3, 2}, DType::int64)), ShapeError);
  Tensor all_ignored = Tensor::full({2, 3}, -100, DType::int64);
  EXPECT_EQ(cross_entropy(logits, all_ignored).loss, 0.0);  // no NaN from 0/0
}

TEST(Optim, AdamWMatchesTheUpdateRule) {
  Tensor p = Tensor::from_values(std::vector<double>{1.0, -2.0}, {2}, DType::float64);
  Tensor g = Tensor::zeros({2}, DType::float64);
  optim::AdamW opt({{"p", &p, &g}}, {.lr = 0.1, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.5});
  double x = 1.0, m = 0, v = 0;
  for (int t = 1; t <= 3; ++t) {
    const double grad = 0.3 * t;
    g.fill_(grad);
    opt.step();
    x *= 1 - 0.1 * 0.5;
    m = 0.9 * m + 0.1 * grad;
    v = 0.99 * v + 0.01 * grad * grad;
    x -= 0.1 * (m / (1 - std::pow(0.9, t))) / (std::sqrt(v / (1 - std::pow(0.99, t))) + 1e-8);
    EXPECT_NEAR(p.item({0}), x, 1e-14) << "step " << t;
  }
  EXPECT_EQ(opt.steps(), 3);
}

TEST(Optim, SGDMomentumAndNesterov) {
  for (bool nesterov : {false, true}) {
    Tensor p = Tensor::full({1}, 1.0, DType::float64), g = Tensor::zeros({1}, DType::float64);
    optim::SGD opt({{"p", &p, &g}}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = nesterov});
    double x = 1.0, b = 0;
    for (int t = 1; t <= 3; ++t) {
      g.fill_(0.5);
      opt.step();
      const double d = 0.5 + 0.01 * x;
      b = t == 1 ? d : 0.9 * b + d;
      x -= 0.1 * (nesterov ? d + 0.9 * b : b);
      EXPECT_NEAR(p.item({0}), x, 1e-15);
    }
  }
}

TEST(Optim, ClipGradNorm) {
  Tensor a = Tensor::zeros({2}, DType::float64), ga = Tensor::from_values(std::vector<double>{3, 0}, {2}, DType::float64);
  Tensor b = Tensor::zeros({1}, DType::float64), gb = Tensor::full({1}, 4.0, DType::float64);
  std::vector<NamedParameter> ps{{"a", &a, &ga}, {"b", &b, &gb}};
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm(ps, 10.0), 5.0);
  EXPECT_EQ(gb.item({0}), 4.0);  // under the limit: untouched
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm(ps, 1.0), 5.0);
  EXPECT_NEAR(ga.item({0}), 3.0 / (5 + 1e-6), 1e-15);
  EXPECT_NEAR(gb.item({0}), 4.0 / (5 + 1e-6), 1e-15);
  EXPECT_THROW(optim::clip_grad_norm(ps, 0.0), ValueError);
}

// flatten_parameters: the values and gradients kept, the tensors views of two
// blocks; AdamW and clipping over the blocks give the numbers of the
// per-parameter sweeps, in float32 and float64.
TEST(Optim, FlatParametersMatchPerParameterSweeps) {
  for (DType dtype : {DType::float32, DType::float64}) {
    SCOPED_TRACE(to_string(dtype));
    // Sizes that leave gaps between 16-element starts, and a 2-D one.
    const std::vector<Shape> shapes{{3}, {17}, {4, 5}, {33}};
    std::vector<Tensor> values[2], grads[2];
    std::vector<NamedParameter> params[2];
    for (int copy = 0; copy < 2; ++copy) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        values[copy].push_back(random_tensor(shapes[i], 10 + i, dtype));
        grads[copy].push_back(Tensor::zeros(shapes[i], dtype));
      }
      for (size_t i = 0; i < shapes.size(); ++i)
        params[copy].push_back({std::string(1, char('a' + i)), &values[copy][i], &grads[copy][i]});
    }
    EXPECT_FALSE(flat_parameters_of(params[1]).has_value());
    const FlatParameters flat = flatten_parameters(params[1]);
    EXPECT_EQ(flat.offsets, (std::vector<int64_t>{0, 16, 48, 80}));
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(values[1][i].shape(), shapes[i]);
      EXPECT_EQ(max_abs_diff(values[1][i], values[0][i]), 0.0);
      EXPECT_EQ(values[1][i].raw_data(), static_cast<const char*>(flat.values.raw_data()) + flat.offsets[i] * dtype_size(dtype));
    }
    const std::optional<FlatParameters> seen = flat_parameters_of(params[1]);
    ASSERT_TRUE(seen.has_value());
    EXPECT_EQ(seen->numel, 80 + 33);
    optim::AdamW per({params[0]}, {.lr = 0.05}), whole({params[1]}, {.lr = 0.05});
    for (int step = 0; step < 3; ++step) {
      for (int copy = 0; copy < 2; ++copy)
        for (size_t i = 0; i < shapes.size(); ++i) grads[copy][i].copy_(random_tensor(shapes[i], 100 + step * 7 + i, dtype));
      // The same sums in another order (the norm's blocks): float32 may differ in the last bit.
      const double tol = dtype == DType::float32 ? 1e-6 : 1e-13;
      EXPECT_NEAR(optim::clip_grad_norm(params[0], 1.0), optim::clip_grad_norm(params[1], 1.0), tol);
      per.step(), whole.step();
      for (size_t i = 0; i < shapes.size(); ++i) {
        EXPECT_LE(max_abs_diff(grads[1][i], grads[0][i]), tol) << i;
        EXPECT_LE(max_abs_diff(values[1][i], values[0][i]), tol) << i;
        EXPECT_LE(max_abs_diff(whole.exp_avg_sq()[i], per.exp_avg_sq()[i]), tol) << i;
      }
    }
    for (int64_t x = 3; x < 16; ++x) EXPECT_EQ(flat.values.item({x}), 0.0);  // the gaps stay 0
  }
}

TEST(Optim, Schedules) {
  EXPECT_DOUBLE_EQ(optim::warmup_cosine(0, 10, 110, 1.0), 0.1);
  EXPECT_DOUBLE_EQ(optim::warmup_cosine(9, 10, 110, 1.0), 1.0);
  EXPECT_NEAR(optim::warmup_cosine(60, 10, 110, 1.0, 0.1), 0.55, 1e-12);  // half-way: the mean
  EXPECT_DOUBLE_EQ(optim::warmup_cosine(500, 10, 110, 1.0, 0.1), 0.1);
  // Noam peaks at step = warmup - 1 (1-based: warmup) with d^-0.5 · warmup^-0.5.
  EXPECT_NEAR(optim::noam(3999, 512, 4000), std::pow(512.0, -0.5) * std::pow(4000.0, -0.5), 1e-15);
  EXPECT_LT(optim::noam(100, 512, 4000), optim::noam(3999, 512, 4000));
  EXPECT_LT(optim::noam(20000, 512, 4000), optim::noam(3999, 512, 4000));
}

TEST(Optim, TrainsALinearClassifier) {
  // Separable 3-class data: a Linear layer and AdamW reach zero training error quickly.
  Generator g(3);
  Linear lin({.in_features = 4, .out_features = 3, .dtype = DType::float64}, g);
  Tensor x = random_tensor({60, 4}, 1);
  std::vector<double> labels(60);
  for (int64_t i = 0; i < 60; ++i) labels[size_t(i)] = x.item({i, 0}) > 0.5 ? 0 : (x.item({i, 1}) > 0 ? 1 : 2);
  Tensor y = Tensor::from_values(labels, {60}, DType::int64);
  optim::AdamW opt(lin.named_parameters(), {.lr = 0.05, .weight_decay = 0.0});
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    lin.zero_grad();
    CrossEntropyResult r = cross_entropy(lin.forward(x), y);
    lin.backward(r.dlogits);
    opt.step();
    if (step == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.3 * first);
  EXPECT_GE(cross_entropy(lin.forward(x), y).correct, 57);
}

TEST(Tasks, HeldOutNeverInTrainingAndBatchesAreShifted) {
  for (const char* name : {"copy", "reverse", "sort", "add"}) {
    train::TaskData data({.task = train::parse_task(name), .min_length = 2, .max_length = 3, .digits = 1, .heldout = 20}, 1);
    EXPECT_EQ(data.heldout().size(), 20u) << name;
    Generator g(2);
    for (int i = 0; i < 2000; ++i) ASSERT_FALSE(data.in_heldout(data.sample(g))) << name;
  }
  train::Example e{{3, 1, 4}, {4, 1, 3}};
  train::Batch b = train::make_batch({e});
  // <s> 3 1 4 = 4 1 3 </s>: targets only from "=" on, each the next token.
  EXPECT_EQ(b.ids, (std::vector<int64_t>{train::kBos, 3, 1, 4, train::kSep, 4, 1, 3, train::kEos}));
  EXPECT_EQ(b.targets, (std::vector<int64_t>{-100, -100, -100, -100, 4, 1, 3, train::kEos, -100}));
  EXPECT_THROW(train::parse_task("multiply"), ValueError);
  for (bool reversed : {false, true}) {
    train::TaskData add({.task = train::Task::add, .digits = 2, .reversed_sum = reversed, .heldout = 5}, 3);
    for (const train::Example& x : add.heldout()) {
      // Decode a + b from the digits and check the sum.
      int64_t a = 0, bsum = 0, out = 0;
      size_t i = 0;
      for (; x.input[i] != train::kPlus; ++i) a = a * 10 + x.input[i];
      for (++i; i < x.input.size(); ++i) bsum = bsum * 10 + x.input[i];
      std::vector<int64_t> sum = x.output;
      if (reversed) {
        EXPECT_EQ(x.input.size(), 5u);   // "ab+cd": operands zero-padded to 2 digits
        EXPECT_EQ(sum.size(), 3u);       // the sum zero-padded to 3
        std::reverse(sum.begin(), sum.end());
      }
      for (int64_t d : sum) out = out * 10 + d;
      EXPECT_EQ(out, a + bsum);
    }
  }
}

TEST(Trainer, LearnsToCopyShortSequences) {
  train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 3, .heldout = 40}, 1);
  Generator g(1);
  LanguageModel network({.vocab_size = train::kVocab, .d_model = 32, .nhead = 2, .num_layers = 1, .dim_feedforward = 64}, g);
  train::DecoderOnly model(network);
  const double before = train::exact_match(model, data.heldout());
  const train::TrainResult r =
      train::train(model, data, {.steps = 300, .batch_size = 16, .lr = 1e-2, .min_lr = 1e-3, .warmup = 20, .eval_every = 100});
  EXPECT_LT(before, 0.2);
  EXPECT_GE(r.heldout_exact_match, 0.9);
  std::printf("  copy (lengths 2-3): held-out exact match %.2f after %lld steps\n", r.heldout_exact_match,
              (long long)r.steps);
}

TEST(Trainer, MixedPrecisionLearnsCopyAsWellAsFloat32) {
  // The same run as above in both precisions (same data, initialisation and steps).
  train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 3, .heldout = 40}, 1);
  double match[2];
  for (Precision precision : {Precision::float32, Precision::bf16_mixed}) {
    Generator g(1);
    LanguageModel model({.vocab_size = train::kVocab, .d_model = 32, .nhead = 2, .num_layers = 1, .dim_feedforward = 64,
                         .precision = precision},
                        g);
    train::DecoderOnly task_model(model);
    const train::TrainResult r = train::train(
        task_model, data, {.steps = 300, .batch_size = 16, .lr = 1e-2, .min_lr = 1e-3, .warmup = 20, .eval_every = 100});
    match[precision == Precision::bf16_mixed] = r.heldout_exact_match;
    std::printf("  copy (lengths 2-3), %-10s held-out exact match %.2f after %lld steps\n", to_string(precision).c_str(),
                r.heldout_exact_match, (long long)r.steps);
  }
  EXPECT_GE(match[1], 0.9);
  EXPECT_GE(match[1], match[0] - 0.05);
}

TEST(Trainer, CopyModelHasAHeadThatLooksAtTheSource) {
  // After training on copy, some head must put its strongest weight, for the
  // query that predicts output token k, on input token k: the diagonal the
  // pictures show. Checked over every target position of the held-out set.
  train::TaskData data({.task = train::Task::copy, .min_length = 4, .max_length = 6, .heldout = 64}, 2);
  Generator g(2);
  LanguageModel model({.vocab_size = train::kVocab, .d_model = 32, .nhead = 2, .num_layers = 2, .dim_feedforward = 64}, g);
  train::DecoderOnly task_model(model);
  const train::TrainResult r = train::train(
      task_model, data, {.steps = 400, .batch_size = 32, .lr = 1e-2, .min_lr = 1e-3, .warmup = 30, .eval_every = 100});
  ASSERT_GE(r.heldout_exact_match, 0.95);
  std::vector<std::vector<int64_t>> hits(model.transformer.layers.size(), std::vector<int64_t>(2, 0));
  int64_t targets = 0;
  for (const train::Example& e : data.heldout()) {
    const train::Batch b = train::make_batch({e});
    Tensor ids = Tensor::empty({1, b.length}, DType::int64);
    std::copy(b.ids.begin(), b.ids.end(), ids.data<int64_t>());
    model.forward(ids, true);
    const int64_t sep = 1 + int64_t(e.input.size()), n = int64_t(e.output.size());
    targets += n;
    for (size_t layer = 0; layer < model.transformer.layers.size(); ++layer) {
      const Tensor& w = model.attention_weights()[layer];  // (1, H, T, T)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t k = 0; k < n; ++k) {
          const int64_t query = sep + k;  // predicts output token k
          int64_t best = 0;
          for (int64_t j = 1; j <= query; ++j)
            if (w.item({0, h, query, j}) > w.item({0, h, query, best})) best = j;
          hits[layer][size_t(h)] += best == 1 + k;  // input token k sits at position 1 + k
        }
    }
  }
  double best_fraction = 0;
  for (auto& layer : hits)
    for (int64_t h : layer) best_fraction = std::max(best_fraction, double(h) / double(targets));
  std::printf("  copy: best head puts its strongest weight on the source for %.1f%% of %lld target positions\n",
              100 * best_fraction, (long long)targets);
  EXPECT_GE(best_fraction, 0.95);
}

namespace {

LanguageModelConfig small_model(double dropout = 0.0, DType dtype = DType::float32,
                                Precision precision = Precision::float32) {
  return {.vocab_size = train::kVocab, .d_model = 16, .nhead = 2, .num_layers = 1, .dim_feedforward = 32,
          .dropout = dropout, .dtype = dtype, .precision = precision};
}

void expect_same_parameters(Module& a, Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(max_abs_diff(*pa[i].value, *pb[i].value), 0.0) << pa[i].name;
}

}  // namespace

TEST(Trainer, GradientAccumulationEqualsOneBatch) {
  const train::TaskData data({.task = train::Task::reverse, .min_length = 2, .max_length = 6, .heldout = 10}, 3);
  Generator g(3);
  std::vector<train::Example> examples;
  for (int i = 0; i < 10; ++i) examples.push_back(data.sample(g));  // lengths differ: padding differs per micro-batch
  Generator init(4);
  LanguageModel network(small_model(0.0, DType::float64), init);
  train::DecoderOnly model(network);
  const train::StepLoss whole = train::accumulate_gradients(model, examples, 10);
  std::vector<Tensor> want;
  for (auto& p : model.named_parameters()) want.push_back(p.grad->clone());
  for (int64_t micro : {1, 3, 4}) {
    const train::StepLoss split = train::accumulate_gradients(model, examples, micro);
    EXPECT_NEAR(split.loss, whole.loss, 1e-12);
    EXPECT_EQ(split.count, whole.count);
    auto params = model.named_parameters();
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_LT(max_abs_diff(*params[i].grad, want[i]), 1e-12 * (1 + max_abs(want[i]))) << params[i].name << " micro " << micro;
  }
  EXPECT_THROW(train::accumulate_gradients(model, examples, 0), ValueError);
}

TEST(Trainer, ResumeEqualsUninterrupted) {
  // Dropout on, accumulation on: every generator and the optimizer must be restored.
  const train::TaskConfig task{.task = train::Task::copy, .min_length = 2, .max_length = 4, .heldout = 20};
  const train::TaskData data(task, 5);
  const train::TrainConfig config{.steps = 12, .batch_size = 4, .warmup = 3, .seed = 5, .eval_every = 5,
                                  .stop_when_perfect = false, .accumulate = 2, .checkpoint_every = 6};
  for (Precision precision : {Precision::float32, Precision::bf16_mixed}) {
    SCOPED_TRACE(to_string(precision));
    const LanguageModelConfig model_config = small_model(0.1, DType::float32, precision);
    const std::string dir = temp_dir("mha_resume_");
    Generator g1(6);
    train::DecoderOnly straight(std::make_unique<LanguageModel>(model_config, g1));
    train::TrainState end_state;
    train::train(straight, data, config, {}, &end_state, [&](const train::TrainState& s) {
      if (s.step == 6) train::save_checkpoint(dir, straight, {.model = model_config, .task = task, .seed = 5, .steps = 6}, &s);
    });
    EXPECT_EQ(end_state.step, 12);

    train::LoadedCheckpoint loaded = train::load_training_checkpoint(dir);
    ASSERT_TRUE(loaded.state);
    EXPECT_EQ(loaded.state->step, 6);
    EXPECT_EQ(loaded.info.model.precision, precision);
    train::train(*loaded.model, data, config, {}, loaded.state.get());
    EXPECT_EQ(loaded.state->step, 12);
    expect_same_parameters(straight, *loaded.model);
    for (size_t i = 0; i < end_state.exp_avg.size(); ++i)
      EXPECT_EQ(max_abs_diff(end_state.exp_avg_sq[i], loaded.state->exp_avg_sq[i]), 0.0);
    EXPECT_EQ(end_state.data_offset, loaded.state->data_offset);
    std::filesystem::remove_all(dir);
  }
}

// Memory for a shape met before comes from the blocks its last step freed: a
// step after the first few at one (batch, length) takes no block from the
// system (cpu/allocator.h), in either precision, Adam's moments included.
TEST(Trainer, StepsAtAShapeMetBeforeTakeNoFreshMemory) {
  if (!cpu::kHostBlockCache) GTEST_SKIP() << "the block cache is off under AddressSanitizer";
  const train::TaskData data({.task = train::Task::copy, .min_length = 12, .max_length = 12, .heldout = 8}, 2);
  for (Precision precision : {Precision::float32, Precision::bf16_mixed}) {
    SCOPED_TRACE(to_string(precision));
    Generator g(2);
    LanguageModel network({.vocab_size = train::kVocab, .d_model = 64, .nhead = 4, .num_layers = 2,
                           .dim_feedforward = 256, .precision = precision},
                          g);
    train::DecoderOnly model(network);
    const int64_t steps = 12, settled = 3;
    std::vector<size_t> made;  // blocks made by the end of each step
    train::train(model, data, {.steps = steps, .batch_size = 16, .eval_every = 0, .stop_when_perfect = false},
                 [&](const train::TrainProgress&) { made.push_back(cpu::host_blocks_made()); });
    ASSERT_EQ(made.size(), size_t(steps));
    EXPECT_GT(made[0], 0u) << "the first step's activations are blocks of 64 KiB and up";
    // The last step evaluates the held-out set (other shapes) before it reports.
    for (int64_t s = settled; s < steps - 1; ++s) EXPECT_EQ(made[s], made[settled - 1]) << "step " << s + 1;
  }
}

TEST(Checkpoint, StoresThePrecisionAndReadsOlderConfigsAsFloat32) {
  const train::TaskConfig task{.task = train::Task::copy, .min_length = 2, .max_length = 3, .heldout = 5};
  const std::string dir = temp_dir("mha_precision_");
  const LanguageModelConfig config = small_model(0.0, DType::float32, Precision::bf16_mixed);
  Generator g(9);
  train::DecoderOnly model(std::make_unique<LanguageModel>(config, g));
  train::save_checkpoint(dir, model, {.model = config, .task = task, .steps = 1});
  EXPECT_EQ(train::load_checkpoint(dir).info.model.precision, Precision::bf16_mixed);
  const std::string text = read_bytes(dir + "/config.json");
  const std::string stored = "\"precision\": \"bf16-mixed\"";
  const size_t at = text.find(stored);
  ASSERT_NE(at, std::string::npos) << text;
  auto rewrite = [&](const std::string& replacement) {
    std::ofstream(dir + "/config.json") << text.substr(0, at) + replacement + text.substr(at + stored.size());
  };
  rewrite("\"rope_base_copy\": 1");  // a config from before mixed precision: no "precision"
  EXPECT_EQ(train::load_checkpoint(dir).info.model.precision, Precision::float32);
  rewrite("\"precision\": \"fp8\"");
  try {
    train::load_checkpoint(dir);
    ADD_FAILURE() << "expected FormatError";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("precision must be float32 or bf16-mixed; got fp8"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, AnInterruptedSaveFallsBackToTheWholeTrainingState) {
  const train::TaskConfig task{.task = train::Task::copy, .min_length = 2, .max_length = 3, .heldout = 5};
  const std::string dir = temp_dir("mha_torn_");
  Generator g(7);
  train::DecoderOnly model(std::make_unique<LanguageModel>(small_model(), g));
  train::TrainState state;
  for (auto& p : model.named_parameters()) {
    state.exp_avg.push_back(Tensor::zeros(p.value->shape()));
    state.exp_avg_sq.push_back(Tensor::zeros(p.value->shape()));
  }
  train::save_checkpoint(dir, model, {.model = small_model(), .task = task, .steps = 1}, &state);
  std::filesystem::copy_file(dir + "/config.json", dir + "/old_config.json");
  Tensor& w = *model.named_parameters()[0].value;
  w.fill_(0.5);
  state.step = 2;
  train::save_checkpoint(dir, model, {.model = small_model(), .task = task, .steps = 2}, &state);
  // A crash after model.safetensors was renamed but before config.json was: the old config.
  std::filesystem::copy_file(dir + "/old_config.json", dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  train::LoadedCheckpoint loaded = train::load_checkpoint(dir);
  EXPECT_EQ(loaded.info.steps, 2);
  EXPECT_EQ(loaded.model->named_parameters()[0].value->item({0, 0}), 0.5);
  // Without the training state there is nothing whole to recover from: refused.
  std::filesystem::remove(dir + "/train_state.safetensors");
  try {
    train::load_checkpoint(dir);
    ADD_FAILURE() << "expected FormatError";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("interrupted save"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Init, XavierHeAndNormalHaveTheirScales) {
  Generator g(8);
  Linear layer({.in_features = 64, .out_features = 256}, g);
  const auto stddev = [&] {
    const std::vector<double> v = layer.weight.to_vector();
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s / double(v.size()));
  };
  initialize(layer, Init::xavier, g);
  const double a = std::sqrt(6.0 / (64 + 256));
  EXPECT_LE(max_abs(layer.weight), a);
  EXPECT_NEAR(stddev(), a / std::sqrt(3.0), 0.03 * a);
  initialize(layer, Init::he, g);
  EXPECT_NEAR(stddev(), std::sqrt(2.0 / 64), 0.03 * std::sqrt(2.0 / 64));
  initialize(layer, Init::normal, g, 0.02);
  EXPECT_NEAR(stddev(), 0.02, 0.0006);
  Tensor bias = layer.bias.clone();
  initialize(layer, Init::xavier, g);
  EXPECT_EQ(max_abs_diff(bias, layer.bias), 0.0);  // vectors keep their values
  EXPECT_EQ(parse_init("he"), Init::he);
  EXPECT_THROW(parse_init("glorot"), ValueError);
}

// A config no loop can run with is refused by name before the first step
// (a negative warmup used to train on; a clip of 0 failed only after the
// first forward and backward), and the model is left as it was.
TEST(Trainer, ABadConfigIsRefusedBeforeTheFirstStep) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 4, .heldout = 10}, 5);
  Generator g(3);
  train::DecoderOnly model(std::make_unique<LanguageModel>(small_model(), g));
  const std::vector<double> before = model.named_parameters()[0].value->to_vector();
  const train::TrainConfig good{.steps = 2, .batch_size = 4, .warmup = 1, .eval_every = 0};
  const auto refused = [&](train::TrainConfig c, const char* field, const char* got) {
    expect_error<ValueError>([&] { train::train(model, data, c); }, {"[mha::train::train]", field, got});
  };
  train::TrainConfig c = good;
  c.steps = -1, refused(c, "config.steps: expected >= 0", "got -1");
  c = good, c.batch_size = 0, refused(c, "config.batch_size: expected >= 1", "got 0");
  c = good, c.accumulate = 0, refused(c, "config.accumulate: expected >= 1", "got 0");
  c = good, c.warmup = -3, refused(c, "config.warmup: expected >= 0", "got -3");
  c = good, c.eval_every = -1, refused(c, "config.eval_every", "got -1");
  c = good, c.checkpoint_every = -5, refused(c, "config.checkpoint_every", "got -5");
  c = good, c.max_seconds = -1, refused(c, "config.max_seconds", "got -1");
  c = good, c.lr = NAN, refused(c, "config.lr: expected >= 0", "got nan");
  c = good, c.min_lr = -1e-3, refused(c, "config.min_lr: expected >= 0", "got -0.001");
  c = good, c.weight_decay = -0.1, refused(c, "config.weight_decay: expected >= 0", "got -0.1");
  c = good, c.clip = 0, refused(c, "config.clip: expected > 0", "got 0");
  EXPECT_EQ(model.named_parameters()[0].value->to_vector(), before);
  EXPECT_NO_THROW(train::train(model, data, good));
}

TEST(Trainer, ANonFiniteStepStopsBeforeTheUpdateNamingTheParameter) {
  const train::TaskConfig task{.task = train::Task::copy, .min_length = 2, .max_length = 4, .heldout = 10};
  const train::TaskData data(task, 5);
  Generator g(3);
  train::DecoderOnly model(std::make_unique<LanguageModel>(small_model(), g));
  std::vector<nn::NamedParameter> params = model.named_parameters();
  // A NaN in one weight: the first step's loss is NaN.
  const nn::NamedParameter& poisoned = params[3];
  poisoned.value->view({-1}).set_item({0}, NAN);
  std::vector<std::vector<double>> before;
  for (const auto& p : params) before.push_back(p.value->to_vector());
  train::TrainState state;
  try {
    train::train(model, data, {.steps = 5, .batch_size = 4, .warmup = 1, .eval_every = 0}, {}, &state);
    ADD_FAILURE() << "expected NumericalError";
  } catch (const NumericalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[mha::train::train] step 1: the loss is nan"), std::string::npos) << what;
    EXPECT_NE(what.find("the first parameter with a non-finite gradient is "), std::string::npos) << what;
    EXPECT_NE(what.find("the parameters are those after step 0"), std::string::npos) << what;
  }
  // Not applied: every parameter as it was (the NaN compares unequal, so compare bit patterns through the text).
  for (size_t i = 0; i < params.size(); ++i) {
    const std::vector<double> now = params[i].value->to_vector();
    for (size_t x = 0; x < now.size(); ++x)
      EXPECT_TRUE(now[x] == before[i][x] || (std::isnan(now[x]) && std::isnan(before[i][x]))) << params[i].name;
  }
  // Too large a step diverges later; the guard stops it there with every parameter finite.
  Generator g2(3);
  train::DecoderOnly wild(std::make_unique<LanguageModel>(small_model(), g2));
  EXPECT_THROW(train::train(wild, data, {.steps = 200, .batch_size = 4, .lr = 1e3, .warmup = 1, .eval_every = 0}),
               NumericalError);
  for (const auto& p : wild.named_parameters()) EXPECT_EQ(first_non_finite(*p.value), -1) << p.name;
  // The guard by itself: a loss that is not finite with finite gradients says so.
  for (auto& p : params) p.grad->fill_(0.0);
  EXPECT_NO_THROW(train::guard_step("f", 7, 1.0, 0.0, params));
  try {
    train::guard_step("f", 7, INFINITY, 0.0, params);
    ADD_FAILURE() << "expected NumericalError";
  } catch (const NumericalError& e) {
    EXPECT_NE(std::string(e.what()).find("[f] step 7: the loss is inf and the gradient norm 0.000000; every gradient is finite"),
              std::string::npos) << e.what();
  }
}
