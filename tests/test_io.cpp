// safetensors and checkpoints: round trips, and refusal of truncated, corrupt
// or mismatched files.
#include <cstdio>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "mha/io/safetensors.h"
#include "mha/train/checkpoint.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

template <class F>
void expect_format_error(F&& f, const char* fragment) {
  try {
    f();
    ADD_FAILURE() << "no FormatError; expected one mentioning " << fragment;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Safetensors, RoundTripEveryDtype) {
  const std::string dir = temp_dir("mha_io_"), path = dir + "/t.safetensors";
  Tensor a = random_tensor({3, 4}, 1, DType::float32), b = random_tensor({2, 2, 2}, 2, DType::float64),
         c = random_tensor({5}, 3, DType::bfloat16), d = Tensor::from_bools({true, false, true}, {3}),
         e = Tensor::from_values(std::vector<double>{-3, 7, 1e12}, {3}, DType::int64), scalar = Tensor::full({}, 2.5);
  io::save_safetensors(path, {{"a", a.transpose(0, 1)}, {"b", b}, {"c", c}, {"d", d}, {"e", e}, {"s", scalar}},
                       {{"note", "hello"}});
  const io::SafetensorsFile f = io::load_safetensors(path);
  EXPECT_EQ(f.metadata.at("note"), "hello");
  EXPECT_EQ(f.tensors.at("a").to_vector(), a.transpose(0, 1).to_vector());
  EXPECT_EQ(f.tensors.at("a").shape(), (Shape{4, 3}));
  EXPECT_EQ(f.tensors.at("b").to_vector(), b.to_vector());
  EXPECT_EQ(f.tensors.at("c").dtype(), DType::bfloat16);
  EXPECT_EQ(f.tensors.at("c").to_vector(), c.to_vector());
  EXPECT_EQ(f.tensors.at("d").to_vector(), d.to_vector());
  EXPECT_EQ(f.tensors.at("e").to_vector(), e.to_vector());
  EXPECT_EQ(f.tensors.at("s").item({}), 2.5);
  // The layout is the published one: 8-byte length, then JSON.
  const std::string bytes = read_bytes(path);
  EXPECT_EQ(bytes[8], '{');
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, RefusesTruncatedCorruptAndMismatchedFiles) {
  const std::string dir = temp_dir("mha_io_"), path = dir + "/t.safetensors", bad = dir + "/bad.safetensors";
  io::save_safetensors(path, {{"w", random_tensor({16, 16}, 1, DType::float32)}});
  const std::string good = read_bytes(path);
  write_bytes(bad, good.substr(0, good.size() - 10));
  expect_format_error([&] { io::load_safetensors(bad); }, "outside the data");
  write_bytes(bad, good.substr(0, 5));
  expect_format_error([&] { io::load_safetensors(bad); }, "at least 8 bytes");
  std::string huge = good;
  huge[7] = char(0x7f);  // header length beyond the file
  write_bytes(bad, huge);
  expect_format_error([&] { io::load_safetensors(bad); }, "exceeds the file");
  std::string json = good;
  json[9] = '#';
  write_bytes(bad, json);
  expect_format_error([&] { io::load_safetensors(bad); }, "not valid JSON");
  std::string shape = good;
  const size_t at = shape.find("[16,16]");
  ASSERT_NE(at, std::string::npos);
  shape.replace(at, 7, "[16,15]");  // bytes no longer match the shape
  write_bytes(bad, shape);
  expect_format_error([&] { io::load_safetensors(bad); }, "needs");
  std::string dtype = good;
  dtype.replace(dtype.find("\"F32\""), 5, "\"Q32\"");
  write_bytes(bad, dtype);
  expect_format_error([&] { io::load_safetensors(bad); }, "unsupported dtype");
  expect_format_error([&] { io::load_safetensors(dir + "/missing.safetensors"); }, "cannot open");
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, WritesAreAtomic) {
  const std::string dir = temp_dir("mha_io_"), path = dir + "/t.safetensors";
  io::save_safetensors(path, {{"w", Tensor::full({4}, 1.0)}});
  // A failed write (the folder is gone) throws and leaves no file under the name.
  expect_format_error([&] { io::save_safetensors(dir + "/no/such/dir/x.safetensors", {{"w", Tensor::zeros({2})}}); },
                      "cannot create");
  // A stale temporary file from a crash does not disturb the last good file.
  write_bytes(path + ".tmp.12345", "garbage");
  EXPECT_EQ(io::load_safetensors(path).tensors.at("w").to_vector(), (std::vector<double>{1, 1, 1, 1}));
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    EXPECT_TRUE(entry.path().filename().string().find(".tmp.") == std::string::npos ||
                entry.path().filename() == "t.safetensors.tmp.12345");
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, RoundTripAndMismatchRefused) {
  const std::string dir = temp_dir("mha_io_");
  Generator g(3);
  const nn::LanguageModelConfig config{.vocab_size = train::kVocab, .d_model = 8, .nhead = 2, .num_layers = 2,
                                       .dim_feedforward = 16};
  nn::LanguageModel model(config, g);
  model.eval();
  const train::Checkpoint info{.model = config, .task = {.task = train::Task::reverse, .min_length = 3, .max_length = 5},
                               .seed = 9, .steps = 42};
  train::DecoderOnly task_model(model);
  train::save_checkpoint(dir, task_model, info);
  train::LoadedCheckpoint loaded = train::load_checkpoint(dir);
  EXPECT_EQ(loaded.info.steps, 42);
  EXPECT_EQ(loaded.info.task.task, train::Task::reverse);
  EXPECT_EQ(loaded.info.seed, 9u);
  const train::Batch batch{.ids = {11, 1, 2, 3, 12, 3}, .rows = 1, .length = 6};
  EXPECT_EQ(loaded.model->forward(batch).to_vector(), task_model.forward(batch).to_vector());
  // A config that does not match the weights is refused, naming the tensor.
  std::string cfg = read_bytes(dir + "/config.json");
  cfg.replace(cfg.find("\"dim_feedforward\": 16"), 21, "\"dim_feedforward\": 12");
  write_bytes(dir + "/config.json", cfg);
  expect_format_error([&] { train::load_checkpoint(dir); }, "linear1.weight");
  write_bytes(dir + "/config.json", "{\"format\": \"mha-checkpoint\"");
  expect_format_error([&] { train::load_checkpoint(dir); }, "invalid JSON");
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, PositionKindRoundTripsAndOldConfigsAreSinusoidal) {
  const std::string dir = temp_dir();
  const train::Batch batch{.ids = {11, 1, 2, 3, 12, 3}, .rows = 1, .length = 6};
  for (nn::Position position : {nn::Position::learned, nn::Position::relative, nn::Position::rope}) {
    Generator g(4);
    const nn::LanguageModelConfig config{.vocab_size = train::kVocab, .d_model = 8, .nhead = 2, .num_layers = 1,
                                         .dim_feedforward = 16, .position = position, .max_len = 12,
                                         .num_buckets = 8, .max_distance = 20, .rope_base = 500.0};
    train::DecoderOnly model(std::make_unique<nn::LanguageModel>(config, g));
    model.eval();
    train::save_checkpoint(dir, model, {.model = config});
    train::LoadedCheckpoint loaded = train::load_checkpoint(dir);
    const nn::LanguageModelConfig& m = loaded.info.model;
    EXPECT_EQ(m.position, position);
    EXPECT_EQ(std::make_tuple(m.max_len, m.num_buckets, m.max_distance, m.rope_base), std::make_tuple(12, 8, 20, 500.0));
    EXPECT_EQ(loaded.model->forward(batch).to_vector(), model.forward(batch).to_vector()) << nn::to_string(position);
  }
  // A config.json written before position kinds (and architectures) existed has none of the keys.
  std::string cfg = read_bytes(dir + "/config.json");
  for (const char* key : {"architecture", "checkpoint_activations", "position", "max_len", "num_buckets",
                          "max_distance", "rope_base"}) {
    const size_t at = cfg.find(std::string("\"") + key + "\"");
    cfg.erase(at, cfg.find_first_of(",}", at) + 1 - at);
  }
  ASSERT_EQ(cfg.find("position"), std::string::npos) << cfg;
  write_bytes(dir + "/config.json", cfg);
  EXPECT_EQ(train::load_checkpoint(dir).info.model.position, nn::Position::sinusoidal);
  EXPECT_EQ(train::load_checkpoint(dir).info.architecture, train::Architecture::decoder);
  write_bytes(dir + "/config.json", cfg.insert(cfg.find("\"dtype\""), "\"position\": \"absolute\", "));
  expect_format_error([&] { train::load_checkpoint(dir); }, "position must be");
  std::filesystem::remove_all(dir);
}

namespace {

// A safetensors file's header (JSON) and where its data begins.
std::pair<nlohmann::json, size_t> header_of(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  return {nlohmann::json::parse(bytes.substr(8, n)), 8 + size_t(n)};
}

// The file with its header replaced (as another tool would write it).
std::string with_header(const std::string& bytes, nlohmann::json header) {
  const size_t data = header_of(bytes).second;
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(json.size()) >> (8 * i)) & 0xff);
  return out + json + bytes.substr(data);
}

std::string without_checksums(const std::string& bytes) {
  nlohmann::json header = header_of(bytes).first;
  nlohmann::json& meta = header["__metadata__"];
  for (auto it = meta.begin(); it != meta.end();) it = it.key().rfind("crc32:", 0) == 0 ? meta.erase(it) : std::next(it);
  return with_header(bytes, header);
}

// The tensor whose bytes hold data offset `at`.
std::string tensor_at(const nlohmann::json& header, size_t at) {
  for (const auto& [name, entry] : header.items())
    if (name != "__metadata__" && entry["data_offsets"][0].get<size_t>() <= at && at < entry["data_offsets"][1].get<size_t>())
      return name;
  return "";
}

}  // namespace

TEST(Safetensors, ChecksumsAreWrittenAndEveryChangedByteIsRefused) {
  const std::string dir = temp_dir("mha_io_"), path = dir + "/t.safetensors", bad = dir + "/bad.safetensors";
  const Tensor w = random_tensor({3, 5}, 1, DType::float32), b = random_tensor({7}, 2, DType::bfloat16);
  const Tensor m = Tensor::from_bools({true, false, true}, {3});
  io::save_safetensors(path, {{"w", w}, {"b", b}, {"m", m}}, {{"note", "x"}});
  const std::string good = read_bytes(path);
  const auto [header, data] = header_of(good);
  // The recorded value is zlib's CRC-32 of the tensor's bytes, as Python's zlib.crc32 computes it.
  EXPECT_EQ(header["__metadata__"]["crc32:w"], [&] {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", unsigned(io::crc32_of(w.raw_data(), 15 * sizeof(float))));
    return std::string(buf);
  }());
  const io::SafetensorsFile f = io::load_safetensors(path);
  EXPECT_EQ(f.checksummed, 3u);
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"note", "x"}}));  // checksums are not user metadata
  // Every byte of the data, changed in turn, is refused with the tensor named.
  for (size_t at = data; at < good.size(); ++at) {
    std::string flipped = good;
    flipped[at] = char(flipped[at] ^ 0x10);
    write_bytes(bad, flipped);
    const std::string name = tensor_at(header, at - data);
    if (name == "m") {  // a bool byte of 16 is refused before its sum is compared
      expect_format_error([&] { io::load_safetensors(bad); }, "tensor 'm'");
      continue;
    }
    expect_format_error([&] { io::load_safetensors(bad); }, ("tensor '" + name + "': CRC-32 of its bytes").c_str());
  }
  // A file without checksums (another tool's) loads, and says it verified none.
  write_bytes(bad, without_checksums(good));
  const io::SafetensorsFile plain = io::load_safetensors(bad);
  EXPECT_EQ(plain.checksummed, 0u);
  EXPECT_EQ(plain.tensors.at("w").to_vector(), w.to_vector());
  // Some tensors with a checksum and some without, or a checksum of no tensor: refused.
  nlohmann::json partial = header;
  partial["__metadata__"].erase("crc32:b");
  write_bytes(bad, with_header(good, partial));
  expect_format_error([&] { io::load_safetensors(bad); }, "1 of 3 tensors carry no checksum");
  nlohmann::json stray = header;
  stray["__metadata__"]["crc32:v"] = "00000000";
  write_bytes(bad, with_header(good, stray));
  expect_format_error([&] { io::load_safetensors(bad); }, "'crc32:v' records the checksum of a tensor");
  // The prefix is reserved in the metadata a caller gives.
  try {
    io::save_safetensors(path, {{"w", w}}, {{"crc32:w", "1234"}});
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("metadata"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, ACraftedShapeCannotOverflowTheByteCount) {
  const std::string dir = temp_dir("mha_io_"), path = dir + "/t.safetensors";
  io::save_safetensors(path, {{"w", Tensor::zeros({4})}});
  const std::string good = read_bytes(path);
  nlohmann::json header = header_of(good).first;
  // 2^34 · 2^34 · 4 bytes wraps to 0 in 64 bits; data_offsets [0, 0] would match.
  header["w"]["shape"] = {uint64_t(1) << 34, uint64_t(1) << 34};
  header["w"]["data_offsets"] = {0, 0};
  write_bytes(path, without_checksums(with_header(good, header)));
  expect_format_error([&] { io::load_safetensors(path); }, "implausible size");
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, AChangedByteInAnyTensorOfATrainedModelIsRefusedWithTheTensorNamed) {
  const train::TaskConfig task{.task = train::Task::copy, .min_length = 2, .max_length = 4, .heldout = 10};
  const train::TaskData data(task, 3);
  const nn::LanguageModelConfig config{.vocab_size = train::kVocab, .d_model = 8, .nhead = 2, .num_layers = 2,
                                       .dim_feedforward = 16};
  Generator g(3);
  train::DecoderOnly model(std::make_unique<nn::LanguageModel>(config, g));
  train::TrainState state;
  train::train(model, data, {.steps = 5, .batch_size = 4, .warmup = 1, .eval_every = 0}, {}, &state);
  const std::string dir = temp_dir("mha_io_");
  train::save_checkpoint(dir, model, {.model = config, .task = task, .seed = 3, .steps = 5}, &state);
  std::mt19937_64 rng(1);
  for (const char* file : {"/model.safetensors", "/train_state.safetensors"}) {
    const std::string path = dir + file, good = read_bytes(path);
    const auto [header, data_begin] = header_of(good);
    int tensors = 0;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") continue;
      const size_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
      std::string flipped = good;
      const size_t at = data_begin + begin + size_t(rng() % (end - begin));
      flipped[at] = char(flipped[at] ^ char(1 + rng() % 255));
      write_bytes(path, flipped);
      expect_format_error([&] { std::string(file) == "/model.safetensors" ? train::load_checkpoint(dir)
                                                                            : train::load_training_checkpoint(dir); },
                          ("tensor '" + name + "': CRC-32").c_str());
      ++tensors;
    }
    EXPECT_EQ(tensors, std::string(file) == "/model.safetensors" ? int(model.named_parameters().size())
                                                                   : 3 * int(model.named_parameters().size()));
    write_bytes(path, good);
  }
  EXPECT_TRUE(train::load_checkpoint(dir).checksummed);
  // Another tool's file without checksums loads and says so.
  write_bytes(dir + "/model.safetensors", without_checksums(read_bytes(dir + "/model.safetensors")));
  EXPECT_FALSE(train::load_checkpoint(dir).checksummed);
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, NonFiniteWeightsAreRefusedUnlessAllowed) {
  const std::string dir = temp_dir("mha_io_");
  const nn::LanguageModelConfig config{.vocab_size = train::kVocab, .d_model = 8, .nhead = 2, .num_layers = 1,
                                       .dim_feedforward = 16};
  Generator g(3);
  train::DecoderOnly model(std::make_unique<nn::LanguageModel>(config, g));
  const std::vector<nn::NamedParameter> params = model.named_parameters();
  for (double bad : {std::nan(""), double(INFINITY), -double(INFINITY)}) {
    params.back().value->set_item({1}, bad);
    train::TrainState state;
    for (const auto& p : params) {
      state.exp_avg.push_back(Tensor::zeros(p.value->shape()));
      state.exp_avg_sq.push_back(Tensor::zeros(p.value->shape()));
    }
    train::save_checkpoint(dir, model, {.model = config, .task = {.task = train::Task::copy}, .steps = 1}, &state);
    expect_format_error([&] { train::load_checkpoint(dir); },
                        ("tensor '" + params.back().name + "' holds").c_str());
    expect_format_error([&] { train::load_training_checkpoint(dir); },
                        ("tensor 'model." + params.back().name + "' holds").c_str());
    const train::LoadedCheckpoint loaded = train::load_checkpoint(dir, {.allow_non_finite = true});
    const double got = loaded.model->named_parameters().back().value->item({1});
    EXPECT_TRUE(std::isnan(bad) ? std::isnan(got) : got == bad);
    params.back().value->set_item({1}, 0.0);
  }
  // A NaN in the optimizer's moments is refused too.
  train::TrainState state;
  for (const auto& p : params) {
    state.exp_avg.push_back(Tensor::zeros(p.value->shape()));
    state.exp_avg_sq.push_back(Tensor::zeros(p.value->shape()));
  }
  state.exp_avg_sq[0].set_item({0, 0}, std::nan(""));
  train::save_checkpoint(dir, model, {.model = config, .task = {.task = train::Task::copy}, .steps = 1}, &state);
  expect_format_error([&] { train::load_training_checkpoint(dir); },
                      ("tensor 'exp_avg_sq." + params[0].name + "' holds nan at element 0").c_str());
  std::filesystem::remove_all(dir);
}

namespace mha {
namespace {

// A float where an integer goes, past int64's range (1e23, as the fuzzer
// wrote), or negative where a seed goes, is refused before any conversion.
TEST(Checkpoint, NumbersOutsideWhatIntegersHoldAreRefused) {
  const std::string config = R"({"format": "mha-checkpoint", "version": 1, "seed": 0, "steps": 3,
    "model": {"activation": "gelu", "architecture": "decoder", "d_model": 16, "dim_feedforward": 32, "dropout": 0.0,
              "dtype": "float32", "nhead": 2, "norm_first": true, "num_layers": 1, "vocab_size": 21,
              "attention": {"kind": "full", "redraw_every": REDRAW}},
    "task": {"task": "copy", "digits": 3, "heldout": 8, "max_length": 3, "min_length": 2}})";
  const auto with = [&](const std::string& redraw) {
    return std::regex_replace(config, std::regex("REDRAW"), redraw);
  };
  EXPECT_EQ(train::parse_checkpoint_config(with("100"), "config.json").model.attention.redraw_every, 100);
  for (const char* bad : {"1.0033333333333333e23", "-1.5", "1e300"})
    testing::expect_error<FormatError>([&] { train::parse_checkpoint_config(with(bad), "config.json"); },
                                       {"config.json", "outside [0, 2^63)"});
}

}  // namespace
}  // namespace mha
