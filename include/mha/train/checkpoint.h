// Checkpoints of a trained LanguageModel: DIR/model.safetensors (every
// parameter under torch-style names) and DIR/config.json (model, task and
// seed), both written atomically. Loading rebuilds the model from the config
// and refuses, with FormatError, a file whose tensors are missing, extra, or
// of another shape or dtype.
#pragma once

#include <memory>
#include <string>

#include "mha/nn/language_model.h"
#include "mha/train/tasks.h"

namespace mha::train {

struct Checkpoint {
  nn::LanguageModelConfig model;
  TaskConfig task;
  uint64_t seed = 0;  // the task data's seed: the same held-out split on reload
  int64_t steps = 0;
};

void save_checkpoint(const std::string& dir, nn::LanguageModel& model, const Checkpoint& info);

struct LoadedCheckpoint {
  Checkpoint info;
  std::unique_ptr<nn::LanguageModel> model;
};

LoadedCheckpoint load_checkpoint(const std::string& dir);

}  // namespace mha::train
