// Checkpoints of a trained model of either architecture, in DIR:
//   model.safetensors        every parameter under torch-style names
//                            (encoder.layers.0.self_attn.in_proj_weight, …)
//   config.json              model (with its architecture; configs without
//                            one are decoder-only), task, seed and steps
//   train_state.safetensors  (training checkpoints) the parameters again, the
//                            AdamW moments, and in its metadata the config,
//                            the step, the data generator and the model's
//                            dropout generators: all that `mha train --resume`
//                            needs to continue bit-identically
// Each file is written atomically (temporary file, fsync, rename), in the
// order train_state, model, config; all three carry the same save id. A crash
// between two renames leaves model.safetensors and config.json from different
// saves: loading notices the ids differ and takes the weights and config from
// train_state.safetensors, which is whole and from the newer save. Anything
// else that does not match — missing, extra or reshaped tensors, a truncated
// or corrupt file, a changed byte (every tensor's CRC-32 is verified, see
// io/safetensors.h), a NaN or infinity in the weights or moments — is refused
// with FormatError naming the file and the tensor.
#pragma once

#include <memory>
#include <string>

#include "mha/nn/vision_transformer.h"
#include "mha/train/task_model.h"
#include "mha/train/tasks.h"
#include "mha/train/trainer.h"

namespace mha::train {

struct Checkpoint {
  nn::LanguageModelConfig model;  // the decoder-only model, or the encoder–decoder's decoder
  TaskConfig task;
  uint64_t seed = 0;  // the task data's seed: the same held-out split on reload
  int64_t steps = 0;
  Architecture architecture = Architecture::decoder;
  int64_t num_encoder_layers = 0;  // encoder-decoder
  // An encoder–decoder's encoder and cross-attention heads per layer, by id
  // (nn::EncoderDecoderConfig); the other sites' are model.heads. Saving
  // takes them, and model.heads, from the model itself.
  std::vector<std::vector<int64_t>> encoder_heads, cross_heads;
};

// state: also write train_state.safetensors (with the model's generators).
// info.architecture must be the model's (ValueError otherwise).
void save_checkpoint(const std::string& dir, TaskModel& model, const Checkpoint& info,
                     const TrainState* state = nullptr);

struct LoadedCheckpoint {
  Checkpoint info;
  std::unique_ptr<TaskModel> model;  // in eval mode
  std::unique_ptr<TrainState> state;         // load_training_checkpoint only
  bool checksummed = true;  // false: the weights carry no checksums (another tool, an older mha)
};

struct LoadOptions {
  // Load NaN and infinite weights (to inspect a diverged run) instead of refusing them.
  bool allow_non_finite = false;
};

// The config.json text of a checkpoint (FormatError naming `path` when it is
// not one). The model it describes is validated when built.
Checkpoint parse_checkpoint_config(const std::string& text, const std::string& path);

// Weights and config (for eval, viz, generate).
LoadedCheckpoint load_checkpoint(const std::string& dir, const LoadOptions& options = {});
// From train_state.safetensors: weights, config, optimizer state, and the
// model's dropout generators restored.
LoadedCheckpoint load_training_checkpoint(const std::string& dir, const LoadOptions& options = {});

// The model's answer to one input (eval mode): greedy decoding up to max_new
// tokens, or (the encoder) as many as the task gives that input; ValueError
// naming fn when the encoder's task leaves the output's length open.
std::vector<int64_t> answer(LoadedCheckpoint& loaded, const std::vector<int64_t>& input, int64_t max_new,
                            const char* fn);

// The checkpoint's held-out examples (its task and seed: the split training
// never sampled), at other input lengths where min_length or max_length > 0
// (length generalisation), the first `limit` of them where limit > 0.
std::vector<Example> heldout_examples(const Checkpoint& info, int64_t min_length = 0, int64_t max_length = 0,
                                      int64_t limit = 0);

// A Vision Transformer's checkpoint (`mha train --task digits --out DIR`):
// model.safetensors and config.json (model.architecture "vision"), written
// and verified as above, both with one save id (no training state: an
// interrupted save is refused, not recovered).
struct VisionCheckpoint {
  nn::VisionTransformerConfig model;
  uint64_t seed = 0;  // the split's seed: the same held-out images on reload
  int64_t steps = 0;
  double heldout_accuracy = 0;
};

void save_vision_checkpoint(const std::string& dir, nn::VisionTransformer& model, const VisionCheckpoint& info);

struct LoadedVisionCheckpoint {
  VisionCheckpoint info;
  std::unique_ptr<nn::VisionTransformer> model;  // in eval mode
  bool checksummed = true;
};

LoadedVisionCheckpoint load_vision_checkpoint(const std::string& dir, const LoadOptions& options = {});

// The config as config.json holds it (without its save id), as JSON text.
std::string config_json(const Checkpoint& info);
std::string config_json(const VisionCheckpoint& info);

// What the checkpoint in dir holds, from its config.json: "decoder",
// "encoder-decoder", "encoder" or "vision" (FormatError when it is none).
std::string checkpoint_architecture(const std::string& dir);

}  // namespace mha::train
