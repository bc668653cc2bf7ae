// Training a LanguageModel on a task: AdamW, linear warm-up then cosine decay,
// gradient clipping; evaluation by greedy decoding on the held-out split.
#pragma once

#include <functional>

#include "mha/nn/language_model.h"
#include "mha/train/tasks.h"

namespace mha::train {

struct TrainConfig {
  int64_t steps = 1000;
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
};

struct TrainProgress {
  int64_t step = 0, steps = 0;
  double loss = 0, token_accuracy = 0, tokens_per_second = 0, elapsed_seconds = 0;
  double heldout_exact_match = -1;  // -1 when not evaluated at this step
};

struct TrainResult {
  int64_t steps = 0;
  double heldout_exact_match = 0, train_seconds = 0, tokens_per_second = 0, final_loss = 0;
};

TrainResult train(nn::LanguageModel& model, const TaskData& data, const TrainConfig& config,
                  const std::function<void(const TrainProgress&)>& on_progress = {});

// Greedy decoding with a KV cache (LanguageModel::decode_step): the output
// tokens after BOS input SEP, up to EOS or max_new.
std::vector<std::vector<int64_t>> generate(nn::LanguageModel& model, const std::vector<std::vector<int64_t>>& inputs,
                                           int64_t max_new);

// Fraction of examples whose greedy output equals the expected output exactly.
double exact_match(nn::LanguageModel& model, const std::vector<Example>& examples);

}  // namespace mha::train
