// The models that the trainer, the checkpoints and the `mha` tools work with,
// behind one interface: how an architecture lays out a task's examples, runs
// them forward and backward, starts greedy decoding, and shows its attention.
//
//   decoder          DecoderOnly: nn::LanguageModel on BOS input SEP output
//                    EOS, the outputs predicted from SEP on (make_batch)
//   encoder-decoder  EncoderDecoder: nn::EncoderDecoderModel with the input as
//                    its source (PAD-padded, under a key padding mask) and BOS
//                    output as its target, predicting output EOS
//                    (make_seq2seq_batch)
//   encoder          EncoderOnly: nn::LanguageModel with causal = false on
//                    BOS input SEP MASK…MASK, the output predicted at the
//                    MASKs in one pass (make_encoder_batch); every attention
//                    variant runs here, those without a causal form included
//
// Models whose self-attention has no KV cache (the efficient variants) decode
// by running the whole sequence again for each new token.
//
// A TaskModel is a Module: its parameters, generators and mode are its
// network's. It either owns its network or borrows one that outlives it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mha/nn/encoder_decoder.h"
#include "mha/nn/language_model.h"
#include "mha/train/tasks.h"

namespace mha::train {

enum class Architecture { decoder, encoder_decoder, encoder };

// "decoder", "encoder-decoder" or "encoder"; ValueError otherwise.
Architecture parse_architecture(const std::string& name);
std::string to_string(Architecture architecture);

// One kind of attention of one example, every layer and head: weights (H,
// queries, keys) per layer, and the tokens of the rows and of the columns.
struct AttentionView {
  std::string name;        // "self-attention", "encoder self-attention", "cross-attention" …
  std::string short_name;  // "self", "encoder", "decoder", "cross": for file names
  std::vector<Tensor> weights;
  std::vector<int64_t> queries, keys;
};

class TaskModel : public nn::Module {
 public:
  virtual Architecture architecture() const = 0;
  virtual nn::Module& network() = 0;

  std::vector<nn::NamedParameter> named_parameters() override { return network().named_parameters(); }
  std::vector<nn::NamedGenerator> named_generators() override { return network().named_generators(); }
  void train(bool on = true) override {
    Module::train(on);
    network().train(on);
  }
  void release_activations() override { network().release_activations(); }

  // The examples in this architecture's layout.
  virtual Batch make_batch(const std::vector<Example>& examples) const = 0;
  // Logits (rows, length, vocab) for batch.targets; saves what backward needs.
  virtual Tensor forward(const Batch& batch) = 0;
  virtual void backward(const Tensor& dlogits) = 0;

  // Greedy decoding with KV caches (eval mode), for inputs of one length:
  // start_decoding returns logits (rows, ·, vocab) whose last position
  // predicts the first output token; decode_step(next (rows, 1)) feeds the
  // tokens chosen and returns the logits of the next.
  virtual Tensor start_decoding(const std::vector<std::vector<int64_t>>& inputs) = 0;
  virtual Tensor decode_step(const Tensor& next) = 0;

  // The model's outputs for `inputs` (eval mode): greedy decoding up to EOS
  // or max_new tokens (generate(), trainer.h); the encoder instead fills
  // output_lengths[i] slots of input i in one pass.
  virtual std::vector<std::vector<int64_t>> answer(const std::vector<std::vector<int64_t>>& inputs,
                                                   const std::vector<int64_t>& output_lengths, int64_t max_new);

  // Every attention of the model over input → output, in one forward.
  virtual std::vector<AttentionView> attention(const std::vector<int64_t>& input,
                                               const std::vector<int64_t>& output) = 0;
};

// Holds the network: owned, or borrowed from the caller.
template <class Network>
class TaskModelOf : public TaskModel {
 public:
  explicit TaskModelOf(Network& borrowed) : model_(&borrowed) {}
  explicit TaskModelOf(std::unique_ptr<Network> owned) : owned_(std::move(owned)), model_(owned_.get()) {}

  Network& model() { return *model_; }
  const Network& model() const { return *model_; }
  nn::Module& network() override { return *model_; }

 protected:
  // Decoding without a KV cache: the tokens so far (rows, length), run whole each step.
  Tensor tokens_;
  // Appends next (rows, 1) to tokens_ as its last column and returns tokens_.
  Tensor append_tokens(const Tensor& next);

 private:
  std::unique_ptr<Network> owned_;
  Network* model_;
};

class DecoderOnly : public TaskModelOf<nn::LanguageModel> {
 public:
  using TaskModelOf::TaskModelOf;
  Architecture architecture() const override { return Architecture::decoder; }
  Batch make_batch(const std::vector<Example>& examples) const override;
  Tensor forward(const Batch& batch) override;
  void backward(const Tensor& dlogits) override;
  Tensor start_decoding(const std::vector<std::vector<int64_t>>& inputs) override;
  Tensor decode_step(const Tensor& next) override;
  // "self-attention" over BOS input SEP output.
  std::vector<AttentionView> attention(const std::vector<int64_t>& input, const std::vector<int64_t>& output) override;
};

class EncoderDecoder : public TaskModelOf<nn::EncoderDecoderModel> {
 public:
  using TaskModelOf::TaskModelOf;
  Architecture architecture() const override { return Architecture::encoder_decoder; }
  Batch make_batch(const std::vector<Example>& examples) const override;
  Tensor forward(const Batch& batch) override;
  void backward(const Tensor& dlogits) override;
  Tensor start_decoding(const std::vector<std::vector<int64_t>>& inputs) override;
  Tensor decode_step(const Tensor& next) override;
  // "encoder self-attention" over the input, "decoder self-attention" over
  // BOS output, "cross-attention" from BOS output to the input.
  std::vector<AttentionView> attention(const std::vector<int64_t>& input, const std::vector<int64_t>& output) override;

 private:
  Tensor source_;  // decoding without a KV cache: the inputs (rows, S)
};

class EncoderOnly : public TaskModelOf<nn::LanguageModel> {
 public:
  using TaskModelOf::TaskModelOf;
  Architecture architecture() const override { return Architecture::encoder; }
  Batch make_batch(const std::vector<Example>& examples) const override;
  Tensor forward(const Batch& batch) override;
  void backward(const Tensor& dlogits) override;
  // An encoder does not decode: both throw ValueError (use answer()).
  Tensor start_decoding(const std::vector<std::vector<int64_t>>& inputs) override;
  Tensor decode_step(const Tensor& next) override;
  std::vector<std::vector<int64_t>> answer(const std::vector<std::vector<int64_t>>& inputs,
                                           const std::vector<int64_t>& output_lengths, int64_t max_new) override;
  // "self-attention" over BOS input SEP MASK…MASK (full and window attention;
  // none for the variants without weights).
  std::vector<AttentionView> attention(const std::vector<int64_t>& input, const std::vector<int64_t>& output) override;
};

// A new model of `architecture`: a LanguageModel of `model` (bidirectional
// for the encoder), or an EncoderDecoderModel whose decoder is `model` and
// whose encoder has num_encoder_layers layers.
// The network of a decoder-only or encoder model; nullptr for an encoder-decoder.
nn::LanguageModel* language_model(TaskModel& model);

std::unique_ptr<TaskModel> make_task_model(Architecture architecture, const nn::LanguageModelConfig& model,
                                           int64_t num_encoder_layers, Generator& gen,
                                           const std::vector<std::vector<int64_t>>& encoder_heads = {},
                                           const std::vector<std::vector<int64_t>>& cross_heads = {});

}  // namespace mha::train
