// `mha prune`: removes heads from a trained checkpoint (by importance,
// iteratively, or at random), optionally fine-tunes what remains, and reports
// held-out exact match and forward time before and after; writes the pruned
// checkpoint and prune.json.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "mha/errors.h"
#include "mha/io/safetensors.h"
#include "mha/train/pruning.h"
#include "mha/train/trainer.h"
#include "progress.h"
#include "train_command.h"

namespace mha::tools {

namespace {

// Median over 5 runs of one forward pass (teacher-forced, eval mode) over the
// examples in batches of 64: milliseconds.
double forward_ms(train::TaskModel& model, const std::vector<train::Example>& examples) {
  std::vector<train::Batch> batches;
  for (size_t i = 0; i < examples.size(); i += 64)
    batches.push_back(model.make_batch({examples.begin() + int64_t(i),
                                        examples.begin() + int64_t(std::min(examples.size(), i + 64))}));
  model.eval();
  std::vector<double> ms;
  for (int run = 0; run < 6; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (const train::Batch& b : batches) model.forward(b);
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (run > 0) ms.push_back(t);  // the first warms the caches and the allocator
  }
  model.release_activations();
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int64_t parameter_count(train::TaskModel& model) {
  int64_t n = 0;
  for (const nn::NamedParameter& p : model.named_parameters()) n += p.value->numel();
  return n;
}

}  // namespace

int run_prune(const PruneCommand& cmd) {
  const char* fn = "[mha prune]";
  if (cmd.fraction.has_value() == cmd.heads.has_value())
    throw ValueError(std::string(fn) + " --fraction, --heads: expected one of them; got " +
                     (cmd.fraction ? "both" : "neither"));
  if (cmd.fraction && !(*cmd.fraction >= 0 && *cmd.fraction < 1))
    throw ValueError(std::string(fn) + " --fraction: expected a share in [0, 1); got " + std::to_string(*cmd.fraction));
  if (cmd.heads && *cmd.heads < 0)
    throw ValueError(std::string(fn) + " --heads: expected >= 0; got " + std::to_string(*cmd.heads));
  if (cmd.iterations < 1)
    throw ValueError(std::string(fn) + " --iterations: expected >= 1; got " + std::to_string(cmd.iterations));
  if (cmd.by != "importance" && cmd.by != "random")
    throw ValueError(std::string(fn) + " --by: expected importance or random; got '" + cmd.by + "'");
  if (cmd.finetune_steps < 0)
    throw ValueError(std::string(fn) + " --finetune-steps: expected >= 0; got " + std::to_string(cmd.finetune_steps));
  if (cmd.examples < 1) throw ValueError(std::string(fn) + " --examples: expected >= 1; got " + std::to_string(cmd.examples));
  train::LoadedCheckpoint loaded = train::load_checkpoint(cmd.checkpoint);
  train::TaskModel& model = *loaded.model;
  const int64_t total = train::count_heads(model);
  const int64_t target = cmd.fraction ? int64_t(std::llround(*cmd.fraction * double(total))) : *cmd.heads;
  if (target > total)
    throw ValueError(std::string(fn) + " --heads: expected at most the model's " + std::to_string(total) +
                     " heads; got " + std::to_string(target));
  const train::TaskData data(loaded.info.task, loaded.info.seed);
  const std::vector<train::Example>& heldout = data.heldout();

  const train::Evaluation before = train::evaluate(model, heldout);
  const double before_ms = forward_ms(model, heldout);
  const int64_t before_params = parameter_count(model);
  std::printf("mha prune: %s, %lld heads, %lld parameters: held-out exact match %s, forward %.2f ms (%lld examples)\n",
              cmd.checkpoint.c_str(), (long long)total, (long long)before_params,
              percent(before.exact_match).c_str(), before_ms, (long long)heldout.size());

  // Scored on training examples: the held-out ones stay unseen until the end.
  Generator gen(cmd.seed ^ 0x5eedull);
  std::vector<train::Example> scoring;
  for (int64_t i = 0; i < cmd.examples; ++i) scoring.push_back(data.sample(gen));
  const std::vector<train::PrunedHead> pruned = train::prune_model(
      model, scoring, {.heads = target, .random = cmd.by == "random", .iterations = cmd.iterations, .seed = cmd.seed});
  for (const train::PrunedHead& h : pruned)
    std::printf("  pruned %s layer %lld head %lld (iteration %lld, importance %.3f)\n", h.site.c_str(),
                (long long)h.layer, (long long)h.id, (long long)h.iteration, h.importance);
  const train::Evaluation pruned_eval = train::evaluate(model, heldout);
  std::printf("mha prune: %lld of %lld heads pruned %s: held-out exact match %s before fine-tuning\n",
              (long long)pruned.size(), (long long)total, cmd.by == "random" ? "at random" : "by importance",
              percent(pruned_eval.exact_match).c_str());

  train::Evaluation after = pruned_eval;
  if (cmd.finetune_steps > 0) {
    const train::TrainResult r = train::train(
        model, data,
        {.steps = cmd.finetune_steps, .batch_size = cmd.batch, .lr = cmd.lr, .min_lr = cmd.lr / 10, .warmup = cmd.warmup,
         .seed = cmd.seed, .eval_every = 0, .stop_when_perfect = false});
    after = train::evaluate(model, heldout);
    std::printf("mha prune: fine-tuned %lld steps (%.1f s): held-out exact match %s\n", (long long)r.steps,
                r.train_seconds, percent(after.exact_match).c_str());
  }
  const double after_ms = forward_ms(model, heldout);
  const int64_t after_params = parameter_count(model);
  std::printf("mha prune: %lld parameters (%.0f%%), forward %.2f ms (%.2fx the unpruned model's)\n",
              (long long)after_params, 100.0 * double(after_params) / double(before_params), after_ms,
              after_ms / before_ms);

  train::Checkpoint info = loaded.info;
  info.steps += cmd.finetune_steps;
  train::save_checkpoint(cmd.out, model, info);
  nlohmann::json heads = nlohmann::json::array();
  for (const train::PrunedHead& h : pruned)
    heads.push_back({{"site", h.site}, {"layer", h.layer}, {"head", h.id}, {"iteration", h.iteration},
                     {"importance", h.importance}});
  const nlohmann::json report = {
      {"checkpoint", cmd.checkpoint}, {"by", cmd.by}, {"iterations", cmd.iterations}, {"heads", total},
      {"pruned", heads}, {"finetune_steps", cmd.finetune_steps}, {"seed", cmd.seed},
      {"exact_match", {{"before", before.exact_match}, {"pruned", pruned_eval.exact_match}, {"after", after.exact_match}}},
      {"forward_ms", {{"before", before_ms}, {"after", after_ms}}},
      {"parameters", {{"before", before_params}, {"after", after_params}}}};
  io::write_file_atomically(cmd.out + "/prune.json", report.dump(2) + "\n");
  std::printf("wrote %s/: model.safetensors, config.json, prune.json\n", cmd.out.c_str());
  return 0;
}

}  // namespace mha::tools
