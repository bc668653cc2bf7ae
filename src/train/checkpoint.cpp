// Checkpoints: safetensors weights plus a JSON config.
#include "mha/train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "mha/errors.h"
#include "mha/io/safetensors.h"

namespace mha::train {

namespace {

constexpr const char* kLoad = "mha::train::load_checkpoint";

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw FormatError(std::string("[") + kLoad + "] " + path + ": " + what);
}

}  // namespace

void save_checkpoint(const std::string& dir, nn::LanguageModel& model, const Checkpoint& info) {
  std::filesystem::create_directories(dir);
  io::NamedTensors tensors;
  for (const nn::NamedParameter& p : model.named_parameters()) tensors.push_back({p.name, *p.value});
  io::save_safetensors(dir + "/model.safetensors", tensors, {{"format", "mha"}});
  const nn::LanguageModelConfig& m = info.model;
  const nlohmann::json config = {
      {"format", "mha-checkpoint"},
      {"version", 1},
      {"model",
       {{"vocab_size", m.vocab_size}, {"d_model", m.d_model}, {"nhead", m.nhead}, {"num_layers", m.num_layers},
        {"dim_feedforward", m.dim_feedforward}, {"dropout", m.dropout},
        {"activation", m.activation == nn::Activation::relu ? "relu" : "gelu"}, {"norm_first", m.norm_first},
        {"dtype", to_string(m.dtype)}, {"position", nn::to_string(m.position)}, {"max_len", m.max_len},
        {"num_buckets", m.num_buckets}, {"max_distance", m.max_distance}, {"rope_base", m.rope_base}}},
      {"task",
       {{"task", to_string(info.task.task)}, {"min_length", info.task.min_length}, {"max_length", info.task.max_length},
        {"digits", info.task.digits}, {"heldout", info.task.heldout}}},
      {"seed", info.seed},
      {"steps", info.steps}};
  io::write_file_atomically(dir + "/config.json", config.dump(2) + "\n");
}

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  std::ifstream f(config_path);
  if (!f) bad(config_path, "cannot open");
  LoadedCheckpoint out;
  try {
    const nlohmann::json c = nlohmann::json::parse(f);
    if (c.at("format") != "mha-checkpoint" || c.at("version") != 1) bad(config_path, "not an mha checkpoint (version 1)");
    const auto& m = c.at("model");
    nn::LanguageModelConfig& mc = out.info.model;
    mc.vocab_size = m.at("vocab_size").get<int64_t>();
    mc.d_model = m.at("d_model").get<int64_t>();
    mc.nhead = m.at("nhead").get<int64_t>();
    mc.num_layers = m.at("num_layers").get<int64_t>();
    mc.dim_feedforward = m.at("dim_feedforward").get<int64_t>();
    mc.dropout = m.at("dropout").get<double>();
    const std::string act = m.at("activation").get<std::string>();
    if (act != "relu" && act != "gelu") bad(config_path, "activation must be relu or gelu; got " + act);
    mc.activation = act == "relu" ? nn::Activation::relu : nn::Activation::gelu;
    mc.norm_first = m.at("norm_first").get<bool>();
    const std::string dtype = m.at("dtype").get<std::string>();
    if (dtype != "float32" && dtype != "float64") bad(config_path, "dtype must be float32 or float64; got " + dtype);
    mc.dtype = dtype == "float64" ? DType::float64 : DType::float32;
    // Checkpoints from before position kinds existed are sinusoidal.
    const std::string position = m.value("position", "sinusoidal");
    try {
      mc.position = nn::parse_position(position);
    } catch (const ValueError&) {
      bad(config_path, "position must be sinusoidal, learned, relative, rope or alibi; got " + position);
    }
    mc.max_len = m.value("max_len", mc.max_len);
    mc.num_buckets = m.value("num_buckets", mc.num_buckets);
    mc.max_distance = m.value("max_distance", mc.max_distance);
    mc.rope_base = m.value("rope_base", mc.rope_base);
    const auto& t = c.at("task");
    out.info.task.task = parse_task(t.at("task").get<std::string>());
    out.info.task.min_length = t.at("min_length").get<int64_t>();
    out.info.task.max_length = t.at("max_length").get<int64_t>();
    out.info.task.digits = t.at("digits").get<int64_t>();
    out.info.task.heldout = t.at("heldout").get<int64_t>();
    out.info.seed = c.at("seed").get<uint64_t>();
    out.info.steps = c.at("steps").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    bad(config_path, std::string("invalid config: ") + e.what());
  }
  Generator gen(0);
  out.model = std::make_unique<nn::LanguageModel>(out.info.model, gen);
  const std::string weights_path = dir + "/model.safetensors";
  io::SafetensorsFile file = io::load_safetensors(weights_path);
  size_t used = 0;
  for (const nn::NamedParameter& p : out.model->named_parameters()) {
    auto it = file.tensors.find(p.name);
    if (it == file.tensors.end()) bad(weights_path, "missing tensor '" + p.name + "'");
    if (it->second.shape() != p.value->shape() || it->second.dtype() != p.value->dtype())
      bad(weights_path, "tensor '" + p.name + "': expected " + to_string(p.value->dtype()) + " " +
                            shape_string(p.value->shape()) + " for this config; got " + to_string(it->second.dtype()) +
                            " " + shape_string(it->second.shape()));
    p.value->copy_(it->second);
    ++used;
  }
  if (used != file.tensors.size())
    bad(weights_path, std::to_string(file.tensors.size() - used) + " tensors that this config's model does not have");
  out.model->eval();
  return out;
}

}  // namespace mha::train
