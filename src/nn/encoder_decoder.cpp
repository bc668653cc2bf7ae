// The encoder–decoder model: a bidirectional encoder stack and a decoder
// stack that attends to its output, around one shared embedding and a head.
#include "mha/nn/encoder_decoder.h"

#include "nn/layer_util.h"
#include "nn/model_util.h"

namespace mha::nn {

namespace {

constexpr const char* kCtor = "mha::nn::EncoderDecoderModel";

EmbeddingConfig checked_token_embedding(const EncoderDecoderConfig& c) {
  if (c.num_encoder_layers <= 0)
    raise<ValueError>(kCtor, "num_encoder_layers", "> 0", std::to_string(c.num_encoder_layers));
  return checked_token_embedding(c.decoder, kCtor);
}

// src_key_padding_mask: undefined, or bool (B, S) like src_ids.
void check_padding(const Tensor& mask, const Tensor& src_ids, const char* fn) {
  if (!mask.defined()) return;
  if (mask.dtype() != DType::boolean) raise<DtypeError>(fn, "src_key_padding_mask", "bool", to_string(mask.dtype()));
  if (mask.shape() != src_ids.shape())
    raise<ShapeError>(fn, "src_key_padding_mask", "src_ids's shape " + shape_string(src_ids.shape()),
                      shape_string(mask.shape()));
}

}  // namespace

EncoderDecoderModel::EncoderDecoderModel(const EncoderDecoderConfig& c, Generator& gen)
    : embedding(checked_token_embedding(c), gen),
      head({.in_features = c.decoder.d_model, .out_features = c.decoder.vocab_size, .dtype = c.decoder.dtype}, gen),
      encoder(stack_config(c.decoder, c.num_encoder_layers, c.encoder_heads), false, gen),
      decoder(stack_config(c.decoder, c.decoder.num_layers, c.decoder.heads, c.cross_heads), gen),
      config_(c) {
  make_position_embedding(position_embedding, c.decoder, gen);
}

std::vector<NamedParameter> EncoderDecoderModel::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "embedding", embedding);
  if (position_embedding) append_parameters(out, "position_embedding", *position_embedding);
  append_parameters(out, "encoder", encoder);
  append_parameters(out, "decoder", decoder);
  append_parameters(out, "head", head);
  return out;
}

std::vector<NamedGenerator> EncoderDecoderModel::named_generators() {
  std::vector<NamedGenerator> out;
  append_generators(out, "encoder", encoder);
  append_generators(out, "decoder", decoder);
  return out;
}

void EncoderDecoderModel::train(bool on) {
  Module::train(on);
  encoder.train(on);
  decoder.train(on);
}

void EncoderDecoderModel::release_activations() {
  for (Module* m : std::initializer_list<Module*>{&embedding, &head, &encoder, &decoder}) m->release_activations();
  if (position_embedding) position_embedding->release_activations();
}

Tensor EncoderDecoderModel::encode(const Tensor& src_ids, const Tensor& src_key_padding_mask, bool need_weights,
                                   const char* fn) {
  check_ids(src_ids, fn, "src_ids");
  check_padding(src_key_padding_mask, src_ids, fn);
  const Tensor x = embed_tokens(embedding, position_embedding, config_.decoder, src_ids, 0, fn);
  // An attention kind that forms no weights cannot mask: its self-attention reads padding as tokens.
  return encoder.forward(x, config_.decoder.attention.computes_weights() ? src_key_padding_mask : Tensor(),
                         need_weights);
}

Tensor EncoderDecoderModel::forward(const Tensor& src_ids, const Tensor& tgt_ids, const Tensor& src_key_padding_mask,
                                    bool need_weights) {
  const char* fn = "mha::nn::EncoderDecoderModel::forward";
  check_ids(tgt_ids, fn, "tgt_ids");
  if (src_ids.defined() && src_ids.dim() == 2 && tgt_ids.size(0) != src_ids.size(0))
    raise<ShapeError>(fn, "tgt_ids", "batch size " + std::to_string(src_ids.size(0)) + " (src_ids's)",
                      shape_string(tgt_ids.shape()));
  const Tensor memory = encode(src_ids, src_key_padding_mask, need_weights, fn);
  const Tensor y = embed_tokens(embedding, position_embedding, config_.decoder, tgt_ids, 0, fn);
  src_ids_ = src_ids, tgt_ids_ = tgt_ids;
  return head.forward(decoder.forward(y, memory, src_key_padding_mask, need_weights));
}

void EncoderDecoderModel::backward(const Tensor& dlogits) {
  const DecoderGradients d = decoder.backward(head.backward(dlogits));
  embed_tokens_backward(embedding, position_embedding, tgt_ids_, d.dtgt);
  embed_tokens_backward(embedding, position_embedding, src_ids_, encoder.backward(d.dmemory));
}

void EncoderDecoderModel::begin_decode(const Tensor& src_ids, const Tensor& src_key_padding_mask) {
  const Tensor memory = encode(src_ids, src_key_padding_mask, false, "mha::nn::EncoderDecoderModel::begin_decode");
  decoder.begin_decode(memory, src_key_padding_mask);
  decoding_ = true;
}

Tensor EncoderDecoderModel::decode_step(const Tensor& tgt_ids) {
  const char* fn = "mha::nn::EncoderDecoderModel::decode_step";
  if (!decoding_) throw StateError(std::string("[") + fn + "] state: expected begin_decode(src_ids) first; got none");
  check_ids(tgt_ids, fn, "tgt_ids");
  const Tensor y = embed_tokens(embedding, position_embedding, config_.decoder, tgt_ids, decoded_length(), fn);
  return head.forward(decoder.decode_step(y));
}

void EncoderDecoderModel::prune_heads(Site site, int64_t layer, const std::vector<int64_t>& ids) {
  if (site == Site::encoder) {
    encoder.prune_heads(layer, ids);
    config_.encoder_heads = encoder.config().heads;
    return;
  }
  decoder.prune_heads(layer, ids, site == Site::cross);
  config_.decoder.heads = decoder.config().heads;
  config_.cross_heads = decoder.config().cross_heads;
}

}  // namespace mha::nn
