// The encoder–decoder: cross-attention against projected memory, parameter
// names, finite-difference gradients of every parameter for every position
// kind, cached decoding against the full forward, training on copy, and
// checkpoints with exact resume.
#include <filesystem>

#include "mha/io/safetensors.h"
#include "mha/train/checkpoint.h"
#include "mha/train/trainer.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

constexpr Position kPositions[] = {Position::sinusoidal, Position::learned, Position::relative, Position::rope,
                                   Position::alibi};

LanguageModelConfig small_decoder(Position position, DType dtype, int64_t vocab = 7) {
  return {.vocab_size = vocab, .d_model = 4, .nhead = 2, .num_layers = 2, .dim_feedforward = 6, .dtype = dtype,
          .position = position, .max_len = 16, .num_buckets = 8, .max_distance = 10};
}

EncoderDecoderModel small_model(const LanguageModelConfig& decoder, uint64_t seed = 5) {
  Generator g(seed);
  return EncoderDecoderModel({.decoder = decoder, .num_encoder_layers = 1}, g);
}

// f raises E with exactly this message.
template <class E, class F>
void expect_message(F&& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected " << message;
  } catch (const E& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

Tensor ids_of(const std::vector<int64_t>& ids, int64_t rows) {
  return train::token_tensor(ids, rows, int64_t(ids.size()) / rows);
}

// Two sources of length 5, the second padded after 3 tokens.
const std::vector<int64_t> kSource{1, 2, 3, 4, 5, 6, 0, 1, 0, 0};
Tensor source_padding() {
  return Tensor::from_bools({false, false, false, false, false, false, false, false, true, true}, {2, 5});
}

}  // namespace

TEST(MultiheadAttention, MemoryAttentionEqualsTheFullForward) {
  // Packed projections, and separate ones for kdim, vdim ≠ embed_dim.
  for (int64_t kdim : {8, 5}) {
    SCOPED_TRACE("kdim " + std::to_string(kdim));
    Generator g(3);
    MultiheadAttention attention({.embed_dim = 8, .num_heads = 2, .kdim = kdim, .vdim = kdim == 8 ? 8 : 3,
                                  .batch_first = true, .dtype = DType::float64},
                                 g);
    const Tensor query = random_tensor({2, 5, 8}, 1), key = random_tensor({2, 6, kdim}, 2),
                 value = random_tensor({2, 6, attention.config().vdim}, 3);
    const Tensor kpm = Tensor::from_bools({false, false, false, false, false, false,  //
                                           false, false, false, false, true, true},
                                          {2, 6});
    const Tensor full = attention.forward(query, key, value, {.key_padding_mask = kpm}).output;
    const KVCache memory = attention.project_memory(key, value);
    EXPECT_EQ(memory.length, 6);
    for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 3}, {3, 5}}) {
      const Tensor out = attention.forward_memory(query.slice(1, begin, end), memory, {.key_padding_mask = kpm});
      EXPECT_LE(max_abs_diff(out, full.slice(1, begin, end)), 1e-13) << "rows " << begin << "-" << end;
    }
    expect_message<ValueError>([&] { attention.forward_memory(query, memory, {.is_causal = true}); },
                               "[mha::nn::MultiheadAttention::forward_memory] inputs: expected no is_causal or "
                               "attn_bias (masks only); got one of them");
    EXPECT_THROW(attention.forward_memory(query.slice(0, 0, 1), memory), ShapeError);  // another batch
  }
  Generator g(1);
  MultiheadAttention rope({.embed_dim = 4, .num_heads = 2, .rotary_base = 100.0}, g);
  EXPECT_THROW(rope.project_memory(Tensor::zeros({3, 4}), Tensor::zeros({3, 4})), ValueError);
}

TEST(EncoderDecoderModel, ParameterNamesAsTorch) {
  EncoderDecoderModel model = small_model(small_decoder(Position::relative, DType::float32));
  std::vector<std::string> names;
  for (const NamedParameter& p : model.named_parameters()) names.push_back(p.name);
  const std::vector<std::string> some{"embedding.weight",
                                      "encoder.layers.0.self_attn.in_proj_weight",
                                      "encoder.relative_attention_bias.weight",
                                      "encoder.norm.weight",
                                      "decoder.layers.0.self_attn.in_proj_weight",
                                      "decoder.layers.1.multihead_attn.out_proj.bias",
                                      "decoder.layers.1.norm3.bias",
                                      "decoder.relative_attention_bias.weight",
                                      "decoder.norm.bias",
                                      "head.bias"};
  size_t at = 0;
  for (const std::string& name : some) {
    const auto found = std::find(names.begin(), names.end(), name);
    ASSERT_NE(found, names.end()) << name;
    EXPECT_GE(size_t(found - names.begin()), at) << name << " out of order";
    at = size_t(found - names.begin());
  }
  // embedding; encoder: 1 layer, its table, norm; decoder: 2 layers, table, norm; head.
  EXPECT_EQ(names.size(), size_t(1 + (12 + 1 + 2) + (2 * 18 + 1 + 2) + 2));
  std::vector<std::string> generators;
  for (const NamedGenerator& gen : model.named_generators()) generators.push_back(gen.name);
  EXPECT_EQ(generators.front(), "encoder.layers.0.self_attn.dropout_generator");
  EXPECT_EQ(generators.back(), "decoder.layers.1.dropout3.generator");
}

class EncoderDecoderPositions : public ::testing::TestWithParam<Position> {};

TEST_P(EncoderDecoderPositions, GradientsOfEveryParameter) {
  const Tensor src = ids_of(kSource, 2), tgt = ids_of({1, 2, 3, 4, 5, 6, 0, 1}, 2);
  const Tensor targets = Tensor::from_values(std::vector<double>{2, 3, -100, 5, 6, 0, 1, 2}, {2, 4}, DType::int64);
  EncoderDecoderModel model = small_model(small_decoder(GetParam(), DType::float64));
  model.zero_grad();
  model.backward(cross_entropy(model.forward(src, tgt, source_padding()), targets).dlogits);
  auto loss = [&] { return cross_entropy(model.forward(src, tgt, source_padding()), targets).loss; };
  double worst = 0;
  for (NamedParameter& p : model.named_parameters()) {
    const double e = gradient_error(*p.value, *p.grad, loss);
    EXPECT_LT(e, 1e-6) << p.name;
    worst = std::max(worst, e);
  }
  std::printf("  encoder-decoder, %s positions: worst relative gradient error %.1e\n", to_string(GetParam()).c_str(),
              worst);
}

INSTANTIATE_TEST_SUITE_P(Kinds, EncoderDecoderPositions, ::testing::ValuesIn(kPositions),
                         [](const ::testing::TestParamInfo<Position>& kind) { return to_string(kind.param); });

TEST(EncoderDecoderModel, GradientsPostLNWithDropout) {
  LanguageModelConfig c = small_decoder(Position::sinusoidal, DType::float64);
  c.norm_first = false, c.dropout = 0.2, c.activation = Activation::relu;
  EncoderDecoderModel model = small_model(c);
  const Tensor src = ids_of(kSource, 2), tgt = ids_of({1, 2, 3, 4, 5, 6, 0, 1}, 2);
  const Tensor targets = Tensor::from_values(std::vector<double>{2, 3, 4, 5, 6, 0, 1, 2}, {2, 4}, DType::int64);
  // Every forward from the same generator states draws the same dropout.
  const std::vector<Generator> states = generator_states(model);
  auto logits = [&] {
    set_generator_states(model, states);
    return model.forward(src, tgt, source_padding());
  };
  model.zero_grad();
  model.backward(cross_entropy(logits(), targets).dlogits);
  auto loss = [&] { return cross_entropy(logits(), targets).loss; };
  for (NamedParameter& p : model.named_parameters()) EXPECT_LT(gradient_error(*p.value, *p.grad, loss), 1e-6) << p.name;
}

TEST(EncoderDecoderModel, DecodingWithTheCacheEqualsTheFullForward) {
  const Tensor src = ids_of(kSource, 2), tgt = ids_of({1, 2, 3, 4, 5, 6, 0, 0, 6, 5, 4, 3, 2, 1}, 2);  // (2, 7)
  for (Position position : kPositions) {
    SCOPED_TRACE(to_string(position));
    EncoderDecoderModel model = small_model(small_decoder(position, DType::float64));
    model.eval();
    const Tensor full = model.forward(src, tgt, source_padding());
    model.begin_decode(src, source_padding());
    for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 4}, {4, 5}, {5, 7}}) {
      const Tensor step = model.decode_step(tgt.slice(1, begin, end).contiguous());
      EXPECT_LE(max_abs_diff(step, full.slice(1, begin, end)), 1e-12) << "tokens " << begin << "-" << end;
    }
    EXPECT_EQ(model.decoded_length(), 7);
    EXPECT_THROW(model.decode_step(ids_of({1}, 1)), ShapeError);  // another batch size mid-sequence
  }
  EncoderDecoderModel model = small_model(small_decoder(Position::sinusoidal, DType::float32));
  expect_message<StateError>([&] { model.decode_step(ids_of({1}, 1)); },
                             "[mha::nn::EncoderDecoderModel::decode_step] state: expected begin_decode(src_ids) "
                             "first; got none");
}

TEST(EncoderDecoderModel, GenerateWithTheCacheEqualsGreedyDecodingWithout) {
  const std::vector<std::vector<int64_t>> inputs{{3, 1, 4}, {2, 7}, {5, 5, 5}, {9}};
  for (Position position : {Position::sinusoidal, Position::relative}) {
    SCOPED_TRACE(to_string(position));
    EncoderDecoderModel model = small_model(small_decoder(position, DType::float64, train::kVocab));
    train::EncoderDecoder task_model(model);
    const auto outputs = train::generate(task_model, inputs, 6);
    model.eval();
    for (size_t i = 0; i < inputs.size(); ++i) {
      // Greedy the slow way: the whole target through forward() per token.
      const Tensor src = ids_of(inputs[i], 1);
      std::vector<int64_t> target{train::kBos}, out;
      for (int step = 0; step < 6; ++step) {
        const std::vector<double> last = model.forward(src, ids_of(target, 1)).select(1, int64_t(target.size()) - 1).to_vector();
        const int64_t next = int64_t(std::max_element(last.begin(), last.end()) - last.begin());
        if (next == train::kEos) break;
        out.push_back(next);
        target.push_back(next);
      }
      EXPECT_EQ(outputs[i], out) << i;
    }
  }
}

TEST(EncoderDecoderModel, SettingsAndInputsAreChecked) {
  Generator g(1);
  const LanguageModelConfig c = small_decoder(Position::sinusoidal, DType::float32);
  expect_message<ValueError>([&] { EncoderDecoderModel({.decoder = c, .num_encoder_layers = 0}, g); },
                             "[mha::nn::EncoderDecoderModel] num_encoder_layers: expected > 0; got 0");
  LanguageModelConfig few_buckets = small_decoder(Position::relative, DType::float32);
  few_buckets.num_buckets = 2, few_buckets.max_distance = 4;  // enough causally, not in both directions
  LanguageModel{few_buckets, g};
  expect_message<ValueError>([&] { EncoderDecoderModel({.decoder = few_buckets}, g); },
                             "[mha::nn::TransformerEncoder] num_buckets: expected >= 4 (relative positions); got 2");
  EncoderDecoderModel model = small_model(c);
  const Tensor src = ids_of(kSource, 2), tgt = ids_of({1, 2, 3, 4}, 2);
  expect_message<DtypeError>([&] { model.forward(src, tgt, Tensor::zeros({2, 5})); },
                             "[mha::nn::EncoderDecoderModel::forward] src_key_padding_mask: expected bool; got float32");
  EXPECT_THROW(model.forward(src, tgt, source_padding().slice(1, 0, 4)), ShapeError);
  EXPECT_THROW(model.forward(src, ids_of({1, 2, 3}, 1)), ShapeError);  // batch sizes differ
}

TEST(Tasks, Seq2SeqBatchesAreSourceAndShiftedTarget) {
  const train::Batch b = train::make_seq2seq_batch({{{3, 1, 4}, {4, 1, 3}}, {{7}, {7}}});
  EXPECT_EQ(b.source, (std::vector<int64_t>{3, 1, 4, 7, train::kPad, train::kPad}));
  EXPECT_EQ(b.source_length, 3);
  // The decoder reads <s> output and predicts output </s>.
  EXPECT_EQ(b.ids, (std::vector<int64_t>{train::kBos, 4, 1, 3, train::kBos, 7, train::kPad, train::kPad}));
  EXPECT_EQ(b.targets, (std::vector<int64_t>{4, 1, 3, train::kEos, 7, train::kEos, -100, -100}));
  EXPECT_EQ(train::parse_architecture("encoder-decoder"), train::Architecture::encoder_decoder);
  expect_message<ValueError>([] { train::parse_architecture("seq2seq"); },
                             "[mha::train::parse_architecture] name: expected 'decoder', 'encoder-decoder' or "
                             "'encoder'; got 'seq2seq'");
}

TEST(Trainer, EncoderDecoderLearnsToCopyShortSequences) {
  train::TaskData data({.task = train::Task::copy, .min_length = 2, .max_length = 3, .heldout = 40}, 1);
  Generator g(1);
  train::EncoderDecoder model(std::make_unique<EncoderDecoderModel>(
      EncoderDecoderConfig{.decoder = {.vocab_size = train::kVocab, .d_model = 32, .nhead = 2, .num_layers = 1,
                                       .dim_feedforward = 64},
                           .num_encoder_layers = 1},
      g));
  const double before = train::exact_match(model, data.heldout());
  const train::TrainResult r = train::train(
      model, data, {.steps = 200, .batch_size = 16, .lr = 1e-2, .min_lr = 1e-3, .warmup = 20, .eval_every = 50});
  EXPECT_LT(before, 0.2);
  EXPECT_GE(r.heldout_exact_match, 0.9);
  // Some cross-attention head reads output token k from source token k: its
  // strongest weight, for the query that predicts output k, is on column k.
  int64_t targets = 0;
  std::vector<int64_t> hits(2, 0);
  for (const train::Example& e : data.heldout()) {
    const train::AttentionView cross = model.attention(e.input, e.output)[2];
    ASSERT_EQ(cross.name, "cross-attention");
    const Tensor& w = cross.weights[0];  // (H, 1 + output, input)
    targets += int64_t(e.output.size());
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t k = 0; k < int64_t(e.output.size()); ++k) {
        int64_t best = 0;
        for (int64_t j = 1; j < w.size(2); ++j)
          if (w.item({h, k, j}) > w.item({h, k, best})) best = j;
        hits[size_t(h)] += best == k;
      }
  }
  const double best_head = double(std::max(hits[0], hits[1])) / double(targets);
  std::printf("  encoder-decoder copy (lengths 2-3): held-out exact match %.2f after %lld steps; best cross-attention "
              "head on the source token for %.1f%% of %lld targets\n",
              r.heldout_exact_match, (long long)r.steps, 100 * best_head, (long long)targets);
  EXPECT_GE(best_head, 0.9);
}

TEST(Checkpoint, EncoderDecoderRoundTripAndExactResume) {
  // Dropout on, accumulation on: every generator and the optimizer must be restored.
  const train::TaskConfig task{.task = train::Task::reverse, .min_length = 2, .max_length = 4, .heldout = 20};
  const train::TaskData data(task, 5);
  const train::TrainConfig config{.steps = 8, .batch_size = 4, .warmup = 2, .seed = 5, .eval_every = 4,
                                  .stop_when_perfect = false, .accumulate = 2, .checkpoint_every = 4};
  LanguageModelConfig decoder = small_decoder(Position::relative, DType::float32, train::kVocab);
  decoder.dropout = 0.1;
  const train::Checkpoint info{.model = decoder, .task = task, .seed = 5, .steps = 4,
                               .architecture = train::Architecture::encoder_decoder, .num_encoder_layers = 1};
  const std::string dir = temp_dir("mha_encdec_");
  Generator g(6);
  train::EncoderDecoder straight(std::make_unique<EncoderDecoderModel>(EncoderDecoderConfig{decoder, 1}, g));
  train::TrainState end_state;
  train::train(straight, data, config, {}, &end_state, [&](const train::TrainState& s) {
    if (s.step == 4) train::save_checkpoint(dir, straight, info, &s);
  });

  train::LoadedCheckpoint loaded = train::load_training_checkpoint(dir);
  ASSERT_TRUE(loaded.state);
  EXPECT_EQ(loaded.info.architecture, train::Architecture::encoder_decoder);
  EXPECT_EQ(loaded.info.num_encoder_layers, 1);
  train::train(*loaded.model, data, config, {}, loaded.state.get());
  auto a = straight.named_parameters(), b = loaded.model->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(max_abs_diff(*a[i].value, *b[i].value), 0.0) << a[i].name;

  // The weights under torch-style names, and the same logits after a reload.
  const io::SafetensorsFile weights = io::load_safetensors(dir + "/model.safetensors");
  EXPECT_TRUE(weights.tensors.count("encoder.layers.0.self_attn.in_proj_weight"));
  EXPECT_TRUE(weights.tensors.count("decoder.layers.1.multihead_attn.in_proj_weight"));
  EXPECT_NE(read_bytes(dir + "/config.json").find("\"architecture\": \"encoder-decoder\""), std::string::npos);
  train::LoadedCheckpoint reloaded = train::load_checkpoint(dir), at_step_4 = train::load_training_checkpoint(dir);
  const train::Batch batch = reloaded.model->make_batch({{{3, 1}, {1, 3}}, {{2, 7, 5}, {5, 7, 2}}});
  EXPECT_EQ(max_abs_diff(reloaded.model->forward(batch), at_step_4.model->forward(batch)), 0.0);
  // The record must name the model's architecture.
  EXPECT_THROW(train::save_checkpoint(dir, straight, {.model = decoder}), ValueError);
  std::filesystem::remove_all(dir);
}
