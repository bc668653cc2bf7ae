// The training loop and greedy evaluation.
#include "mha/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "mha/nn/loss.h"
#include "mha/optim.h"

namespace mha::train {

namespace {

Tensor ids_tensor(const std::vector<int64_t>& ids, int64_t rows, int64_t length) {
  Tensor t = Tensor::empty({rows, length}, DType::int64);
  std::copy(ids.begin(), ids.end(), t.data<int64_t>());
  return t;
}

}  // namespace

std::vector<std::vector<int64_t>> generate(nn::LanguageModel& model, const std::vector<std::vector<int64_t>>& inputs,
                                           int64_t max_new) {
  const bool was_training = model.is_training();
  model.eval();
  std::vector<std::vector<int64_t>> outputs(inputs.size());
  // Inputs of one length decode together as a batch.
  std::map<size_t, std::vector<size_t>> by_length;
  for (size_t i = 0; i < inputs.size(); ++i) by_length[inputs[i].size()].push_back(i);
  for (const auto& [length, members] : by_length) {
    const int64_t rows = int64_t(members.size());
    // The prompts, BOS input SEP, in one step; then one token per step
    // against the KV cache.
    std::vector<int64_t> prompts;
    for (size_t i : members) {
      prompts.push_back(kBos);
      prompts.insert(prompts.end(), inputs[i].begin(), inputs[i].end());
      prompts.push_back(kSep);
    }
    model.begin_decode();
    Tensor logits = model.decode_step(ids_tensor(prompts, rows, int64_t(length) + 2));
    std::vector<bool> done(size_t(rows), false);
    for (int64_t step = 0; step < max_new; ++step) {
      const int64_t T = logits.size(1), V = logits.size(-1);
      const Tensor scores = logits.to(DType::float32);
      const float* l = scores.data<float>();
      std::vector<int64_t> next(static_cast<size_t>(rows));
      bool all_done = true;
      for (int64_t r = 0; r < rows; ++r) {
        const float* last = l + (r * T + T - 1) * V;
        next[size_t(r)] = int64_t(std::max_element(last, last + V) - last);
        if (!done[size_t(r)]) {
          if (next[size_t(r)] == kEos) done[size_t(r)] = true;
          else outputs[members[size_t(r)]].push_back(next[size_t(r)]);
        }
        all_done = all_done && done[size_t(r)];
      }
      if (all_done || step + 1 == max_new) break;
      logits = model.decode_step(ids_tensor(next, rows, 1));
    }
  }
  model.train(was_training);
  return outputs;
}

double exact_match(nn::LanguageModel& model, const std::vector<Example>& examples) {
  if (examples.empty()) return 0.0;
  std::vector<std::vector<int64_t>> inputs;
  int64_t longest = 0;
  for (const Example& e : examples) {
    inputs.push_back(e.input);
    longest = std::max<int64_t>(longest, int64_t(e.output.size()));
  }
  const auto outputs = generate(model, inputs, longest + 1);
  int64_t right = 0;
  for (size_t i = 0; i < examples.size(); ++i) right += outputs[i] == examples[i].output;
  return double(right) / double(examples.size());
}

TrainResult train(nn::LanguageModel& model, const TaskData& data, const TrainConfig& c,
                  const std::function<void(const TrainProgress&)>& on_progress) {
  using clock = std::chrono::steady_clock;
  Generator gen(c.seed);
  std::vector<nn::NamedParameter> params = model.named_parameters();
  optim::AdamW opt(params, {.lr = c.lr, .weight_decay = c.weight_decay});
  model.train();
  TrainResult result;
  double tokens = 0, train_seconds = 0;
  for (int64_t step = 0; step < c.steps; ++step) {
    const auto t0 = clock::now();
    std::vector<Example> examples;
    for (int64_t i = 0; i < c.batch_size; ++i) examples.push_back(data.sample(gen));
    const Batch b = make_batch(examples);
    opt.set_lr(optim::warmup_cosine(step, c.warmup, c.steps, c.lr, c.min_lr));
    model.zero_grad();
    const Tensor logits = model.forward(ids_tensor(b.ids, b.rows, b.length));
    const nn::CrossEntropyResult loss = nn::cross_entropy(logits, ids_tensor(b.targets, b.rows, b.length));
    model.backward(loss.dlogits);
    optim::clip_grad_norm(params, c.clip);
    opt.step();
    train_seconds += std::chrono::duration<double>(clock::now() - t0).count();
    tokens += double(b.rows * b.length);

    TrainProgress p;
    p.step = step + 1, p.steps = c.steps, p.loss = loss.loss;
    p.token_accuracy = loss.count ? double(loss.correct) / double(loss.count) : 0.0;
    p.elapsed_seconds = train_seconds, p.tokens_per_second = tokens / std::max(train_seconds, 1e-9);
    const bool last = step + 1 == c.steps || (c.max_seconds > 0 && train_seconds >= c.max_seconds);
    if ((c.eval_every > 0 && (step + 1) % c.eval_every == 0) || last)
      p.heldout_exact_match = exact_match(model, data.heldout());
    if (on_progress) on_progress(p);
    result.steps = step + 1, result.final_loss = loss.loss;
    if (p.heldout_exact_match >= 0) result.heldout_exact_match = p.heldout_exact_match;
    if (last || (c.stop_when_perfect && p.heldout_exact_match >= 1.0)) break;
  }
  result.train_seconds = train_seconds;
  result.tokens_per_second = tokens / std::max(train_seconds, 1e-9);
  return result;
}

}  // namespace mha::train
