// Checkpoints: safetensors weights, a JSON config, and the training state.
#include "mha/train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "mha/errors.h"
#include "mha/io/safetensors.h"
#include "mha/train/pruning.h"

namespace mha::train {

namespace {

using nlohmann::json;

constexpr const char* kLoad = "mha::train::load_checkpoint";

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw FormatError(std::string("[") + kLoad + "] " + path + ": " + what);
}

json attention_json(const nn::AttentionVariant& a) {
  return {{"kind", nn::to_string(a.kind)}, {"window", a.window}, {"block", a.block}, {"local_blocks", a.local_blocks},
          {"stride_blocks", a.stride_blocks}, {"global_blocks", a.global_blocks}, {"window_blocks", a.window_blocks},
          {"random_blocks", a.random_blocks}, {"features", a.features}, {"redraw_every", a.redraw_every},
          {"projected", a.projected}, {"max_length", a.max_length}, {"buckets", a.buckets}, {"hashes", a.hashes},
          {"chunk", a.chunk}, {"axial_width", a.axial_width}, {"seed", a.seed}};
}

// Fields left out keep their defaults (checkpoints from before a field existed).
nn::AttentionVariant parse_attention(const json& j, const std::string& path) {
  nn::AttentionVariant a;
  const std::string kind = j.value("kind", "full");
  try {
    a.kind = nn::parse_attention_kind(kind);
  } catch (const ValueError&) {
    bad(path, "attention kind must be one of " + nn::attention_kind_names() + "; got " + kind);
  }
  for (auto [name, field] : {std::pair{"window", &a.window}, {"block", &a.block}, {"local_blocks", &a.local_blocks},
                             {"stride_blocks", &a.stride_blocks}, {"global_blocks", &a.global_blocks},
                             {"window_blocks", &a.window_blocks}, {"random_blocks", &a.random_blocks},
                             {"features", &a.features}, {"redraw_every", &a.redraw_every},
                             {"projected", &a.projected}, {"max_length", &a.max_length}, {"buckets", &a.buckets},
                             {"hashes", &a.hashes}, {"chunk", &a.chunk}, {"axial_width", &a.axial_width}})
    *field = j.value(name, *field);
  a.seed = j.value("seed", a.seed);
  try {
    nn::check_attention_variant(a, kLoad);
  } catch (const ValueError& e) {
    bad(path, std::string("invalid attention settings: ") + e.what());
  }
  return a;
}

// What the token models' and the ViT's configs share.
const char* activation_name(nn::Activation a) { return a == nn::Activation::relu ? "relu" : "gelu"; }

nn::Activation parse_activation(const json& model, const std::string& path) {
  const std::string act = model.at("activation").get<std::string>();
  if (act != "relu" && act != "gelu") bad(path, "activation must be relu or gelu; got " + act);
  return act == "relu" ? nn::Activation::relu : nn::Activation::gelu;
}

DType parse_dtype(const json& model, const std::string& path) {
  const std::string dtype = model.at("dtype").get<std::string>();
  if (dtype != "float32" && dtype != "float64") bad(path, "dtype must be float32 or float64; got " + dtype);
  return dtype == "float64" ? DType::float64 : DType::float32;
}

// The "model" object of an mha checkpoint's config (format and version checked).
const json& model_of(const json& config, const std::string& path) {
  if (config.at("format") != "mha-checkpoint" || config.at("version") != 1) bad(path, "not an mha checkpoint (version 1)");
  return config.at("model");
}

json config_json(const Checkpoint& info, const std::string& save_id) {
  const nn::LanguageModelConfig& m = info.model;
  json model = {{"architecture", to_string(info.architecture)}, {"vocab_size", m.vocab_size}, {"d_model", m.d_model},
                {"nhead", m.nhead}, {"num_layers", m.num_layers}, {"dim_feedforward", m.dim_feedforward},
                {"dropout", m.dropout}, {"activation", activation_name(m.activation)},
                {"norm_first", m.norm_first}, {"dtype", to_string(m.dtype)}, {"position", nn::to_string(m.position)},
                {"max_len", m.max_len}, {"num_buckets", m.num_buckets}, {"max_distance", m.max_distance},
                {"rope_base", m.rope_base}, {"precision", nn::to_string(m.precision)},
                {"checkpoint_activations", m.checkpoint_activations}, {"attention", attention_json(m.attention)}};
  // An encoder–decoder's num_layers is its decoder's.
  if (info.architecture == Architecture::encoder_decoder) model["num_encoder_layers"] = info.num_encoder_layers;
  // Heads per layer by id, only where a layer has fewer than nhead (pruned, or counts per layer).
  for (auto [name, lists] : {std::pair{"heads", &m.heads}, {"encoder_heads", &info.encoder_heads},
                             {"cross_heads", &info.cross_heads}})
    if (!lists->empty()) model[name] = *lists;
  return {{"format", "mha-checkpoint"},
          {"version", 1},
          {"save_id", save_id},
          {"model", model},
          {"task",
           {{"task", to_string(info.task.task)}, {"min_length", info.task.min_length},
            {"max_length", info.task.max_length}, {"digits", info.task.digits}, {"reversed_sum", info.task.reversed_sum},
            {"heldout", info.task.heldout}, {"max_args", info.task.max_args}, {"max_depth", info.task.max_depth}}},
          {"seed", info.seed},
          {"steps", info.steps}};
}

Checkpoint parse_config(const json& c, const std::string& path) {
  Checkpoint info;
  try {
    const json& m = model_of(c, path);
    // Checkpoints from before the encoder–decoder are decoder-only.
    const std::string architecture = m.value("architecture", "decoder");
    if (architecture == "vision")
      bad(path, "a Vision Transformer's checkpoint: load it with load_vision_checkpoint (mha.load in Python)");
    try {
      info.architecture = parse_architecture(architecture);
    } catch (const ValueError&) {
      bad(path, "architecture must be decoder, encoder-decoder or encoder; got " + architecture);
    }
    if (info.architecture == Architecture::encoder_decoder)
      info.num_encoder_layers = m.at("num_encoder_layers").get<int64_t>();
    nn::LanguageModelConfig& mc = info.model;
    mc.vocab_size = m.at("vocab_size").get<int64_t>();
    mc.d_model = m.at("d_model").get<int64_t>();
    mc.nhead = m.at("nhead").get<int64_t>();
    mc.num_layers = m.at("num_layers").get<int64_t>();
    mc.dim_feedforward = m.at("dim_feedforward").get<int64_t>();
    mc.dropout = m.at("dropout").get<double>();
    mc.activation = parse_activation(m, path);
    mc.norm_first = m.at("norm_first").get<bool>();
    mc.dtype = parse_dtype(m, path);
    // Checkpoints from before position kinds existed are sinusoidal.
    const std::string position = m.value("position", "sinusoidal");
    try {
      mc.position = nn::parse_position(position);
    } catch (const ValueError&) {
      bad(path, "position must be sinusoidal, learned, relative, rope or alibi; got " + position);
    }
    mc.max_len = m.value("max_len", mc.max_len);
    mc.num_buckets = m.value("num_buckets", mc.num_buckets);
    mc.max_distance = m.value("max_distance", mc.max_distance);
    mc.rope_base = m.value("rope_base", mc.rope_base);
    // Checkpoints from before mixed precision are float32.
    const std::string precision = m.value("precision", "float32");
    try {
      mc.precision = nn::parse_precision(precision);
    } catch (const ValueError&) {
      bad(path, "precision must be float32 or bf16-mixed; got " + precision);
    }
    if (mc.precision == nn::Precision::bf16_mixed && mc.dtype != DType::float32)
      bad(path, "precision bf16-mixed needs dtype float32; got " + to_string(mc.dtype));
    mc.checkpoint_activations = m.value("checkpoint_activations", mc.checkpoint_activations);
    if (m.contains("attention")) mc.attention = parse_attention(m.at("attention"), path);
    // Checkpoints from before pruning have nhead heads in every layer.
    mc.heads = m.value("heads", mc.heads);
    info.encoder_heads = m.value("encoder_heads", info.encoder_heads);
    info.cross_heads = m.value("cross_heads", info.cross_heads);
    const auto& t = c.at("task");
    info.task.task = parse_task(t.at("task").get<std::string>());
    info.task.min_length = t.at("min_length").get<int64_t>();
    info.task.max_length = t.at("max_length").get<int64_t>();
    info.task.digits = t.at("digits").get<int64_t>();
    info.task.reversed_sum = t.value("reversed_sum", false);  // checkpoints from before the option: plain
    info.task.heldout = t.at("heldout").get<int64_t>();
    info.task.max_args = t.value("max_args", info.task.max_args);
    info.task.max_depth = t.value("max_depth", info.task.max_depth);
    info.seed = c.at("seed").get<uint64_t>();
    info.steps = c.at("steps").get<int64_t>();
  } catch (const json::exception& e) {
    bad(path, std::string("invalid config: ") + e.what());
  }
  return info;
}

// Every floating-point number of a checkpoint's JSON lies in [0, 2^63): the
// fields read as integers (int64 or uint64) then convert with a defined
// result (a float past their range, such as 1e23, would be undefined
// behaviour, found by fuzz_checkpoint_config), and no field mha writes is
// negative or larger as a float.
void check_numbers(const json& j, const std::string& path) {
  if (j.is_number_float()) {
    const double x = j.get<double>();
    if (!(x >= 0 && x < 9.2233720368547758e18))
      bad(path, "a number outside [0, 2^63) where only counts, sizes, rates and seconds go: " + j.dump());
  }
  if (j.is_structured())
    for (const json& item : j) check_numbers(item, path);
}

json parse_json(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad(path, std::string("invalid JSON: ") + e.what());
  }
  check_numbers(j, path);
  return j;
}

// Copies the tensors named prefix + parameter name into `params`; every
// parameter must be there with its shape and dtype.
size_t fill(const std::vector<nn::NamedParameter>& params, const std::map<std::string, Tensor>& tensors,
            const std::string& prefix, const std::string& path, const LoadOptions& options,
            std::vector<Tensor>* into = nullptr) {
  size_t used = 0;
  for (const nn::NamedParameter& p : params) {
    auto it = tensors.find(prefix + p.name);
    if (it == tensors.end()) bad(path, "missing tensor '" + prefix + p.name + "'");
    if (it->second.shape() != p.value->shape() || it->second.dtype() != p.value->dtype())
      bad(path, "tensor '" + prefix + p.name + "': expected " + to_string(p.value->dtype()) + " " +
                    shape_string(p.value->shape()) + " for this config; got " + to_string(it->second.dtype()) + " " +
                    shape_string(it->second.shape()));
    if (const int64_t at = options.allow_non_finite ? -1 : first_non_finite(it->second); at >= 0)
      bad(path, "tensor '" + prefix + p.name + "' holds " + std::to_string(it->second.contiguous().to_vector()[size_t(at)]) +
                    " at element " + std::to_string(at) + " (of " + std::to_string(it->second.numel()) +
                    "): a diverged run? Allow non-finite weights (--allow-non-finite) to load it for inspection");
    if (into) into->push_back(it->second.clone());
    else p.value->copy_(it->second);
    ++used;
  }
  return used;
}

std::unique_ptr<TaskModel> build(const Checkpoint& info) {
  Generator gen(0);
  return make_task_model(info.architecture, info.model, info.num_encoder_layers, gen, info.encoder_heads, info.cross_heads);
}

std::string metadata(const io::SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata.find(key);
  return it == f.metadata.end() ? std::string() : it->second;
}

std::string new_save_id(int64_t steps) {
  std::random_device rd;
  const uint64_t nonce = (uint64_t(rd()) << 32) ^ rd();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%lld-%016llx", (long long)steps, (unsigned long long)nonce);
  return buf;
}

json read_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) bad(path, "cannot open");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse_json(text, path);
}

// The model's generators' states: {name: [seed, offset]}.
json generators_json(TaskModel& model) {
  json generators = json::object();
  for (const nn::NamedGenerator& g : model.named_generators())
    generators[g.name] = {g.generator->seed(), g.generator->offset()};
  return generators;
}

void restore_generators(TaskModel& model, const json& generators) {
  for (const nn::NamedGenerator& g : model.named_generators()) {
    const json& state = generators.at(g.name);
    g.generator->set_state(state.at(0).get<uint64_t>(), state.at(1).get<uint64_t>());
  }
}

}  // namespace

void save_checkpoint(const std::string& dir, TaskModel& model, const Checkpoint& info,
                     const TrainState* state) {
  if (info.architecture != model.architecture())
    throw ValueError("[mha::train::save_checkpoint] info.architecture: expected the model's, " +
                     to_string(model.architecture()) + "; got " + to_string(info.architecture));
  std::filesystem::create_directories(dir);
  const std::string save_id = new_save_id(info.steps);
  Checkpoint recorded = info;
  record_heads(model, recorded);
  const json config = config_json(recorded, save_id);
  const std::vector<nn::NamedParameter> params = model.named_parameters();
  if (state) {
    if (state->exp_avg.size() != params.size() || state->exp_avg_sq.size() != params.size())
      throw ValueError("[mha::train::save_checkpoint] state: expected AdamW moments for " +
                       std::to_string(params.size()) + " parameters; got " + std::to_string(state->exp_avg.size()));
    io::NamedTensors tensors;
    for (size_t i = 0; i < params.size(); ++i) {
      tensors.push_back({"model." + params[i].name, *params[i].value});
      tensors.push_back({"exp_avg." + params[i].name, state->exp_avg[i]});
      tensors.push_back({"exp_avg_sq." + params[i].name, state->exp_avg_sq[i]});
    }
    const json train = {{"step", state->step},         {"data_seed", state->data_seed},
                        {"data_offset", state->data_offset}, {"tokens", state->tokens},
                        {"train_seconds", state->train_seconds}, {"generators", generators_json(model)}};
    io::save_safetensors(dir + "/train_state.safetensors", tensors,
                         {{"format", "mha-train-state"}, {"save_id", save_id}, {"config", config.dump()},
                          {"train", train.dump()}});
  }
  io::NamedTensors tensors;
  for (const nn::NamedParameter& p : params) tensors.push_back({p.name, *p.value});
  // The generators too: Performer's features in eval are those of the last training draw.
  io::save_safetensors(dir + "/model.safetensors", tensors,
                       {{"format", "mha"}, {"save_id", save_id}, {"generators", generators_json(model).dump()}});
  io::write_file_atomically(dir + "/config.json", config.dump(2) + "\n");
}

LoadedCheckpoint load_training_checkpoint(const std::string& dir, const LoadOptions& options) {
  const std::string path = dir + "/train_state.safetensors";
  const io::SafetensorsFile file = io::load_safetensors(path);
  if (metadata(file, "format") != "mha-train-state") bad(path, "not an mha training state");
  LoadedCheckpoint out;
  out.info = parse_config(parse_json(metadata(file, "config"), path), path);
  out.model = build(out.info);
  const std::vector<nn::NamedParameter> params = out.model->named_parameters();
  TrainState s;
  out.checksummed = file.checksummed == file.tensors.size();
  size_t used = fill(params, file.tensors, "model.", path, options);
  used += fill(params, file.tensors, "exp_avg.", path, options, &s.exp_avg);
  used += fill(params, file.tensors, "exp_avg_sq.", path, options, &s.exp_avg_sq);
  if (used != file.tensors.size()) bad(path, std::to_string(file.tensors.size() - used) + " unexpected tensors");
  const json train = parse_json(metadata(file, "train"), path);
  try {
    s.step = train.at("step").get<int64_t>();
    s.data_seed = train.at("data_seed").get<uint64_t>();
    s.data_offset = train.at("data_offset").get<uint64_t>();
    s.tokens = train.at("tokens").get<double>();
    s.train_seconds = train.at("train_seconds").get<double>();
    restore_generators(*out.model, train.at("generators"));
  } catch (const json::exception& e) {
    bad(path, std::string("invalid training state: ") + e.what());
  }
  out.state = std::make_unique<TrainState>(std::move(s));
  out.model->eval();
  return out;
}

Checkpoint parse_checkpoint_config(const std::string& text, const std::string& path) {
  return parse_config(parse_json(text, path), path);
}

LoadedCheckpoint load_checkpoint(const std::string& dir, const LoadOptions& options) {
  const std::string config_path = dir + "/config.json";
  const json config = read_config(config_path);
  const std::string weights_path = dir + "/model.safetensors";
  io::SafetensorsFile file = io::load_safetensors(weights_path);
  const std::string config_id = config.value("save_id", ""), weights_id = metadata(file, "save_id");
  if (config_id != weights_id) {
    // An interrupted save: config.json is older than model.safetensors. The
    // training state, written first, is whole and from the newer save.
    if (std::filesystem::exists(dir + "/train_state.safetensors")) {
      LoadedCheckpoint out = load_training_checkpoint(dir, options);
      out.state.reset();
      return out;
    }
    bad(weights_path, "save id '" + weights_id + "' differs from config.json's '" + config_id +
                          "' (an interrupted save) and there is no train_state.safetensors to recover from");
  }
  LoadedCheckpoint out;
  out.info = parse_config(config, config_path);
  out.model = build(out.info);
  out.checksummed = file.checksummed == file.tensors.size();
  const size_t used = fill(out.model->named_parameters(), file.tensors, "", weights_path, options);
  if (used != file.tensors.size())
    bad(weights_path, std::to_string(file.tensors.size() - used) + " tensors that this config's model does not have");
  // Checkpoints from before the generators were stored with the weights start them afresh.
  const std::string generators = metadata(file, "generators");
  if (!generators.empty()) {
    try {
      restore_generators(*out.model, parse_json(generators, weights_path));
    } catch (const json::exception& e) {
      bad(weights_path, std::string("invalid generator states: ") + e.what());
    }
  }
  out.model->eval();
  return out;
}

namespace {

json vision_config_json(const VisionCheckpoint& info, const std::string& save_id) {
  const nn::VisionTransformerConfig& m = info.model;
  json model = {{"architecture", "vision"}, {"image_side", m.image_side}, {"patch", m.patch},
                {"classes", m.classes}, {"d_model", m.d_model}, {"nhead", m.nhead},
                {"num_layers", m.num_layers}, {"dim_feedforward", m.dim_feedforward}, {"dropout", m.dropout},
                {"activation", activation_name(m.activation)},
                {"dtype", to_string(m.dtype)}, {"attention", attention_json(m.attention)}};
  if (!m.heads.empty()) model["heads"] = m.heads;
  return {{"format", "mha-checkpoint"}, {"version", 1},   {"save_id", save_id},
          {"model", model},             {"seed", info.seed}, {"steps", info.steps},
          {"heldout_accuracy", info.heldout_accuracy}};
}

VisionCheckpoint parse_vision_config(const json& c, const std::string& path) {
  VisionCheckpoint info;
  try {
    const json& m = model_of(c, path);
    if (m.value("architecture", "decoder") != "vision")
      bad(path, "a token model's checkpoint: load it with load_checkpoint");
    nn::VisionTransformerConfig& v = info.model;
    for (auto [name, field] : {std::pair{"image_side", &v.image_side}, {"patch", &v.patch}, {"classes", &v.classes},
                               {"d_model", &v.d_model}, {"nhead", &v.nhead}, {"num_layers", &v.num_layers},
                               {"dim_feedforward", &v.dim_feedforward}})
      *field = m.at(name).get<int64_t>();
    v.dropout = m.at("dropout").get<double>();
    v.activation = parse_activation(m, path);
    v.dtype = parse_dtype(m, path);
    v.attention = parse_attention(m.at("attention"), path);
    v.heads = m.value("heads", v.heads);
    info.seed = c.at("seed").get<uint64_t>();
    info.steps = c.at("steps").get<int64_t>();
    info.heldout_accuracy = c.value("heldout_accuracy", 0.0);
  } catch (const json::exception& e) {
    bad(path, std::string("invalid config: ") + e.what());
  }
  return info;
}

}  // namespace

void save_vision_checkpoint(const std::string& dir, nn::VisionTransformer& model, const VisionCheckpoint& in) {
  std::filesystem::create_directories(dir);
  const std::string save_id = new_save_id(in.steps);
  VisionCheckpoint info = in;
  info.model.heads = model.config().heads;  // the model's own lists (pruned or not)
  io::NamedTensors tensors;
  for (const nn::NamedParameter& p : model.named_parameters()) tensors.push_back({p.name, *p.value});
  io::save_safetensors(dir + "/model.safetensors", tensors, {{"format", "mha-vit"}, {"save_id", save_id}});
  io::write_file_atomically(dir + "/config.json", vision_config_json(info, save_id).dump(2) + "\n");
}

LoadedVisionCheckpoint load_vision_checkpoint(const std::string& dir, const LoadOptions& options) {
  const std::string config_path = dir + "/config.json", weights_path = dir + "/model.safetensors";
  const json config = read_config(config_path);
  LoadedVisionCheckpoint out;
  out.info = parse_vision_config(config, config_path);
  const io::SafetensorsFile file = io::load_safetensors(weights_path);
  if (metadata(file, "format") != "mha-vit") bad(weights_path, "not a Vision Transformer's weights");
  const std::string config_id = config.value("save_id", ""), weights_id = metadata(file, "save_id");
  if (config_id != weights_id)
    bad(weights_path, "save id '" + weights_id + "' differs from config.json's '" + config_id + "' (an interrupted save)");
  Generator gen(0);
  try {
    out.model = std::make_unique<nn::VisionTransformer>(out.info.model, gen);
  } catch (const ValueError& e) {
    bad(config_path, std::string("invalid model: ") + e.what());
  }
  out.checksummed = file.checksummed == file.tensors.size();
  const size_t used = fill(out.model->named_parameters(), file.tensors, "", weights_path, options);
  if (used != file.tensors.size())
    bad(weights_path, std::to_string(file.tensors.size() - used) + " tensors that this config's model does not have");
  out.model->eval();
  return out;
}

std::string checkpoint_architecture(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const json config = read_config(path);
  try {
    const std::string architecture = model_of(config, path).value("architecture", "decoder");
    if (architecture != "vision") (void)parse_architecture(architecture);
    return architecture;
  } catch (const json::exception& e) {
    bad(path, std::string("invalid config: ") + e.what());
  } catch (const ValueError& e) {
    bad(path, std::string("unknown architecture: ") + e.what());
  }
}

std::vector<int64_t> answer(LoadedCheckpoint& loaded, const std::vector<int64_t>& input, int64_t max_new,
                            const char* fn) {
  const int64_t length = output_length(loaded.info.task, input);
  if (loaded.info.architecture == Architecture::encoder && length < 1)
    throw ValueError(std::string("[") + fn + "] task: expected one whose output length the input fixes (an "
                     "encoder fills that many slots); got plain add");
  return loaded.model->answer({input}, {length}, max_new)[0];
}

std::vector<Example> heldout_examples(const Checkpoint& info, int64_t min_length, int64_t max_length, int64_t limit) {
  TaskConfig task = info.task;
  if (min_length > 0) task.min_length = min_length;
  if (max_length > 0) task.max_length = max_length;
  std::vector<Example> examples = TaskData(task, info.seed).heldout();
  if (limit > 0 && int64_t(examples.size()) > limit) examples.resize(size_t(limit));
  return examples;
}

std::string config_json(const Checkpoint& info) {
  json j = config_json(info, "");
  j.erase("save_id");
  return j.dump();
}

std::string config_json(const VisionCheckpoint& info) {
  json j = vision_config_json(info, "");
  j.erase("save_id");
  return j.dump();
}

}  // namespace mha::train
