// Activation checkpointing: with dropout on, every output and gradient of a
// checkpointed layer or model equals the plain one's bit for bit, step after
// step (the generators advance alike), and a checkpointed forward frees the
// layers' intermediates.
#include "cpu/allocator.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

void expect_same_gradients(Module& plain, Module& checkpointed, const std::string& where) {
  auto a = plain.named_parameters(), b = checkpointed.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_GT(max_abs(*a[i].grad), 0.0) << where << " " << a[i].name;
    EXPECT_EQ(max_abs_diff(*a[i].grad, *b[i].grad), 0.0) << where << " " << a[i].name;
  }
  const std::vector<Generator> ga = generator_states(plain), gb = generator_states(checkpointed);
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_EQ(ga[i].offset(), gb[i].offset()) << where << " generator " << i;
}

TransformerEncoderLayerConfig layer_config(bool norm_first, bool checkpoint) {
  return {.d_model = 6, .nhead = 2, .dim_feedforward = 10, .dropout = 0.2, .batch_first = true,
          .norm_first = norm_first, .dtype = DType::float64, .checkpoint_activations = checkpoint};
}

}  // namespace

TEST(ActivationCheckpointing, EncoderLayerGradientsAreBitIdentical) {
  const Tensor x = random_tensor({2, 5, 6}, 1), r = random_tensor({2, 5, 6}, 2);
  const Tensor bias = random_tensor({1, 2, 5, 5}, 3);  // a relative-position-like bias, with its gradient
  const Tensor kpm = Tensor::from_bools({false, false, false, false, true, false, false, false, false, false}, {2, 5});
  const EncoderInputs in{.src_key_padding_mask = kpm, .attn_bias = bias, .attn_bias_grad = true};
  for (bool norm_first : {false, true}) {
    SCOPED_TRACE(norm_first ? "Pre-LN" : "Post-LN");
    Generator g1(4), g2(4);
    TransformerEncoderLayer plain(layer_config(norm_first, false), g1), checkpointed(layer_config(norm_first, true), g2);
    for (int step = 0; step < 2; ++step) {  // the second step draws fresh dropout, the same in both
      plain.zero_grad(), checkpointed.zero_grad();
      EXPECT_EQ(max_abs_diff(plain.forward(x, in), checkpointed.forward(x, in)), 0.0);
      // The checkpointed forward kept nothing of its sub-layers.
      EXPECT_THROW(checkpointed.self_attn.backward(r), StateError);
      EXPECT_THROW(checkpointed.linear2.backward(r), StateError);
      EXPECT_EQ(max_abs_diff(plain.backward(r), checkpointed.backward(r)), 0.0);
      EXPECT_EQ(max_abs_diff(plain.attn_bias_grad(), checkpointed.attn_bias_grad()), 0.0);
      expect_same_gradients(plain, checkpointed, "step " + std::to_string(step));
    }
  }
}

TEST(ActivationCheckpointing, DecoderLayerGradientsAreBitIdentical) {
  const Tensor tgt = random_tensor({2, 4, 6}, 1), memory = random_tensor({2, 5, 6}, 2), r = random_tensor({2, 4, 6}, 3);
  const Tensor mkpm = Tensor::from_bools({false, false, false, true, true, false, false, false, false, false}, {2, 5});
  const DecoderInputs in{.memory_key_padding_mask = mkpm, .tgt_is_causal = true};
  for (bool norm_first : {false, true}) {
    SCOPED_TRACE(norm_first ? "Pre-LN" : "Post-LN");
    Generator g1(6), g2(6);
    TransformerDecoderLayer plain(layer_config(norm_first, false), g1), checkpointed(layer_config(norm_first, true), g2);
    for (int step = 0; step < 2; ++step) {
      plain.zero_grad(), checkpointed.zero_grad();
      EXPECT_EQ(max_abs_diff(plain.forward(tgt, memory, in), checkpointed.forward(tgt, memory, in)), 0.0);
      EXPECT_THROW(checkpointed.multihead_attn.backward(r), StateError);
      const DecoderGradients a = plain.backward(r), b = checkpointed.backward(r);
      EXPECT_EQ(max_abs_diff(a.dtgt, b.dtgt), 0.0);
      EXPECT_EQ(max_abs_diff(a.dmemory, b.dmemory), 0.0);
      expect_same_gradients(plain, checkpointed, "step " + std::to_string(step));
    }
  }
}

TEST(ActivationCheckpointing, ModelGradientsAreBitIdentical) {
  const Tensor src = Tensor::from_values(std::vector<double>{1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5}, {2, 6}, DType::int64);
  const Tensor tgt = Tensor::from_values(std::vector<double>{6, 5, 4, 3, 2, 1, 0, 6}, {2, 4}, DType::int64);
  const Tensor targets = Tensor::from_values(std::vector<double>{5, 4, 3, -100, 1, 0, 6, 2}, {2, 4}, DType::int64);
  const Tensor padding = Tensor::from_bools({false, false, false, false, false, false,  //
                                             false, false, false, false, true, true},
                                            {2, 6});
  // relative: the bias gradient flows through the recomputed layers into the tables.
  for (Position position : {Position::relative, Position::rope}) {
    SCOPED_TRACE(to_string(position));
    LanguageModelConfig c{.vocab_size = 7, .d_model = 8, .nhead = 2, .num_layers = 2, .dim_feedforward = 12,
                          .dropout = 0.1, .dtype = DType::float64, .position = position, .num_buckets = 8,
                          .max_distance = 10};
    LanguageModelConfig checkpointed_config = c;
    checkpointed_config.checkpoint_activations = true;
    Generator g1(3), g2(3), g3(3), g4(3);
    LanguageModel plain(c, g1), checkpointed(checkpointed_config, g2);
    EncoderDecoderModel plain_seq2seq({c, 2}, g3), checkpointed_seq2seq({checkpointed_config, 2}, g4);
    for (int step = 0; step < 2; ++step) {
      const std::string where = "step " + std::to_string(step);
      plain.zero_grad(), checkpointed.zero_grad();
      const Tensor logits = plain.forward(tgt);
      EXPECT_EQ(max_abs_diff(logits, checkpointed.forward(tgt)), 0.0);
      const Tensor dlogits = cross_entropy(logits, targets).dlogits;
      plain.backward(dlogits), checkpointed.backward(dlogits);
      expect_same_gradients(plain, checkpointed, "decoder-only " + where);

      plain_seq2seq.zero_grad(), checkpointed_seq2seq.zero_grad();
      const Tensor seq2seq_logits = plain_seq2seq.forward(src, tgt, padding);
      EXPECT_EQ(max_abs_diff(seq2seq_logits, checkpointed_seq2seq.forward(src, tgt, padding)), 0.0);
      const Tensor seq2seq_dlogits = cross_entropy(seq2seq_logits, targets).dlogits;
      plain_seq2seq.backward(seq2seq_dlogits), checkpointed_seq2seq.backward(seq2seq_dlogits);
      expect_same_gradients(plain_seq2seq, checkpointed_seq2seq, "encoder-decoder " + where);
    }
  }
}

namespace {

// Bytes that a forward of a fresh model leaves allocated: what its layers
// keep for backward, plus what the rest keeps and the logits.
int64_t held_by_forward(const LanguageModelConfig& c, const Tensor& ids) {
  Generator g(1);
  LanguageModel model(c, g);
  const int64_t before = int64_t(cpu::host_bytes_in_use());
  const Tensor logits = model.forward(ids);
  return int64_t(cpu::host_bytes_in_use()) - before;
}

}  // namespace

TEST(ActivationCheckpointing, EachLayerHoldsOnlyItsInput) {
  const int64_t B = 4, L = 32, D = 32;
  std::vector<double> tokens(size_t(B * L));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = double(i % 7);
  const Tensor ids = Tensor::from_values(tokens, {B, L}, DType::int64);
  // What one more layer adds: the difference between 4 and 2 layers, halved.
  auto per_layer = [&](bool checkpoint) {
    LanguageModelConfig c{.vocab_size = 7, .d_model = D, .nhead = 4, .dim_feedforward = 4 * D, .dropout = 0.1,
                          .dtype = DType::float64, .checkpoint_activations = checkpoint};
    c.num_layers = 4;
    const int64_t four = held_by_forward(c, ids);
    c.num_layers = 2;
    return (four - held_by_forward(c, ids)) / 2;
  };
  const int64_t input = B * L * D * int64_t(sizeof(double)), plain = per_layer(false), checkpointed = per_layer(true);
  std::printf("  bytes a layer holds between forward and backward (B %lld, L %lld, D %lld, float64): %lld without "
              "checkpointing, %lld with (its input: %lld)\n",
              (long long)B, (long long)L, (long long)D, (long long)plain, (long long)checkpointed, (long long)input);
  EXPECT_LE(checkpointed, input + 1024);
  EXPECT_GE(plain, 10 * input);
}
