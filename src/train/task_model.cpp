// The two architectures on task examples: their batch layouts, prompts and
// attention views.
#include "mha/train/task_model.h"

#include "check.h"

namespace mha::train {

Architecture parse_architecture(const std::string& name) {
  if (name == "decoder") return Architecture::decoder;
  if (name == "encoder-decoder") return Architecture::encoder_decoder;
  raise<ValueError>("mha::train::parse_architecture", "name", "'decoder' or 'encoder-decoder'", "'" + name + "'");
}

std::string to_string(Architecture architecture) {
  return architecture == Architecture::decoder ? "decoder" : "encoder-decoder";
}

namespace {

// The inputs of one length, each as one row.
std::vector<int64_t> rows_of(const std::vector<std::vector<int64_t>>& inputs, int64_t before, int64_t after) {
  std::vector<int64_t> ids;
  for (const std::vector<int64_t>& input : inputs) {
    if (before >= 0) ids.push_back(before);
    ids.insert(ids.end(), input.begin(), input.end());
    if (after >= 0) ids.push_back(after);
  }
  return ids;
}

// Layer weights (1, H, L, S) of one example as (H, L, S).
std::vector<Tensor> first_row(const std::vector<Tensor>& weights) {
  std::vector<Tensor> out;
  for (const Tensor& w : weights) out.push_back(w.select(0, 0));
  return out;
}

// true where the source is padding; undefined when no row is padded.
Tensor source_padding(const Batch& b) {
  std::vector<bool> padded(b.source.size());
  bool any = false;
  for (size_t i = 0; i < b.source.size(); ++i) any |= padded[i] = b.source[i] == kPad;
  return any ? Tensor::from_bools(padded, {b.rows, b.source_length}) : Tensor();
}

}  // namespace

Batch DecoderOnly::make_batch(const std::vector<Example>& examples) const { return train::make_batch(examples); }

Tensor DecoderOnly::forward(const Batch& b) { return model().forward(token_tensor(b.ids, b.rows, b.length)); }

void DecoderOnly::backward(const Tensor& dlogits) { model().backward(dlogits); }

// The prompts, BOS input SEP, in one step.
Tensor DecoderOnly::start_decoding(const std::vector<std::vector<int64_t>>& inputs) {
  model().begin_decode();
  const int64_t rows = int64_t(inputs.size()), length = int64_t(inputs.at(0).size()) + 2;
  return model().decode_step(token_tensor(rows_of(inputs, kBos, kSep), rows, length));
}

Tensor DecoderOnly::decode_step(const Tensor& next) { return model().decode_step(next); }

std::vector<AttentionView> DecoderOnly::attention(const std::vector<int64_t>& input, const std::vector<int64_t>& output) {
  std::vector<int64_t> sequence = rows_of({input}, kBos, kSep);
  sequence.insert(sequence.end(), output.begin(), output.end());
  model().forward(token_tensor(sequence, 1, int64_t(sequence.size())), true);
  return {{"self-attention", "self", first_row(model().attention_weights()), sequence, sequence}};
}

Batch EncoderDecoder::make_batch(const std::vector<Example>& examples) const { return make_seq2seq_batch(examples); }

Tensor EncoderDecoder::forward(const Batch& b) {
  return model().forward(token_tensor(b.source, b.rows, b.source_length), token_tensor(b.ids, b.rows, b.length),
                         source_padding(b));
}

void EncoderDecoder::backward(const Tensor& dlogits) { model().backward(dlogits); }

// The encoder runs once over the inputs (one length: no padding); the decoder starts from BOS.
Tensor EncoderDecoder::start_decoding(const std::vector<std::vector<int64_t>>& inputs) {
  const int64_t rows = int64_t(inputs.size());
  model().begin_decode(token_tensor(rows_of(inputs, -1, -1), rows, int64_t(inputs.at(0).size())));
  return model().decode_step(token_tensor(std::vector<int64_t>(size_t(rows), kBos), rows, 1));
}

Tensor EncoderDecoder::decode_step(const Tensor& next) { return model().decode_step(next); }

std::vector<AttentionView> EncoderDecoder::attention(const std::vector<int64_t>& input,
                                                     const std::vector<int64_t>& output) {
  const std::vector<int64_t> target = rows_of({output}, kBos, -1);
  model().forward(token_tensor(input, 1, int64_t(input.size())), token_tensor(target, 1, int64_t(target.size())), {},
                  true);
  return {{"encoder self-attention", "encoder", first_row(model().encoder.attention_weights()), input, input},
          {"decoder self-attention", "decoder", first_row(model().decoder.attention_weights()), target, target},
          {"cross-attention", "cross", first_row(model().decoder.cross_attention_weights()), target, input}};
}

std::unique_ptr<TaskModel> make_task_model(Architecture architecture, const nn::LanguageModelConfig& model,
                                           int64_t num_encoder_layers, Generator& gen) {
  if (architecture == Architecture::decoder)
    return std::make_unique<DecoderOnly>(std::make_unique<nn::LanguageModel>(model, gen));
  return std::make_unique<EncoderDecoder>(std::make_unique<nn::EncoderDecoderModel>(
      nn::EncoderDecoderConfig{.decoder = model, .num_encoder_layers = num_encoder_layers}, gen));
}

}  // namespace mha::train
