// `mha train`: progress on a terminal as one live line, else plain lines.
#include "train_command.h"

#include "distill_command.h"
#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <filesystem>
#include <sstream>

#include "mha/dist/data_parallel.h"
#include "mha/io/safetensors.h"
#include "mha/train/checkpoint.h"
#include "mha/train/pruning.h"
#include "mha/errors.h"
#include "mha/memory.h"
#include "mha/nn/init.h"
#include "mha/viz/html.h"
#include "mha/viz/image.h"

namespace mha::tools {

namespace {

// Loads a checkpoint for a command; says so when its weights carry no checksums.
train::LoadedCheckpoint load(const std::string& dir, const train::LoadOptions& options, bool training = false) {
  train::LoadedCheckpoint loaded = training ? train::load_training_checkpoint(dir, options)
                                            : train::load_checkpoint(dir, options);
  if (!loaded.checksummed)
    std::fprintf(stderr, "mha: note: the weights in %s carry no checksums (written by another tool or an older mha), "
                 "so a changed byte cannot be detected\n", dir.c_str());
  return loaded;
}

}  // namespace

HeadCounts parse_heads(const std::string& text, int64_t layers) {
  const std::string what = "[mha train] --heads: expected one count for every layer or one per layer (" +
                           std::to_string(layers) + "), e.g. 4 or 8,4,2, counts >= 0 and one of them >= 1; got '" +
                           text + "'";
  std::vector<int64_t> counts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    size_t used = 0;
    int64_t n = -1;
    try {
      n = std::stoll(part, &used);
    } catch (const std::exception&) {
    }
    if (part.empty() || used != part.size() || n < 0) throw ValueError(what);
    counts.push_back(n);
  }
  if (counts.empty() || (counts.size() != 1 && int64_t(counts.size()) != layers)) throw ValueError(what);
  HeadCounts h{*std::max_element(counts.begin(), counts.end()), {}};
  if (h.nhead < 1) throw ValueError(what);
  if (counts.size() > 1 || counts[0] != h.nhead)
    for (int64_t n : counts) h.lists.push_back(nn::all_heads(n));
  return h;
}

std::string describe_heads(int64_t nhead, const std::vector<std::vector<int64_t>>& lists) {
  if (lists.empty()) return std::to_string(nhead) + " heads";
  std::string s = "heads ";  // appended piece by piece: GCC 12 warns (-Wrestrict) on "," + to_string
  for (size_t l = 0; l < lists.size(); ++l) {
    if (l) s += ',';
    s += std::to_string(lists[l].size());
  }
  return s + " per layer";
}

int run_train(TrainCommand& cmd) {
  // Under mpirun -np P > 1: data parallel; rank 0 prints and writes the checkpoints.
  dist::Communicator& comm = dist::world();
  if (comm.size() > 1) {
    cmd.train.communicator = &comm;
    cmd.train.bucket_bytes = std::max<int64_t>(1, int64_t(cmd.bucket_mb * double(1 << 20)));
    if (comm.rank() != 0 && !std::freopen("/dev/null", "w", stdout))
      throw std::runtime_error("[mha train] cannot silence rank " + std::to_string(comm.rank()) + "'s output");
  }
  std::unique_ptr<train::TaskModel> model;
  train::Architecture architecture = train::Architecture::decoder;
  train::TrainState state;
  std::string earlier_metrics;
  std::vector<std::vector<int64_t>> encoder_heads, cross_heads;  // an encoder-decoder's
  std::optional<TeacherRun> teacher;
  uint64_t data_seed = cmd.train.seed;  // the task data's (its held-out split); the checkpoint records it
  if (!cmd.teacher.empty()) teacher.emplace(cmd.teacher, cmd.distill);
  const char* name = teacher ? "mha distill" : "mha train";
  if (!cmd.resume.empty()) {
    train::LoadedCheckpoint loaded = load(cmd.resume, {}, true);
    if (teacher) teacher->resume(cmd.resume, *loaded.model, loaded.info, *loaded.state);
    cmd.model = loaded.info.model, cmd.task_config = loaded.info.task, data_seed = loaded.info.seed;
    cmd.task = train::to_string(cmd.task_config.task);
    architecture = loaded.info.architecture, cmd.encoder_layers = loaded.info.num_encoder_layers;
    encoder_heads = loaded.info.encoder_heads, cross_heads = loaded.info.cross_heads;
    model = std::move(loaded.model);
    state = *loaded.state;
    std::ifstream metrics_file(cmd.resume + "/metrics.csv");
    earlier_metrics.assign(std::istreambuf_iterator<char>(metrics_file), std::istreambuf_iterator<char>());
    std::printf("%s: resuming %s at step %lld\n", name, cmd.resume.c_str(), (long long)state.step);
  } else {
    if (teacher) {  // the teacher's task, data split and architecture
      cmd.task_config = teacher->teacher.info.task, cmd.task = train::to_string(cmd.task_config.task);
      cmd.architecture = train::to_string(teacher->teacher.info.architecture);
      data_seed = teacher->teacher.info.seed;  // the teacher's held-out split; --seed draws the rest
    }
    cmd.task_config.task = train::parse_task(cmd.task);
    cmd.model.position = nn::parse_position(cmd.position);
    cmd.model.precision = nn::parse_precision(cmd.precision);
    cmd.model.vocab_size = train::kVocab;
    cmd.model.attention.kind = nn::parse_attention_kind(cmd.attention);
    // Linformer's projections span the longest sequence the task makes.
    cmd.model.attention.max_length = train::max_sequence(cmd.task_config);
    architecture = train::parse_architecture(cmd.architecture);
    if (architecture != train::Architecture::encoder_decoder) cmd.encoder_layers = 0;
    else if (cmd.encoder_layers <= 0) cmd.encoder_layers = cmd.model.num_layers;
    const HeadCounts heads = parse_heads(cmd.heads, cmd.model.num_layers);
    cmd.model.nhead = heads.nhead, cmd.model.heads = heads.lists;
    if (architecture == train::Architecture::encoder_decoder && !heads.lists.empty()) {
      if (cmd.encoder_layers != cmd.model.num_layers)
        throw ValueError("[mha train] --heads: expected as many encoder as decoder layers for one count per layer "
                         "of an encoder-decoder; got " + std::to_string(cmd.encoder_layers) + " and " +
                         std::to_string(cmd.model.num_layers));
      encoder_heads = cross_heads = heads.lists;
    }
    Generator gen(cmd.train.seed);
    model = train::make_task_model(architecture, cmd.model, cmd.encoder_layers, gen, encoder_heads, cross_heads);
    nn::initialize(*model, nn::parse_init(cmd.init), gen);
    if (teacher) teacher->check_student(*model, {.model = cmd.model, .task = cmd.task_config});
  }
  const train::TaskData data(cmd.task_config, data_seed);
  // One-token answers (ListOps): what always giving the most common one scores.
  double baseline = -1;
  if (cmd.task_config.task == train::Task::listops) {
    std::vector<int64_t> counts(train::kVocab, 0);
    for (const train::Example& e : data.heldout()) ++counts[size_t(e.output.at(0))];
    baseline = double(*std::max_element(counts.begin(), counts.end())) / double(data.heldout().size());
    std::printf("%s: the most common held-out answer is %.1f%% of them\n", name, 100 * baseline);
  }
  int64_t parameters = 0;
  for (const nn::NamedParameter& p : model->named_parameters()) parameters += p.value->numel();
  const std::string layers =
      architecture == train::Architecture::encoder_decoder
          ? "encoder-decoder, " + std::to_string(cmd.encoder_layers) + " encoder and " +
                std::to_string(cmd.model.num_layers) + " decoder layers"
          : train::to_string(architecture) + ", " + std::to_string(cmd.model.num_layers) + " layers";
  std::printf("%s: task %s, %lld held-out examples; model d_model %lld, %s, %s, %s attention, "
              "%s positions, %s, %lld parameters, %s precision%s\n",
              name, cmd.task.c_str(), (long long)data.heldout().size(), (long long)cmd.model.d_model,
              describe_heads(cmd.model.nhead, cmd.model.heads).c_str(),
              layers.c_str(), nn::describe(cmd.model.attention).c_str(), nn::to_string(cmd.model.position).c_str(),
              cmd.model.norm_first ? "Pre-LN" : "Post-LN", (long long)parameters,
              nn::to_string(cmd.model.precision).c_str(), cmd.model.checkpoint_activations ? ", activation checkpointing" : "");
  if (teacher)
    std::printf("%s\n", teacher->describe(parameters, train::evaluate(*teacher->teacher.model, data.heldout()).exact_match)
                             .c_str());
  if (comm.size() > 1) {
    // D data-parallel groups of C ranks (C = 1: every rank a group); train() refuses a C that does not divide P.
    const int64_t C = cmd.train.context_parallel;
    const int groups = C >= 1 && comm.size() % C == 0 ? int(comm.size() / C) : comm.size();
    const dist::Share first = dist::share_of(cmd.train.batch_size, 0, groups),
                      last = dist::share_of(cmd.train.batch_size, groups - 1, groups);
    const std::string split = std::to_string(first.end - first.begin) +
                              (first.end - first.begin == last.end - last.begin
                                   ? ""
                                   : " (the first " + std::to_string(cmd.train.batch_size % groups) + " " +
                                         (C > 1 ? "groups" : "ranks") + ") or " + std::to_string(last.end - last.begin));
    if (C > 1)
      std::printf("%s: %d ranks (%s): each sequence spread over %lld ranks (zigzag ring attention); %d data-parallel "
                  "groups of them, each batch of %lld as %s examples per group; gradients all-reduced in buckets of "
                  "%.3g MiB\n",
                  name, comm.size(), comm.backend().c_str(), (long long)C, groups, (long long)cmd.train.batch_size,
                  split.c_str(), cmd.bucket_mb);
    else
      std::printf("%s: data parallel over %d ranks (%s): each batch of %lld as %s examples per rank, gradients "
                  "all-reduced in buckets of %.3g MiB\n",
                  name, comm.size(), comm.backend().c_str(), (long long)cmd.train.batch_size, split.c_str(),
                  cmd.bucket_mb);
  }
  const auto save = [&](const train::TrainState& s) {
    if (comm.rank() != 0) return;  // one writer
    std::filesystem::create_directories(cmd.out);
    const train::TrainState student = teacher ? teacher->save(cmd.out, s) : s;
    train::save_checkpoint(cmd.out, *model,
                           {.model = cmd.model, .task = cmd.task_config, .seed = data_seed, .steps = s.step,
                            .architecture = architecture, .num_encoder_layers = cmd.encoder_layers},
                           &student);
  };
  ProgressReport report(earlier_metrics);
  int64_t saved_step = -1;  // of the last checkpoint written in cmd.out
  const auto on_checkpoint = [&](const train::TrainState& s) {
    if (cmd.out.empty()) return;
    save(s);
    saved_step = s.step;
  };
  train::TrainResult r;
  try {
    r = train::train(*model, data, cmd.train, std::ref(report), &state, on_checkpoint,
                     teacher ? teacher->gradients(*model) : train::GradientFn{},
                     teacher ? teacher->extra() : std::vector<nn::NamedParameter>{});
  } catch (const NumericalError& e) {
    // Nothing more is written: the last checkpoint stays as it was.
    throw NumericalError(std::string(e.what()) + ".\n" +
                         (saved_step >= 0 ? "The last checkpoint, at step " + std::to_string(saved_step) + ", is intact in " +
                                                cmd.out + ": `" + name + " --resume " + cmd.out +
                                                "` continues from it (with a lower --lr or a tighter --clip, say)"
                                          : std::string("No checkpoint was written (--out with --checkpoint-every N saves one every N steps)")));
  }
  std::printf("held-out exact match: %s (token accuracy %s) after %lld steps, %.1f s of training, %.0f tokens/s\n",
              percent(r.heldout_exact_match).c_str(), percent(r.heldout_token_accuracy).c_str(), (long long)r.steps, r.train_seconds,
              r.tokens_per_second);
  std::printf("peak tensor memory: %.1f MiB\n", double(peak_memory()) / (1 << 20));
  if (!cmd.out.empty() && comm.rank() == 0) {
    save(state);
    io::write_file_atomically(cmd.out + "/metrics.csv", report.metrics_csv());
    write_summary(cmd.out, cmd.task, r, parameters, baseline);
    std::printf("wrote %s/: model.safetensors, config.json, train_state.safetensors, metrics.csv, summary.json\n",
                cmd.out.c_str());
  }
  return 0;
}

int run_eval(const std::string& checkpoint, int64_t min_length, int64_t max_length, const train::LoadOptions& options) {
  train::LoadedCheckpoint loaded = load(checkpoint, options);
  // Other lengths than those trained on (length generalisation): a fresh held-out set.
  if (min_length > 0 || max_length > 0)
    std::printf("evaluating on lengths %lld-%lld\n",
                (long long)(min_length > 0 ? min_length : loaded.info.task.min_length),
                (long long)(max_length > 0 ? max_length : loaded.info.task.max_length));
  const std::vector<train::Example> heldout = train::heldout_examples(loaded.info, min_length, max_length);
  const train::Evaluation e = train::evaluate(*loaded.model, heldout);
  std::printf("%s: task %s, trained %lld steps; held-out exact match %s, token accuracy %s (%lld examples)\n",
              checkpoint.c_str(), train::to_string(loaded.info.task.task).c_str(), (long long)loaded.info.steps,
              percent(e.exact_match).c_str(), percent(e.token_accuracy).c_str(), (long long)heldout.size());
  return 0;
}

std::string attention_file_kind(const std::string& out, const char* command) {
  std::string extension = std::filesystem::path(out).extension().string();
  std::transform(extension.begin(), extension.end(), extension.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (extension == ".htm") extension = ".html";
  if (extension != ".html" && extension != ".png")
    throw mha::ValueError(std::string("[") + command + "] --out: expected a file name ending in .png or .html; got '" +
                          out + "'");
  return extension;
}

std::vector<std::string> draw_attention(train::LoadedCheckpoint& loaded, const std::vector<int64_t>& tokens,
                                        const std::vector<int64_t>& output, const std::string& out,
                                        const std::string& title, const SiteScores& importance, const char* command) {
  const bool html = attention_file_kind(out, command) == ".html";
  const std::vector<train::AttentionView> views = loaded.model->attention(tokens, output);
  if (views.empty())
    throw ValueError(std::string("[") + command + "] checkpoint: expected a model with full or window attention (the "
                     "others form no weights to draw); got " + nn::to_string(loaded.info.model.attention.kind) +
                     " attention");
  const auto labels = [](const std::vector<int64_t>& ids) {
    std::vector<std::string> names;
    for (int64_t t : ids) names.push_back(train::format_tokens({t}));
    return names;
  };
  std::vector<std::string> written;
  std::vector<viz::Image> pictures;
  std::vector<std::string> titles;
  for (const train::AttentionView& view : views) {
    const std::vector<std::string> queries = labels(view.queries), keys = labels(view.keys);
    // Panels by head id: a pruned head's stays, grey.
    const train::HeadLists ids = train::head_ids(*loaded.model, view.short_name);
    const std::vector<Tensor> weights = train::weights_by_id(view.weights, ids, loaded.info.model.nhead);
    if (html) {
      // One page per attention: PATH itself, or PATH with "-encoder", "-decoder", "-cross" before its extension.
      const std::filesystem::path path(out);
      const std::string page = views.size() == 1 ? out
                               : (path.parent_path() / (path.stem().string() + "-" + view.short_name +
                                                        path.extension().string())).string();
      const auto found = importance.find(view.short_name);
      viz::save_attention_html(page, weights, queries, keys, views.size() == 1 ? title : title + " (" + view.name + ")",
                               {.present = ids, .importance = found == importance.end() ? std::vector<std::vector<double>>{}
                                                                                        : found->second});
      written.push_back(page);
    } else {
      pictures.push_back(viz::attention_grid(weights, queries, keys));
      titles.push_back(view.name);
    }
  }
  if (!html) {
    viz::save_png(out, pictures.size() == 1 ? pictures[0] : viz::stack_pictures(pictures, titles));
    written.push_back(out);
  }
  return written;
}

int run_viz(const std::string& checkpoint, const std::string& input, const std::string& out,
            const train::LoadOptions& options) {
  attention_file_kind(out, "mha viz");
  train::LoadedCheckpoint loaded = load(checkpoint, options);
  const std::vector<int64_t> tokens = train::parse_tokens(input, "mha viz");
  const std::vector<int64_t> output = train::answer(loaded, tokens, 2 * int64_t(tokens.size()) + 2, "mha viz");
  const std::string in_text = train::format_tokens(tokens), out_text = train::format_tokens(output);
  const std::string title = "Attention of the " + train::to_string(loaded.info.task.task) + " model in " + checkpoint +
                            ": " + in_text + " → " + out_text;
  const std::vector<std::string> written = draw_attention(loaded, tokens, output, out, title, {}, "mha viz");
  std::string files;
  for (const std::string& f : written) files += (files.empty() ? "" : ", ") + f;
  std::string kinds;
  for (const train::AttentionView& view : loaded.model->attention(tokens, output))
    kinds += (kinds.empty() ? "" : ", ") + view.name + " of " + std::to_string(view.weights.size()) +
             (view.weights.size() == 1 ? " layer" : " layers");
  std::printf("input  %s\noutput %s\nwrote %s: %s × %lld heads (rows: queries, columns: keys)\n", in_text.c_str(),
              out_text.c_str(), files.c_str(), kinds.c_str(), (long long)loaded.info.model.nhead);
  return 0;
}

int run_generate(const std::string& checkpoint, const std::string& input, int64_t max_new,
                 const train::LoadOptions& options) {
  if (max_new < 0)
    throw ValueError("[mha generate] --max-new: expected >= 0 (0: twice the input's tokens, plus 2); got " +
                     std::to_string(max_new));
  train::LoadedCheckpoint loaded = load(checkpoint, options);
  const std::vector<int64_t> tokens = train::parse_tokens(input, "mha generate");
  if (max_new == 0) max_new = 2 * int64_t(tokens.size()) + 2;
  const std::vector<int64_t> output = train::answer(loaded, tokens, max_new, "mha generate");
  std::printf("%s\n", train::format_tokens(output).c_str());
  return 0;
}

}  // namespace mha::tools
