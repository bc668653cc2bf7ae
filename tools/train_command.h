// `mha train`: trains a Transformer (decoder-only, encoder–decoder or
// encoder) with any attention kind on a toy task and reports held-out exact
// match and token accuracy; with --out, writes a checkpoint (model.safetensors,
// config.json, train_state.safetensors), metrics.csv and summary.json. With
// --resume DIR it continues DIR's run exactly, up to --steps in all.
#pragma once

#include <string>

#include "mha/train/checkpoint.h"
#include "mha/train/trainer.h"

namespace mha::tools {

struct TrainCommand {
  std::string task = "copy";
  std::string position = "sinusoidal";
  std::string precision = "float32";  // or bf16-mixed
  std::string architecture = "decoder";  // or "encoder-decoder", "encoder"
  std::string attention = "full";        // model.attention.kind by name
  int64_t encoder_layers = 0;            // encoder-decoder; 0: as many as model.num_layers
  train::TaskConfig task_config;
  nn::LanguageModelConfig model;
  train::TrainConfig train;
  std::string out;     // output folder; empty: none
  std::string init = "default";  // weight initialisation: default, xavier, he, normal
  std::string resume;  // continue the run saved in this folder (its model, task and state)
  // --task digits (a Vision Transformer): the data file, held-out images, patch side.
  std::string data;
  int64_t digits_heldout = 360;
  int64_t patch = 2;
};

int run_train(TrainCommand& command);
// `mha train --task digits`: a Vision Transformer classifying 8×8 digit images.
int run_train_digits(TrainCommand& command);
// `mha eval --checkpoint DIR`: reloads a checkpoint and prints its held-out exact match.
// --min-length/--max-length > 0 evaluate on other lengths than those trained on.
int run_eval(const std::string& checkpoint, int64_t min_length = 0, int64_t max_length = 0,
             const train::LoadOptions& load = {});
// `mha viz --checkpoint DIR --input "3 1 4" --out PATH`: decodes the input
// greedily and draws every layer's and head's attention over the whole sequence,
// as a PNG grid or an interactive HTML page, chosen by PATH's extension
// (.png; .html or .htm). An encoder–decoder has three attentions: the PNG
// shows the encoder's self-attention, the decoder's and the cross-attention
// one under another; as HTML they are three pages, PATH with -encoder,
// -decoder and -cross before its extension.
int run_viz(const std::string& checkpoint, const std::string& input, const std::string& out,
            const train::LoadOptions& load = {});
// `mha generate --checkpoint DIR --input "3 1 4"`: greedy decoding with a KV
// cache; prints the generated tokens (max_new ≤ 0: 2 · input length + 2).
int run_generate(const std::string& checkpoint, const std::string& input, int64_t max_new,
                 const train::LoadOptions& load = {});

// `mha heads --checkpoint DIR [--out PATH.png]`: each head's importance
// (Michel et al.'s gate gradients), entropy, confidence and positional label
// over up to `examples` held-out examples, in batches of `batch`.
int run_heads(const std::string& checkpoint, const std::string& out, int64_t examples, int64_t batch,
              const train::LoadOptions& load = {});

}  // namespace mha::tools
