// `mha train`: trains a Transformer (decoder-only, encoder–decoder or
// encoder) with any attention kind on a toy task and reports held-out exact
// match and token accuracy; with --out, writes a checkpoint (model.safetensors,
// config.json, train_state.safetensors), metrics.csv and summary.json. With
// --resume DIR it continues DIR's run exactly, up to --steps in all.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mha/train/checkpoint.h"
#include "mha/train/distill.h"
#include "mha/train/trainer.h"

namespace mha::tools {

struct TrainCommand {
  std::string task = "copy";
  std::string position = "sinusoidal";
  std::string precision = "float32";  // or bf16-mixed
  std::string architecture = "decoder";  // or "encoder-decoder", "encoder"
  std::string attention = "full";        // model.attention.kind by name
  int64_t encoder_layers = 0;            // encoder-decoder; 0: as many as model.num_layers
  // --heads: one count for every layer ("4"), or one per layer ("8,4,2": each
  // head d_model / 8 wide, the largest count; an encoder-decoder's encoder,
  // decoder and cross-attention layers all take the list).
  std::string heads = "4";
  train::TaskConfig task_config;
  nn::LanguageModelConfig model;
  train::TrainConfig train;
  std::string out;     // output folder; empty: none
  std::string init = "default";  // weight initialisation: default, xavier, he, normal
  std::string resume;  // continue the run saved in this folder (its model, task and state)
  double bucket_mb = 25;  // data parallel (under mpirun): all-reduce buckets of about this many MiB
  // --task digits (a Vision Transformer): the data file, held-out images, patch side.
  std::string data;
  int64_t digits_heldout = 360;
  int64_t patch = 2;
  // `mha distill`: the teacher's checkpoint folder and the loss
  // (train/distill.h); empty: plain training. The task, its data split and
  // the architecture are the teacher's.
  std::string teacher;
  train::DistillConfig distill;
};

int run_train(TrainCommand& command);

// --heads parsed: nhead (the largest count) and the per-layer lists of ids
// (empty for one count), for `layers` layers.
struct HeadCounts {
  int64_t nhead = 0;
  std::vector<std::vector<int64_t>> lists;
};
HeadCounts parse_heads(const std::string& text, int64_t layers);
// "4 heads", or "heads 8,4,2 per layer".
std::string describe_heads(int64_t nhead, const std::vector<std::vector<int64_t>>& lists);
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
// What run_viz draws, for `mha viz` and `mha heads --html`: every attention
// view of input → output into `out` (.png, or .html: one page per view of an
// encoder-decoder), each layer's panels by head id (pruned ones grey), with
// each head's importance per site (attention_sites' names) on the pages.
// Returns the files written. attention_file_kind: ".png" or ".html" from
// out's extension (ValueError naming `command` otherwise).
using SiteScores = std::map<std::string, std::vector<std::vector<double>>>;
std::vector<std::string> draw_attention(train::LoadedCheckpoint& loaded, const std::vector<int64_t>& tokens,
                                        const std::vector<int64_t>& output, const std::string& out,
                                        const std::string& title, const SiteScores& importance, const char* command);
std::string attention_file_kind(const std::string& out, const char* command);
// `mha generate --checkpoint DIR --input "3 1 4"`: greedy decoding with a KV
// cache; prints the generated tokens (max_new ≤ 0: 2 · input length + 2).
int run_generate(const std::string& checkpoint, const std::string& input, int64_t max_new,
                 const train::LoadOptions& load = {});

// `mha heads --checkpoint DIR [--out PATH.png]`: each head's importance
// (Michel et al.'s gate gradients), entropy, confidence and positional label
// over up to `examples` held-out examples, in batches of `batch`.
int run_heads(const std::string& checkpoint, const std::string& out, int64_t examples, int64_t batch,
              const train::LoadOptions& load = {}, const std::string& html = "");

// `mha prune --checkpoint DIR (--fraction F | --heads N) --out DIR2`.
struct PruneCommand {
  std::string checkpoint, out;
  std::optional<double> fraction;  // of the model's heads, in [0, 1)
  std::optional<int64_t> heads;    // or a count
  std::string by = "importance";  // or random
  int64_t iterations = 1;      // Michel et al.'s iterative pruning: prune a share, re-score, repeat
  int64_t finetune_steps = 0;  // then train this many steps
  // Measured on reverse (docs/compression.md): 256 scoring examples rank the
  // heads too noisily to recover 100% after 200 steps at half the heads;
  // 1024 do, with these fine-tuning settings.
  int64_t examples = 1024;     // training examples the importance is scored on
  int64_t batch = 64;          // fine-tuning batch
  double lr = 2e-3;            // fine-tuning learning rate (cosine to lr / 10 after the warm-up)
  int64_t warmup = 20;         // fine-tuning warm-up steps
  uint64_t seed = 0;           // the scoring examples, the random draw, fine-tuning's batches
};
int run_prune(const PruneCommand& command);

}  // namespace mha::tools
