// Training a model of either architecture (task_model.h) on a task: AdamW,
// linear warm-up then cosine decay, gradient clipping; evaluation by greedy
// decoding on the held-out split.
#pragma once

#include <functional>

#include "mha/train/task_model.h"
#include "mha/train/tasks.h"

namespace mha::dist {
class Communicator;
}

namespace mha::train {

struct TrainConfig {
  int64_t steps = 1500;
  int64_t batch_size = 32;
  double lr = 6e-3;
  double min_lr = 6e-4;
  int64_t warmup = 100;
  double clip = 1.0;
  double weight_decay = 0.01;
  uint64_t seed = 0;
  int64_t eval_every = 250;       // held-out evaluation interval (steps)
  double max_seconds = 0.0;       // stop after this much training time (0: no limit)
  bool stop_when_perfect = true;  // stop once held-out exact match is 100%
  // Gradient accumulation: each step draws batch_size · accumulate examples and
  // runs them as `accumulate` micro-batches of batch_size, summing gradients
  // weighted by target count: the update equals one batch of them all, with
  // the activation memory of one micro-batch.
  int64_t accumulate = 1;
  int64_t checkpoint_every = 0;   // calls on_checkpoint every this many steps (0: never)
  // Data-parallel training over this communicator's ranks when it has more
  // than one (mha/dist/data_parallel.h): every rank calls train() with the
  // same model, data and config; batch_size stays the global batch. Gradients
  // are all-reduced in buckets of about bucket_bytes during backward.
  dist::Communicator* communicator = nullptr;
  int64_t bucket_bytes = int64_t(25) << 20;
  // Context parallel: each sequence spread over this many of the ranks
  // (ring attention, zigzag layout; mha/dist/context_parallel.h), the ranks
  // forming size / context_parallel data-parallel groups. 1: none.
  int64_t context_parallel = 1;
};

// Everything a run needs to continue exactly where it stopped: with the model's
// parameters and generators (saved with it) the continued run is bit-identical
// to one that never stopped.
struct TrainState {
  int64_t step = 0;                          // optimizer steps done
  uint64_t data_seed = 0, data_offset = 0;   // the generator that draws batches
  double tokens = 0, train_seconds = 0;
  std::vector<Tensor> exp_avg, exp_avg_sq;   // AdamW moments, model.named_parameters() order
};

struct TrainProgress {
  int64_t step = 0, steps = 0;
  double loss = 0, token_accuracy = 0, tokens_per_second = 0, elapsed_seconds = 0;
  double heldout_exact_match = -1;  // -1 when not evaluated at this step
};

struct TrainResult {
  int64_t steps = 0;
  double heldout_exact_match = 0, train_seconds = 0, tokens_per_second = 0, final_loss = 0;
  double heldout_token_accuracy = 0;  // at the last evaluation (sequence tasks)
};

// Trains from scratch, or continues from *state when it holds a step > 0; on
// return *state (if given) is where the run stopped. on_checkpoint gets the
// state after every checkpoint_every steps (to save it with the model).
// The training guard, for any loop: throws NumericalError when the loss or
// the gradient norm of step `step` (counted from 1) is not finite, naming the
// first of `params` whose gradient holds a NaN or infinity. Call it before the
// optimizer's step, so that the parameters stay finite.
void guard_step(const char* fn, int64_t step, double loss, double grad_norm,
                const std::vector<nn::NamedParameter>& params);

// One step's loss and counts.
struct StepLoss {
  double loss = 0;
  int64_t count = 0, correct = 0, tokens = 0;  // targets, right argmaxes, tokens run
};

// A step whose loss or gradient norm is not finite throws NumericalError
// naming the step and the first parameter whose gradient is not finite,
// before the update: the parameters stay those of the step before.
// gradients: one step's gradients of `examples` in micro-batches (the
// parameters' gradients zeroed first) and its loss; default
// accumulate_gradients, the cross-entropy on the labels (distill.h passes its
// own). extra: parameters trained beside the model's (after them in the
// state's moments), e.g. distillation's projection.
using GradientFn = std::function<StepLoss(const std::vector<Example>& examples, int64_t micro_batch)>;
TrainResult train(TaskModel& model, const TaskData& data, const TrainConfig& config,
                  const std::function<void(const TrainProgress&)>& on_progress = {}, TrainState* state = nullptr,
                  const std::function<void(const TrainState&)>& on_checkpoint = {}, const GradientFn& gradients = {},
                  const std::vector<nn::NamedParameter>& extra = {});

// Throws ValueError naming `fn` and the field when `config` holds a value no
// training loop can run with: steps, warmup, eval_every, checkpoint_every or
// max_seconds below 0, batch_size or accumulate below 1, lr or min_lr below 0,
// clip not above 0, weight_decay below 0 (NaN fails every one of these). Every
// training loop calls it before its first step.
void check_train_config(const TrainConfig& config, const char* fn);

// The bookkeeping every training loop shares, after step `step` (0-based):
// fills a TrainProgress from the step's loss and the running totals, calls
// evaluate() (the held-out metric) every eval_every steps and at the last
// step, reports to on_progress, records into `result`, and returns whether
// training stops here (last step, time limit, or perfect when asked).
bool finish_step(const TrainConfig& config, int64_t step, double loss, int64_t count, int64_t correct,
                 double train_seconds, double tokens, const std::function<double()>& evaluate,
                 const std::function<void(const TrainProgress&)>& on_progress, TrainResult& result);

// One step's gradients: zeroes the model's gradients, then runs `examples` as
// micro-batches of micro_batch and accumulates the gradient of the mean loss
// over all their targets (equal, up to rounding, to one batch of them all).
StepLoss accumulate_gradients(TaskModel& model, const std::vector<Example>& examples, int64_t micro_batch);
// t *= factor in place (t contiguous, float32 or float64): a micro-batch's
// share of the accumulated mean.
void scale_gradient(Tensor& t, double factor);
// The rows of a batch with a label (targets ≥ 0).
int64_t target_count(const Batch& batch);
// examples as batches of micro_batch (≥ 1) for `model`; their labelled rows in all into `targets`.
std::vector<Batch> micro_batches(TaskModel& model, const std::vector<Example>& examples, int64_t micro_batch,
                                 int64_t& targets);

// Greedy decoding with KV caches (TaskModel::start_decoding, decode_step):
// the output tokens of each input, up to EOS or max_new.
std::vector<std::vector<int64_t>> generate(TaskModel& model, const std::vector<std::vector<int64_t>>& inputs,
                                           int64_t max_new);

// The model's answers (TaskModel::answer) to the examples' inputs against
// their outputs: the fraction of examples answered exactly, and of output
// tokens right at their position (a shorter answer misses its missing tokens).
struct Evaluation {
  double exact_match = 0, token_accuracy = 0;
  int64_t examples = 0, exact = 0, tokens = 0, right_tokens = 0;  // the counts behind them
};
Evaluation evaluate(TaskModel& model, const std::vector<Example>& examples);
double exact_match(TaskModel& model, const std::vector<Example>& examples);  // evaluate(…).exact_match

}  // namespace mha::train
