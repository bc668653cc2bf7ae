// Distillation: the soft-target loss, attention and hidden transfer, each
// against central differences; a whole distillation step's gradients through
// the student's layers (the attention weights' gradient included); what
// distillation refuses.
#include <cmath>

#include "mha/nn/language_model.h"
#include "mha/train/distill.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

Tensor ids_tensor(const std::vector<double>& v, const Shape& shape) { return Tensor::from_values(v, shape, DType::int64); }

// Rows (B, L) bool: all but the listed flat positions.
Tensor rows_but(int64_t B, int64_t L, const std::vector<int64_t>& off) {
  std::vector<bool> v(size_t(B * L), true);
  for (int64_t i : off) v[size_t(i)] = false;
  return Tensor::from_bools(v, {B, L});
}

// Each row of (…, S) made a distribution: softmax of random logits.
Tensor random_weights(const Shape& shape, uint64_t seed) {
  Tensor t = random_tensor(shape, seed);
  const int64_t S = shape.back(), rows = t.numel() / S;
  double* x = t.data<double>();
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < S; ++j) sum += x[r * S + j] = std::exp(x[r * S + j]);
    for (int64_t j = 0; j < S; ++j) x[r * S + j] /= sum;
  }
  return t;
}

}  // namespace

TEST(Distillation, SoftTargetLossAndItsGradient) {
  Tensor student = random_tensor({2, 3, 5}, 1, DType::float64, 2.0);
  const Tensor teacher = random_tensor({2, 3, 5}, 2, DType::float64, 2.0);
  const Tensor targets = ids_tensor({1, 4, -100, 0, 2, 3}, {2, 3});
  for (double T : {1.0, 2.0, 4.5})
    for (double alpha : {0.0, 0.3, 1.0}) {
      SCOPED_TRACE("T " + std::to_string(T) + " alpha " + std::to_string(alpha));
      const train::LogitDistillation r = train::distillation_loss(student, teacher, targets, T, alpha);
      EXPECT_EQ(r.count, 5);
      EXPECT_NEAR(r.loss, alpha * T * T * r.kd + (1 - alpha) * r.ce, 1e-12);
      EXPECT_GT(r.kd, 0.0);
      auto loss = [&] { return train::distillation_loss(student, teacher, targets, T, alpha).loss; };
      EXPECT_LT(gradient_error(student, r.dlogits, loss), 1e-7);
      for (int64_t v = 0; v < 5; ++v) EXPECT_EQ(r.dlogits.item({0, 2, v}), 0.0);  // the ignored row
    }
  // The student that is the teacher: no KL; alpha 0 is the cross-entropy alone.
  EXPECT_NEAR(train::distillation_loss(teacher, teacher, targets, 3.0, 1.0).kd, 0.0, 1e-12);
  expect_error<ValueError>([&] { train::distillation_loss(student, teacher, targets, 0.0, 0.5); },
                           {"distillation_loss", "temperature", "> 0"});
  expect_error<ValueError>([&] { train::distillation_loss(student, teacher, targets, 1.0, 1.5); }, {"alpha", "[0, 1]"});
  expect_error<ShapeError>(
      [&] { train::distillation_loss(student, random_tensor({2, 3, 4}, 3), targets, 1.0, 0.5); },
      {"teacher_logits", "(2, 3, 5)"});
}

TEST(Distillation, AttentionTransferByFiniteDifferences) {
  const Tensor rows = rows_but(2, 4, {3, 6});  // two padding rows
  for (int64_t Ht : {3, 2}) {  // paired heads, then means over heads
    SCOPED_TRACE("teacher heads " + std::to_string(Ht));
    Tensor student = random_weights({2, 3, 4, 5}, 1);
    const Tensor teacher = random_weights({2, Ht, 4, 5}, 2);
    Tensor d;
    const double kl = train::attention_transfer(student, teacher, rows, &d);
    EXPECT_GT(kl, 0.0);
    auto loss = [&] { return train::attention_transfer(student, teacher, rows, nullptr); };
    EXPECT_LT(gradient_error(student, d, loss), 1e-7);
    EXPECT_EQ(max_abs(d.select(0, 0).select(1, 3)), 0.0);  // a padding row takes no gradient
    EXPECT_NEAR(train::attention_transfer(teacher, teacher, rows, nullptr), 0.0, 1e-12);
  }
}

TEST(Distillation, HiddenTransferByFiniteDifferences) {
  Tensor hs = random_tensor({2, 3, 4}, 1), w = random_tensor({6, 4}, 2);
  const Tensor ht = random_tensor({2, 3, 6}, 3), rows = rows_but(2, 3, {5});
  Tensor dh, dw;
  const double mse = train::hidden_transfer(hs, ht, w, rows, &dh, &dw);
  EXPECT_GT(mse, 0.0);
  auto loss = [&] { return train::hidden_transfer(hs, ht, w, rows, nullptr, nullptr); };
  EXPECT_LT(gradient_error(hs, dh, loss), 1e-7);
  EXPECT_LT(gradient_error(w, dw, loss), 1e-7);
  expect_error<ShapeError>([&] { train::hidden_transfer(hs, ht, random_tensor({4, 6}, 4), rows, &dh, &dw); },
                           {"hidden_transfer", "projection", "(6, 4)"});
}

// One distillation step with every term on: the student's gradients (through
// the last layer's attention weights and the final hidden states) and the
// projection's against central differences of the step's loss.
TEST(Distillation, AStepsGradientsThroughTheStudent) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 4, .heldout = 4}, 1);
  Generator g(3);
  std::vector<train::Example> examples;
  for (int i = 0; i < 5; ++i) examples.push_back(data.sample(g));
  const nn::LanguageModelConfig teacher_config{.vocab_size = train::kVocab, .d_model = 12, .nhead = 3, .num_layers = 2,
                                               .dim_feedforward = 16, .dtype = DType::float64};
  nn::LanguageModelConfig student_config = teacher_config;
  student_config.d_model = 8, student_config.nhead = 2, student_config.num_layers = 1;
  Generator gt(4), gs(5);
  auto teacher = train::make_task_model(train::Architecture::decoder, teacher_config, 0, gt);
  auto student = train::make_task_model(train::Architecture::decoder, student_config, 0, gs);
  teacher->eval();
  Tensor projection = random_tensor({12, 8}, 6, DType::float64, 0.3), projection_grad = Tensor::zeros({12, 8}, DType::float64);
  const train::Distiller step{*student, *teacher,
                              {.temperature = 2.0, .alpha = 0.6, .attention_weight = 0.7, .hidden_weight = 0.4},
                              &projection, &projection_grad};
  train::check_distillation(*student, *teacher, train::kVocab, train::kVocab, step.config, "test");
  auto loss = [&] {
    projection_grad.fill_(0.0);
    return step(examples, 2).loss;  // micro-batches of 2: the shares add up to one mean
  };
  const double value = loss();
  EXPECT_TRUE(std::isfinite(value));
  const Tensor dprojection = projection_grad.clone();
  std::vector<std::pair<std::string, Tensor>> grads;
  for (nn::NamedParameter& p : student->named_parameters()) grads.push_back({p.name, p.grad->clone()});
  // Where each term enters: the attention's in-projection (the weights' gradient), the final norm
  // (the hidden states'), the head and the token embedding (every term); the rest is the same chain.
  size_t i = 0, checked = 0;
  for (nn::NamedParameter& p : student->named_parameters()) {
    const std::string& name = p.name;
    if (name.find("self_attn.in_proj_weight") != std::string::npos || name.rfind("norm.", 0) == 0 ||
        name.rfind("head.", 0) == 0 || name == "embedding.weight") {
      EXPECT_LT(gradient_error(*p.value, grads[i].second, loss, 1e-5), 1e-5) << name;
      ++checked;
    }
    ++i;
  }
  EXPECT_EQ(checked, 6u);
  EXPECT_LT(gradient_error(projection, dprojection, loss, 1e-5), 1e-6);
}

TEST(Distillation, RefusesWhatCannotBeDistilled) {
  const nn::LanguageModelConfig c{.vocab_size = train::kVocab, .d_model = 8, .nhead = 2, .num_layers = 1,
                                  .dim_feedforward = 8};
  Generator g(1);
  auto decoder = train::make_task_model(train::Architecture::decoder, c, 0, g);
  auto encoder = train::make_task_model(train::Architecture::encoder, c, 0, g);
  auto seq2seq = train::make_task_model(train::Architecture::encoder_decoder, c, 1, g);
  const train::DistillConfig ok{};
  expect_error<ValueError>([&] { train::check_distillation(*seq2seq, *seq2seq, 21, 21, ok, "fn"); },
                           {"fn", "student", "decoder-only or encoder", "encoder-decoder"});
  expect_error<ValueError>([&] { train::check_distillation(*decoder, *encoder, 21, 21, ok, "fn"); },
                           {"student", "the teacher's architecture, encoder", "decoder"});
  expect_error<ValueError>([&] { train::check_distillation(*decoder, *decoder, 21, 30, ok, "fn"); },
                           {"teacher", "vocabulary of 21 tokens", "30 tokens"});
  expect_error<ValueError>([&] { train::check_distillation(*decoder, *decoder, 21, 21, {.temperature = -1}, "fn"); },
                           {"temperature"});
  expect_error<ValueError>([&] { train::check_distillation(*decoder, *decoder, 21, 21, {.alpha = 2}, "fn"); },
                           {"alpha", "[0, 1]"});
}
