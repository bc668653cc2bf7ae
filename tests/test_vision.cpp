// The Vision Transformer and the digits: gradients, data loading, training.
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "mha/train/checkpoint.h"
#include "mha/train/vision.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

// Full attention with a class token, and axial attention over the 3 × 3
// patch grid with the patches' mean as the head's input.
TEST(VisionTransformer, GradientsOfEveryParameter) {
  for (AttentionKind kind : {AttentionKind::full, AttentionKind::axial}) {
    SCOPED_TRACE(to_string(kind));
    Generator g(1);
    VisionTransformer vit({.image_side = 6, .patch = 2, .classes = 3, .d_model = 8, .nhead = 2, .num_layers = 2,
                           .dim_feedforward = 12, .dtype = DType::float64, .attention = {.kind = kind}},
                          g);
    EXPECT_EQ(vit.pooled(), kind == AttentionKind::axial);
    const Tensor images = random_tensor({3, 36}, 2);
    const Tensor r = random_tensor({3, 3}, 3);
    vit.zero_grad();
    EXPECT_EQ(vit.forward(images).shape(), (Shape{3, 3}));
    vit.backward(r);
    auto loss = [&] { return weighted_sum(vit.forward(images), r); };
    double worst = 0;
    size_t count = 0;
    for (NamedParameter& p : vit.named_parameters()) {
      const double e = gradient_error(*p.value, *p.grad, loss);
      EXPECT_LT(e, 1e-6) << p.name;
      EXPECT_GT(max_abs(*p.grad), 0.0) << p.name;
      worst = std::max(worst, e);
      ++count;
    }
    EXPECT_EQ(count, kind == AttentionKind::axial ? 32u : 34u);  // no cls_token, pos_cls when pooled
    std::printf("  vision transformer, %s attention: worst relative gradient error %.1e\n", to_string(kind).c_str(),
                worst);
    EXPECT_THROW(vit.forward(random_tensor({2, 15}, 4)), ShapeError);
  }
  Generator g(1);
  EXPECT_THROW(VisionTransformer({.image_side = 8, .patch = 3}, g), ValueError);
}

TEST(Digits, LoadSplitAndAugment) {
  const std::string path = train::default_digits_path();
  ASSERT_FALSE(path.empty()) << "python3-sklearn's digits.csv.gz was not found when the build was configured";
  const train::DigitImages all = train::load_digits(path);
  EXPECT_EQ(all.size(), 1797);
  EXPECT_EQ(all.pixels.shape(), (Shape{1797, 64}));
  std::set<int64_t> labels(all.labels.begin(), all.labels.end());
  EXPECT_EQ(labels.size(), 10u);
  const train::DigitSplit split = train::split_digits(all, 360, 7);
  EXPECT_EQ(split.heldout.size(), 360);
  EXPECT_EQ(split.train.size(), 1797 - 360);
  // No image is in both parts: compare the pixel rows (duplicates in the data set aside).
  std::multiset<std::vector<double>> train_rows, all_rows;
  for (int64_t i = 0; i < split.train.size(); ++i) train_rows.insert(split.train.pixels.select(0, i).to_vector());
  for (int64_t i = 0; i < all.size(); ++i) all_rows.insert(all.pixels.select(0, i).to_vector());
  int64_t shared = 0;
  for (int64_t i = 0; i < split.heldout.size(); ++i) {
    const auto row = split.heldout.pixels.select(0, i).to_vector();
    shared += int64_t(train_rows.count(row) == all_rows.count(row));  // every copy of it went to training
  }
  EXPECT_EQ(shared, 0);
  // A shift moves the image by whole pixels and brings zeros in.
  Generator gen(3);
  const Tensor plain = train::digit_batch(all, {5});
  const Tensor shifted = train::digit_batch(all, {5}, &gen, 1);
  double sum_plain = 0, sum_shifted = 0;
  for (double v : plain.to_vector()) sum_plain += v;
  for (double v : shifted.to_vector()) sum_shifted += v;
  EXPECT_LE(sum_shifted, sum_plain + 1e-6);
}

TEST(Digits, CorruptFilesAreRefused) {
  const std::string dir = temp_dir("mha_digits_");
  const auto write_gz = [&](const std::string& name, const std::string& text) {
    gzFile f = gzopen((dir + "/" + name).c_str(), "wb");
    gzwrite(f, text.data(), unsigned(text.size()));
    gzclose(f);
    return dir + "/" + name;
  };
  std::string row;
  for (int i = 0; i < 64; ++i) row += "3,";
  EXPECT_EQ(train::load_digits(write_gz("ok.csv.gz", row + "7\n" + row + "2\n")).size(), 2);
  EXPECT_THROW(train::load_digits(write_gz("short.csv.gz", "1,2,3\n")), FormatError);
  EXPECT_THROW(train::load_digits(write_gz("label.csv.gz", row + "12\n")), FormatError);
  EXPECT_THROW(train::load_digits(write_gz("pixel.csv.gz", "99," + row.substr(2) + "1\n")), FormatError);
  EXPECT_THROW(train::load_digits(write_gz("text.csv.gz", row + "x\n")), FormatError);
  EXPECT_THROW(train::load_digits(dir + "/missing.csv.gz"), FormatError);
  // A line that ends in a tab: strtol would skip it and the newline and read the next line's first value.
  std::string row63;
  for (int i = 0; i < 63; ++i) row63 += "3,";
  // (Before the fix the first line took the second's 5 as its label, and both lines loaded.)
  EXPECT_THROW(train::parse_digits(row63 + "7,\t\n5," + row63 + "1\n", "tab"), FormatError);
  // A gzip stream cut in the middle.
  const std::string whole = read_bytes(write_gz("whole.csv.gz", row + "7\n" + row + "2\n"));
  std::FILE* f = std::fopen((dir + "/cut.csv.gz").c_str(), "wb");
  std::fwrite(whole.data(), 1, whole.size() / 2, f);
  std::fclose(f);
  EXPECT_THROW(train::load_digits(dir + "/cut.csv.gz"), FormatError);
  std::filesystem::remove_all(dir);
}

TEST(Digits, AShortTrainingRunLearns) {
  const train::DigitSplit data = train::split_digits(train::load_digits(train::default_digits_path()), 360, 1);
  Generator g(1);
  VisionTransformer vit({.patch = 4, .d_model = 32, .nhead = 2, .num_layers = 1, .dim_feedforward = 64}, g);
  const double before = train::classification_accuracy(vit, data.heldout);
  const train::TrainResult r = train::train_digits(
      vit, data, {.steps = 150, .batch_size = 32, .lr = 3e-3, .min_lr = 1e-4, .warmup = 10, .eval_every = 0});
  std::printf("  digits: held-out accuracy %.2f before, %.2f after %lld steps\n", before, r.heldout_exact_match,
              (long long)r.steps);
  EXPECT_LT(before, 0.3);
  EXPECT_GT(r.heldout_exact_match, 0.6);
}

// The digits loop checks its config as train() does, and an empty training
// set is refused (its batches draw indices modulo the set's size).
TEST(Digits, ABadConfigOrNoImagesAreRefused) {
  Generator g(1);
  VisionTransformer vit({.patch = 4, .d_model = 8, .nhead = 2, .num_layers = 1, .dim_feedforward = 16}, g);
  train::DigitSplit data = train::split_digits(train::load_digits(train::default_digits_path()), 360, 1);
  expect_error<ValueError>([&] { train::train_digits(vit, data, {.steps = 2, .warmup = -1}); },
                           {"[mha::train::train_digits]", "config.warmup: expected >= 0", "got -1"});
  data.train = {};
  expect_error<ValueError>([&] { train::train_digits(vit, data, {.steps = 2, .batch_size = 4}); },
                           {"[mha::train::train_digits]", "data.train: expected at least one image", "got none"});
}

// The axial ViT (2 × 2 patches: a 4 × 4 grid, rows then columns) learns too.
TEST(Digits, AShortAxialTrainingRunLearns) {
  const train::DigitSplit data = train::split_digits(train::load_digits(train::default_digits_path()), 360, 1);
  Generator g(1);
  VisionTransformer vit({.patch = 2, .d_model = 32, .nhead = 2, .num_layers = 1, .dim_feedforward = 64,
                         .attention = {.kind = AttentionKind::axial}},
                        g);
  const train::TrainResult r = train::train_digits(
      vit, data, {.steps = 300, .batch_size = 32, .lr = 3e-3, .min_lr = 1e-4, .warmup = 10, .eval_every = 0});
  std::printf("  digits, axial: held-out accuracy %.2f after %lld steps\n", r.heldout_exact_match, (long long)r.steps);
  EXPECT_GT(r.heldout_exact_match, 0.35);  // chance: 0.1
}

// A ViT's checkpoint: the same logits after a reload, every config field
// back, and the token models' loader sends the caller to the right one.
TEST(VisionCheckpoint, RoundTripsAndRefusesWhatIsNotWhole) {
  Generator g(4);
  const VisionTransformerConfig config{.image_side = 6, .patch = 3, .classes = 4, .d_model = 8, .nhead = 2,
                                       .num_layers = 2, .dim_feedforward = 12, .activation = Activation::relu,
                                       .attention = {.kind = AttentionKind::window, .window = 2}};
  VisionTransformer vit(config, g);
  vit.eval();
  const Tensor images = random_tensor({3, 36}, 5, DType::float32);
  const Tensor logits = vit.forward(images);
  const std::string dir = temp_dir("mha_vit_");
  train::save_vision_checkpoint(dir, vit, {.model = config, .seed = 9, .steps = 12, .heldout_accuracy = 0.75});
  EXPECT_EQ(train::checkpoint_architecture(dir), "vision");
  train::LoadedVisionCheckpoint loaded = train::load_vision_checkpoint(dir);
  EXPECT_EQ(loaded.info.seed, 9u);
  EXPECT_EQ(loaded.info.steps, 12);
  EXPECT_EQ(loaded.info.heldout_accuracy, 0.75);
  EXPECT_EQ(loaded.info.model.patch, 3);
  EXPECT_EQ(loaded.info.model.classes, 4);
  EXPECT_EQ(loaded.info.model.activation, Activation::relu);
  EXPECT_EQ(loaded.info.model.attention.kind, AttentionKind::window);
  EXPECT_EQ(loaded.info.model.attention.window, 2);
  EXPECT_TRUE(loaded.checksummed);
  EXPECT_EQ(max_abs_diff(loaded.model->forward(images), logits), 0.0);
  expect_error<FormatError>([&] { train::load_checkpoint(dir); }, {"config.json", "load_vision_checkpoint"});

  // Another save's config beside these weights: refused.
  const std::string config_text = [&] {
    std::ifstream f(dir + "/config.json");
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }();
  train::save_vision_checkpoint(dir, vit, {.model = config, .steps = 13});
  { std::ofstream(dir + "/config.json") << config_text; }
  expect_error<FormatError>([&] { train::load_vision_checkpoint(dir); }, {"model.safetensors", "interrupted save"});
  // One changed byte in the weights: refused by its checksum.
  train::save_vision_checkpoint(dir, vit, {.model = config});
  {
    std::fstream f(dir + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-5, std::ios::end);
    c = char(c ^ 0x10);
    f.write(&c, 1);
  }
  expect_error<FormatError>([&] { train::load_vision_checkpoint(dir); }, {"model.safetensors"});
  // No checkpoint at all.
  std::filesystem::remove_all(dir);
  expect_error<FormatError>([&] { train::checkpoint_architecture(dir); }, {"config.json", "cannot open"});
}
