// The two architectures on task examples: their batch layouts, prompts and
// attention views.
#include "mha/train/task_model.h"

#include <algorithm>

#include "check.h"
#include "mha/train/trainer.h"

namespace mha::train {

Architecture parse_architecture(const std::string& name) {
  if (name == "decoder") return Architecture::decoder;
  if (name == "encoder-decoder") return Architecture::encoder_decoder;
  if (name == "encoder") return Architecture::encoder;
  raise<ValueError>("mha::train::parse_architecture", "name", "'decoder', 'encoder-decoder' or 'encoder'",
                    "'" + name + "'");
}

std::string to_string(Architecture architecture) {
  switch (architecture) {
    case Architecture::decoder: return "decoder";
    case Architecture::encoder_decoder: return "encoder-decoder";
    case Architecture::encoder: return "encoder";
  }
  return "?";
}

std::vector<std::vector<int64_t>> TaskModel::answer(const std::vector<std::vector<int64_t>>& inputs,
                                                    const std::vector<int64_t>&, int64_t max_new) {
  return generate(*this, inputs, max_new);
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

bool has_cache(const nn::LanguageModelConfig& c) { return c.attention.computes_weights(); }

}  // namespace

template <class Network>
Tensor TaskModelOf<Network>::append_tokens(const Tensor& next) {
  const int64_t rows = tokens_.size(0), length = tokens_.size(1);
  Tensor grown = Tensor::empty({rows, length + 1}, DType::int64);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(tokens_.data<int64_t>() + r * length, length, grown.data<int64_t>() + r * (length + 1));
    grown.data<int64_t>()[r * (length + 1) + length] = next.data<int64_t>()[r];
  }
  return tokens_ = grown;
}

Batch DecoderOnly::make_batch(const std::vector<Example>& examples) const { return train::make_batch(examples); }

Tensor DecoderOnly::forward(const Batch& b) { return model().forward(token_tensor(b.ids, b.rows, b.length)); }

void DecoderOnly::backward(const Tensor& dlogits) { model().backward(dlogits); }

// The prompts, BOS input SEP, in one step.
Tensor DecoderOnly::start_decoding(const std::vector<std::vector<int64_t>>& inputs) {
  const int64_t rows = int64_t(inputs.size()), length = int64_t(inputs.at(0).size()) + 2;
  const Tensor prompts = token_tensor(rows_of(inputs, kBos, kSep), rows, length);
  if (!has_cache(model().config())) return model().forward(tokens_ = prompts);
  model().begin_decode();
  return model().decode_step(prompts);
}

Tensor DecoderOnly::decode_step(const Tensor& next) {
  return has_cache(model().config()) ? model().decode_step(next) : model().forward(append_tokens(next));
}

std::vector<AttentionView> DecoderOnly::attention(const std::vector<int64_t>& input, const std::vector<int64_t>& output) {
  if (!model().config().attention.computes_weights()) return {};
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
  const Tensor source = token_tensor(rows_of(inputs, -1, -1), rows, int64_t(inputs.at(0).size()));
  const Tensor start = token_tensor(std::vector<int64_t>(size_t(rows), kBos), rows, 1);
  if (!has_cache(model().config().decoder)) return model().forward(source_ = source, tokens_ = start);
  model().begin_decode(source);
  return model().decode_step(start);
}

Tensor EncoderDecoder::decode_step(const Tensor& next) {
  return has_cache(model().config().decoder) ? model().decode_step(next) : model().forward(source_, append_tokens(next));
}

std::vector<AttentionView> EncoderDecoder::attention(const std::vector<int64_t>& input,
                                                     const std::vector<int64_t>& output) {
  if (!model().config().decoder.attention.computes_weights()) return {};
  const std::vector<int64_t> target = rows_of({output}, kBos, -1);
  model().forward(token_tensor(input, 1, int64_t(input.size())), token_tensor(target, 1, int64_t(target.size())), {},
                  true);
  return {{"encoder self-attention", "encoder", first_row(model().encoder.attention_weights()), input, input},
          {"decoder self-attention", "decoder", first_row(model().decoder.attention_weights()), target, target},
          {"cross-attention", "cross", first_row(model().decoder.cross_attention_weights()), target, input}};
}

Batch EncoderOnly::make_batch(const std::vector<Example>& examples) const {
  return make_encoder_batch(examples, model().config().attention.length_multiple());
}

Tensor EncoderOnly::forward(const Batch& b) { return model().forward(token_tensor(b.ids, b.rows, b.length)); }

void EncoderOnly::backward(const Tensor& dlogits) { model().backward(dlogits); }

Tensor EncoderOnly::start_decoding(const std::vector<std::vector<int64_t>>&) {
  raise<ValueError>("mha::train::EncoderOnly::start_decoding", "architecture",
                    "a decoding one (the encoder answers in one pass: answer())", "encoder");
}

Tensor EncoderOnly::decode_step(const Tensor&) {
  raise<ValueError>("mha::train::EncoderOnly::decode_step", "architecture",
                    "a decoding one (the encoder answers in one pass: answer())", "encoder");
}

std::vector<std::vector<int64_t>> EncoderOnly::answer(const std::vector<std::vector<int64_t>>& inputs,
                                                      const std::vector<int64_t>& output_lengths, int64_t) {
  const char* fn = "mha::train::EncoderOnly::answer";
  if (output_lengths.size() != inputs.size())
    raise<ValueError>(fn, "output_lengths", std::to_string(inputs.size()) + " lengths (one per input)",
                      std::to_string(output_lengths.size()));
  const bool was_training = is_training();
  eval();
  std::vector<std::vector<int64_t>> outputs(inputs.size());
  // Examples per forward: few, so that evaluating never needs more memory
  // than a training batch (the forward keeps its activations).
  constexpr size_t kRows = 8;
  for (size_t first = 0; first < inputs.size(); first += kRows) {
    std::vector<Example> group;
    for (size_t i = first; i < std::min(inputs.size(), first + kRows); ++i) {
      if (output_lengths[i] < 1) raise<ValueError>(fn, "output_lengths", ">= 1", std::to_string(output_lengths[i]));
      group.push_back({inputs[i], std::vector<int64_t>(size_t(output_lengths[i]), kMask)});
    }
    const Batch b = make_batch(group);
    const Tensor logits = model().forward(token_tensor(b.ids, b.rows, b.length)).to(DType::float32);
    const int64_t V = logits.size(-1);
    for (int64_t r = 0; r < b.rows; ++r)
      for (int64_t t = 0; t < b.length; ++t)
        if (b.targets[size_t(r * b.length + t)] >= 0) {
          const float* row = logits.data<float>() + (r * b.length + t) * V;
          outputs[first + size_t(r)].push_back(int64_t(std::max_element(row, row + V) - row));
        }
  }
  train(was_training);
  return outputs;
}

std::vector<AttentionView> EncoderOnly::attention(const std::vector<int64_t>& input, const std::vector<int64_t>& output) {
  if (!model().config().attention.computes_weights()) return {};
  const Batch b = make_batch({{input, output}});
  model().forward(token_tensor(b.ids, 1, b.length), true);
  return {{"self-attention", "self", first_row(model().attention_weights()), b.ids, b.ids}};
}

std::unique_ptr<TaskModel> make_task_model(Architecture architecture, const nn::LanguageModelConfig& model,
                                           int64_t num_encoder_layers, Generator& gen,
                                           const std::vector<std::vector<int64_t>>& encoder_heads,
                                           const std::vector<std::vector<int64_t>>& cross_heads) {
  if (architecture == Architecture::decoder)
    return std::make_unique<DecoderOnly>(std::make_unique<nn::LanguageModel>(model, gen));
  if (architecture == Architecture::encoder) {
    nn::LanguageModelConfig encoder = model;
    encoder.causal = false;
    return std::make_unique<EncoderOnly>(std::make_unique<nn::LanguageModel>(encoder, gen));
  }
  return std::make_unique<EncoderDecoder>(std::make_unique<nn::EncoderDecoderModel>(
      nn::EncoderDecoderConfig{.decoder = model, .num_encoder_layers = num_encoder_layers,
                               .encoder_heads = encoder_heads, .cross_heads = cross_heads},
      gen));
}

nn::LanguageModel* language_model(TaskModel& model) {
  if (auto* d = dynamic_cast<DecoderOnly*>(&model)) return &d->model();
  if (auto* e = dynamic_cast<EncoderOnly*>(&model)) return &e->model();
  return nullptr;
}

}  // namespace mha::train
