// safetensors and checkpoints: round trips, and refusal of truncated, corrupt
// or mismatched files.
#include <cstdio>
#include <filesystem>
#include <fstream>

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
