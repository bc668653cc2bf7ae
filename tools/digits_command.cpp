// `mha train --task digits`: a Vision Transformer on the 8×8 digits.
#include <cstdio>
#include <filesystem>
#include <functional>

#include "mha/dist/communicator.h"
#include "mha/errors.h"
#include "mha/io/safetensors.h"
#include "mha/train/checkpoint.h"
#include "mha/train/vision.h"
#include "progress.h"
#include "train_command.h"

namespace mha::tools {

int run_train_digits(TrainCommand& cmd) {
  if (const int ranks = dist::world().size(); ranks > 1)
    throw ValueError("[mha train] --task digits: expected one process (data-parallel training under mpirun covers "
                     "the sequence tasks); got " + std::to_string(ranks) + " ranks");
  const std::string path = cmd.data.empty() ? train::default_digits_path() : cmd.data;
  if (path.empty())
    throw ValueError("[mha train] --data: expected the path of digits.csv.gz (Debian's python3-sklearn ships it; "
                     "install it and rebuild, or pass --data); got none");
  const train::DigitSplit data = train::split_digits(train::load_digits(path), cmd.digits_heldout, cmd.train.seed);
  Generator gen(cmd.train.seed);
  nn::AttentionVariant attention = cmd.model.attention;
  attention.kind = nn::parse_attention_kind(cmd.attention);
  const HeadCounts heads = parse_heads(cmd.heads, cmd.model.num_layers);
  nn::VisionTransformer model({.patch = cmd.patch, .d_model = cmd.model.d_model, .nhead = heads.nhead,
                               .num_layers = cmd.model.num_layers, .dim_feedforward = cmd.model.dim_feedforward,
                               .dropout = cmd.model.dropout, .activation = cmd.model.activation,
                               .attention = attention, .heads = heads.lists},
                              gen);
  int64_t parameters = 0;
  for (const nn::NamedParameter& p : model.named_parameters()) parameters += p.value->numel();
  std::printf("mha train: task digits, %lld training and %lld held-out images; ViT patch %lld (%lld tokens), "
              "d_model %lld, %s, %lld layers, %s attention%s, %lld parameters\n",
              (long long)data.train.size(), (long long)data.heldout.size(), (long long)cmd.patch,
              (long long)(model.grid() * model.grid() + (model.pooled() ? 0 : 1)), (long long)cmd.model.d_model,
              describe_heads(heads.nhead, heads.lists).c_str(), (long long)cmd.model.num_layers,
              nn::describe(model.config().attention).c_str(), model.pooled() ? ", mean-pooled" : "",
              (long long)parameters);
  ProgressReport report;
  const train::TrainResult r = train::train_digits(model, data, cmd.train, std::ref(report));
  std::printf("held-out accuracy: %s after %lld steps, %.1f s of training, %.0f tokens/s\n",
              percent(r.heldout_exact_match).c_str(), (long long)r.steps, r.train_seconds, r.tokens_per_second);
  if (!cmd.out.empty()) {
    std::filesystem::create_directories(cmd.out);
    train::save_vision_checkpoint(cmd.out, model,
                                  {.model = model.config(), .seed = cmd.train.seed, .steps = r.steps,
                                   .heldout_accuracy = r.heldout_exact_match});
    io::write_file_atomically(cmd.out + "/metrics.csv", report.metrics_csv());
    write_summary(cmd.out, "digits", r, parameters);
    std::printf("wrote %s/: model.safetensors, config.json, metrics.csv, summary.json\n", cmd.out.c_str());
  }
  return 0;
}

}  // namespace mha::tools
