// The digits training loop.
#include "mha/train/vision.h"

#include <algorithm>
#include <chrono>

#include "check.h"
#include "mha/nn/loss.h"
#include "mha/optim.h"

namespace mha::train {

namespace {

Tensor labels_tensor(const DigitImages& images, const std::vector<int64_t>& index) {
  Tensor t = Tensor::empty({int64_t(index.size())}, DType::int64);
  for (size_t i = 0; i < index.size(); ++i) t.data<int64_t>()[i] = images.labels[size_t(index[i])];
  return t;
}

Tensor in_dtype(const Tensor& t, DType dtype) { return t.to(dtype); }

}  // namespace

double classification_accuracy(nn::VisionTransformer& model, const DigitImages& images) {
  const bool was_training = model.is_training();
  model.eval();
  int64_t right = 0;
  for (int64_t first = 0; first < images.size(); first += 256) {
    std::vector<int64_t> index;
    for (int64_t i = first; i < std::min(images.size(), first + 256); ++i) index.push_back(i);
    const Tensor logits = model.forward(in_dtype(digit_batch(images, index), model.config().dtype)).to(DType::float64);
    const double* l = logits.data<double>();
    const int64_t C = logits.size(1);
    for (size_t b = 0; b < index.size(); ++b) {
      const double* row = l + int64_t(b) * C;
      right += int64_t(std::max_element(row, row + C) - row) == images.labels[size_t(index[b])];
    }
  }
  model.train(was_training);
  return images.size() ? double(right) / double(images.size()) : 0.0;
}

TrainResult train_digits(nn::VisionTransformer& model, const DigitSplit& data, const TrainConfig& c,
                         const std::function<void(const TrainProgress&)>& on_progress) {
  using clock = std::chrono::steady_clock;
  const char* fn = "mha::train::train_digits";
  check_train_config(c, fn);
  if (data.train.size() == 0 && c.steps > 0)  // (batches draw indices modulo its size)
    raise<ValueError>(fn, "data.train", "at least one image to train on", "none");
  Generator gen(c.seed);
  std::vector<nn::NamedParameter> params = model.named_parameters();
  optim::AdamW opt(params, {.lr = c.lr, .weight_decay = c.weight_decay});
  const int64_t tokens_per_image = model.grid() * model.grid() + 1;
  model.train();
  TrainResult result;
  double tokens = 0, seconds = 0;
  for (int64_t step = 0; step < c.steps; ++step) {
    const auto t0 = clock::now();
    std::vector<int64_t> index;
    for (int64_t i = 0; i < c.batch_size; ++i) index.push_back(int64_t(gen.next_u64() % uint64_t(data.train.size())));
    const Tensor images = in_dtype(digit_batch(data.train, index, &gen), model.config().dtype);
    opt.set_lr(optim::warmup_cosine(step, c.warmup, c.steps, c.lr, c.min_lr));
    model.zero_grad();
    const nn::CrossEntropyResult loss = nn::cross_entropy(model.forward(images), labels_tensor(data.train, index));
    model.backward(loss.dlogits);
    guard_step(fn, step + 1, loss.loss, optim::clip_grad_norm(params, c.clip), params);
    opt.step();
    seconds += std::chrono::duration<double>(clock::now() - t0).count();
    tokens += double(c.batch_size * tokens_per_image);

    if (finish_step(c, step, loss.loss, loss.count, loss.correct, seconds, tokens,
                    [&] { return classification_accuracy(model, data.heldout); }, on_progress, result))
      break;
  }
  result.train_seconds = seconds;
  result.tokens_per_second = tokens / std::max(seconds, 1e-9);
  return result;
}

}  // namespace mha::train
