// The training loop and greedy evaluation.
#include "mha/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "check.h"
#include "mha/dist/context_parallel.h"
#include "mha/nn/loss.h"
#include "mha/optim.h"

namespace mha::train {

std::vector<std::vector<int64_t>> generate(TaskModel& model, const std::vector<std::vector<int64_t>>& inputs,
                                           int64_t max_new) {
  const bool was_training = model.is_training();
  model.eval();
  std::vector<std::vector<int64_t>> outputs(inputs.size());
  // Inputs of one length decode together as a batch.
  std::map<size_t, std::vector<size_t>> by_length;
  for (size_t i = 0; i < inputs.size(); ++i) by_length[inputs[i].size()].push_back(i);
  for (const auto& [length, members] : by_length) {
    const int64_t rows = int64_t(members.size());
    std::vector<std::vector<int64_t>> group;
    for (size_t i : members) group.push_back(inputs[i]);
    Tensor logits = model.start_decoding(group);
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
      logits = model.decode_step(token_tensor(next, rows, 1));
    }
  }
  model.train(was_training);
  return outputs;
}

Evaluation evaluate(TaskModel& model, const std::vector<Example>& examples) {
  if (examples.empty()) return {};
  std::vector<std::vector<int64_t>> inputs;
  std::vector<int64_t> lengths;
  int64_t longest = 0;
  for (const Example& e : examples) {
    inputs.push_back(e.input);
    lengths.push_back(int64_t(e.output.size()));
    longest = std::max<int64_t>(longest, int64_t(e.output.size()));
  }
  const auto outputs = model.answer(inputs, lengths, longest + 1);
  int64_t right = 0, tokens = 0, right_tokens = 0;
  for (size_t i = 0; i < examples.size(); ++i) {
    const std::vector<int64_t>&got = outputs[i], &want = examples[i].output;
    right += got == want;
    tokens += int64_t(want.size());
    for (size_t t = 0; t < std::min(got.size(), want.size()); ++t) right_tokens += got[t] == want[t];
  }
  return {.exact_match = double(right) / double(examples.size()),
          .token_accuracy = tokens > 0 ? double(right_tokens) / double(tokens) : 0.0,
          .examples = int64_t(examples.size()), .exact = right, .tokens = tokens, .right_tokens = right_tokens};
}

double exact_match(TaskModel& model, const std::vector<Example>& examples) {
  return evaluate(model, examples).exact_match;
}

void scale_gradient(Tensor& t, double factor) {
  if (t.dtype() == DType::float64) {
    double* x = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) x[i] *= factor;
  } else {
    float* x = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) x[i] *= float(factor);
  }
}

int64_t target_count(const Batch& b) {
  return int64_t(std::count_if(b.targets.begin(), b.targets.end(), [](int64_t t) { return t >= 0; }));
}

void guard_step(const char* fn, int64_t step, double loss, double norm, const std::vector<nn::NamedParameter>& params) {
  if (std::isfinite(loss) && std::isfinite(norm)) return;
  // Every gradient finite: the loss is not, or the norm overflowed (Σ g² past float's or double's range).
  std::string culprit = std::isfinite(loss) ? "every gradient is finite (their norm overflowed)"
                                            : "every gradient is finite (the loss alone is not)";
  for (const nn::NamedParameter& p : params)
    if (const int64_t at = p.grad ? first_non_finite(*p.grad) : -1; at >= 0) {
      culprit = "the first parameter with a non-finite gradient is " + p.name + " (element " + std::to_string(at) +
                " of " + std::to_string(p.grad->numel()) + ": " +
                std::to_string(p.grad->contiguous().to_vector()[size_t(at)]) + ")";
      break;
    }
  throw NumericalError("[" + std::string(fn) + "] step " + std::to_string(step) + ": the loss is " +
                       std::to_string(loss) + " and the gradient norm " + std::to_string(norm) + "; " + culprit +
                       ". The step was not applied: the parameters are those after step " + std::to_string(step - 1));
}

// Micro-batch i contributes (its mean loss gradient) · count_i / Σ count, so
// the sum is the gradient of the mean over every target of the step.
std::vector<Batch> micro_batches(TaskModel& model, const std::vector<Example>& examples, int64_t micro, int64_t& targets) {
  if (micro < 1) raise<ValueError>("mha::train::micro_batches", "micro_batch", ">= 1", std::to_string(micro));
  std::vector<Batch> batches;
  targets = 0;
  for (size_t first = 0; first < examples.size(); first += size_t(micro)) {
    const auto last = examples.begin() + int64_t(std::min(examples.size(), first + size_t(micro)));
    batches.push_back(model.make_batch({examples.begin() + int64_t(first), last}));
    targets += target_count(batches.back());
  }
  return batches;
}

StepLoss accumulate_gradients(TaskModel& model, const std::vector<Example>& examples, int64_t micro) {
  int64_t total = 0;
  const std::vector<Batch> batches = micro_batches(model, examples, micro, total);
  StepLoss r;
  model.zero_grad();
  for (const Batch& b : batches) {
    const Tensor logits = model.forward(b);
    nn::CrossEntropyResult loss = nn::cross_entropy(logits, token_tensor(b.targets, b.rows, b.length));
    const double share = total ? double(loss.count) / double(total) : 0.0;
    scale_gradient(loss.dlogits, share);
    model.backward(loss.dlogits);
    r.loss += loss.loss * share, r.count += loss.count, r.correct += loss.correct, r.tokens += b.rows * (b.source_length + b.length);
  }
  return r;
}

bool finish_step(const TrainConfig& c, int64_t step, double loss, int64_t count, int64_t correct,
                 double train_seconds, double tokens, const std::function<double()>& evaluate,
                 const std::function<void(const TrainProgress&)>& on_progress, TrainResult& result) {
  TrainProgress p;
  p.step = step + 1, p.steps = c.steps, p.loss = loss;
  p.token_accuracy = count ? double(correct) / double(count) : 0.0;
  p.elapsed_seconds = train_seconds, p.tokens_per_second = tokens / std::max(train_seconds, 1e-9);
  const bool last = step + 1 == c.steps || (c.max_seconds > 0 && train_seconds >= c.max_seconds);
  if ((c.eval_every > 0 && (step + 1) % c.eval_every == 0) || last) p.heldout_exact_match = evaluate();
  if (on_progress) on_progress(p);
  result.steps = step + 1, result.final_loss = loss;
  if (p.heldout_exact_match >= 0) result.heldout_exact_match = p.heldout_exact_match;
  return last || (c.stop_when_perfect && p.heldout_exact_match >= 1.0);
}

void check_train_config(const TrainConfig& c, const char* fn) {
  const auto at_least = [fn](const char* field, auto value, auto low, const char* expected) {
    if (!(value >= low)) raise<ValueError>(fn, field, expected, std::to_string(value));
  };
  at_least("config.steps", c.steps, 0, ">= 0");
  at_least("config.batch_size", c.batch_size, 1, ">= 1");
  at_least("config.accumulate", c.accumulate, 1, ">= 1");
  at_least("config.warmup", c.warmup, 0, ">= 0");
  at_least("config.eval_every", c.eval_every, 0, ">= 0 (0: at the last step only)");
  at_least("config.checkpoint_every", c.checkpoint_every, 0, ">= 0 (0: never)");
  at_least("config.max_seconds", c.max_seconds, 0.0, ">= 0 (0: no limit)");
  at_least("config.lr", c.lr, 0.0, ">= 0");
  at_least("config.min_lr", c.min_lr, 0.0, ">= 0");
  at_least("config.weight_decay", c.weight_decay, 0.0, ">= 0");
  if (!(c.clip > 0)) raise<ValueError>(fn, "config.clip", "> 0 (the gradient norm's bound)", std::to_string(c.clip));
}

TrainResult train(TaskModel& model, const TaskData& data, const TrainConfig& c,
                  const std::function<void(const TrainProgress&)>& on_progress, TrainState* state,
                  const std::function<void(const TrainState&)>& on_checkpoint, const GradientFn& gradients,
                  const std::vector<nn::NamedParameter>& extra) {
  using clock = std::chrono::steady_clock;
  const char* fn = "mha::train::train";
  check_train_config(c, fn);
  Generator gen(c.seed);
  std::vector<nn::NamedParameter> params = model.named_parameters();
  params.insert(params.end(), extra.begin(), extra.end());
  // One block of parameters, one of gradients: AdamW and clipping sweep each once a step.
  if (!params.empty() && !nn::flat_parameters_of(params)) nn::flatten_parameters(params);
  optim::AdamW opt(params, {.lr = c.lr, .weight_decay = c.weight_decay});
  dist::Communicator* comm = c.communicator && c.communicator->size() > 1 ? c.communicator : nullptr;
  if (comm && (gradients || !extra.empty()))
    raise<ValueError>(fn, "gradients", "none (data-parallel training runs the cross-entropy's gradients only)",
                      "a gradient function of the caller's");
  std::optional<dist::GradientReducer> reducer;
  if (comm) reducer.emplace(*comm, params, c.bucket_bytes);
  if (c.context_parallel != 1 && (!comm || c.context_parallel < 1 || comm->size() % c.context_parallel != 0))
    raise<ValueError>(fn, "config.context_parallel",
                      "1, or a divisor of the communicator's " + std::to_string(comm ? comm->size() : 1) + " ranks",
                      std::to_string(c.context_parallel));
  const dist::ContextGroups groups =
      c.context_parallel > 1 ? dist::split_context(*comm, int(c.context_parallel)) : dist::ContextGroups{};
  TrainState s;
  if (state && state->step > 0) {
    s = *state;
    if (s.exp_avg.size() != params.size() || s.exp_avg_sq.size() != params.size())
      raise<ValueError>(fn, "state", "AdamW moments for " + std::to_string(params.size()) + " parameters",
                        std::to_string(s.exp_avg.size()) + " and " + std::to_string(s.exp_avg_sq.size()));
    for (size_t i = 0; i < params.size(); ++i) {
      opt.exp_avg()[i].copy_(s.exp_avg[i]);
      opt.exp_avg_sq()[i].copy_(s.exp_avg_sq[i]);
    }
    opt.set_steps(s.step);
    gen.set_state(s.data_seed, s.data_offset);
  }
  const auto snapshot = [&] {
    s.data_seed = gen.seed(), s.data_offset = gen.offset();
    s.exp_avg.clear(), s.exp_avg_sq.clear();
    for (size_t i = 0; i < params.size(); ++i) {
      s.exp_avg.push_back(opt.exp_avg()[i].clone());
      s.exp_avg_sq.push_back(opt.exp_avg_sq()[i].clone());
    }
    return s;
  };
  model.train();
  TrainResult result;
  result.steps = s.step;
  for (int64_t step = s.step; step < c.steps; ++step) {
    const auto t0 = clock::now();
    std::vector<Example> examples;
    for (int64_t i = 0; i < c.batch_size * c.accumulate; ++i) examples.push_back(data.sample(gen));
    opt.set_lr(optim::warmup_cosine(step, c.warmup, c.steps, c.lr, c.min_lr));
    for (const nn::NamedParameter& p : extra) p.grad->fill_(0.0);
    const StepLoss loss = groups.context ? dist::context_parallel_gradients(model, *comm, groups, *reducer, examples,
                                                                            c.batch_size)
                          : comm      ? dist::data_parallel_gradients(model, *comm, *reducer, examples, c.batch_size)
                          : gradients ? gradients(examples, c.batch_size)
                                      : accumulate_gradients(model, examples, c.batch_size);
    const double norm = optim::clip_grad_norm(params, c.clip);
    // The guard: a step whose loss or gradient is not finite would write NaN
    // into every parameter. Stop before the update, naming what went wrong.
    guard_step(fn, step + 1, loss.loss, norm, params);
    opt.step();
    s.step = step + 1;
    double seconds = std::chrono::duration<double>(clock::now() - t0).count();
    if (comm && c.max_seconds > 0) {  // one clock for all ranks, so that they stop at the same step
      dist::all_reduce(*comm, &seconds, 1);
      seconds /= comm->size();
    }
    s.train_seconds += seconds;
    s.tokens += double(loss.tokens);

    const bool stop = finish_step(c, step, loss.loss, loss.count, loss.correct, s.train_seconds, s.tokens,
                                  [&] {
                                    const Evaluation e = comm ? dist::data_parallel_evaluate(model, *comm, data.heldout())
                                                              : evaluate(model, data.heldout());
                                    result.heldout_token_accuracy = e.token_accuracy;
                                    return e.exact_match;
                                  },
                                  on_progress, result);
    if (on_checkpoint && c.checkpoint_every > 0 && (step + 1) % c.checkpoint_every == 0) on_checkpoint(snapshot());
    if (stop) break;
  }
  if (state) *state = snapshot();
  result.train_seconds = s.train_seconds;
  result.tokens_per_second = s.tokens / std::max(s.train_seconds, 1e-9);
  return result;
}

}  // namespace mha::train
