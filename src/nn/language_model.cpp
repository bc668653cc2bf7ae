// The decoder-only model: a causal layer stack between an embedding and a
// linear head, with the position kind chosen in the config.
#include "mha/nn/language_model.h"

#include "nn/layer_util.h"
#include "nn/model_util.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::LanguageModel";
}  // namespace

LanguageModel::LanguageModel(const LanguageModelConfig& c, Generator& gen)
    : embedding(checked_token_embedding(c, kCtor), gen),
      head({.in_features = c.d_model, .out_features = c.vocab_size, .dtype = c.dtype, .precision = c.precision}, gen),
      transformer(stack_config(c, c.num_layers, c.heads), c.causal, gen),
      config_(c) {
  make_position_embedding(position_embedding, c, gen);  // drawn last, so that a sinusoidal model is as before
}

std::vector<NamedParameter> LanguageModel::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "embedding", embedding);
  if (position_embedding) append_parameters(out, "position_embedding", *position_embedding);
  for (NamedParameter& p : transformer.named_parameters()) out.push_back(p);  // no prefix: layers.N.*, norm.*
  append_parameters(out, "head", head);
  return out;
}

std::vector<NamedGenerator> LanguageModel::named_generators() { return transformer.named_generators(); }

void LanguageModel::train(bool on) {
  Module::train(on);
  transformer.train(on);
  head.train(on);
}

void LanguageModel::release_activations() {
  for (Module* m : std::initializer_list<Module*>{&embedding, &head, &transformer}) m->release_activations();
  if (position_embedding) position_embedding->release_activations();
  hidden_ = Tensor();
}

Tensor LanguageModel::forward(const Tensor& ids, bool need_weights) {
  const char* fn = "mha::nn::LanguageModel::forward";
  check_ids(ids, fn);
  ids_ = ids;
  hidden_ = transformer.forward(embed_tokens(embedding, position_embedding, config_, ids, 0, fn), {}, need_weights);
  return head.forward(hidden_);
}

void LanguageModel::backward(const Tensor& dlogits, const Tensor& dhidden, const std::vector<Tensor>& dweights) {
  Tensor dh = head.backward(dlogits);
  report_gradients_ready(head);
  if (dhidden.defined()) {
    if (dhidden.shape() != dh.shape())
      raise<ShapeError>("mha::nn::LanguageModel::backward", "dhidden", "last_hidden()'s shape " +
                        shape_string(dh.shape()), shape_string(dhidden.shape()));
    dh = add(dh, dhidden);
  }
  const Tensor dx = transformer.backward(dh, dweights);
  embed_tokens_backward(embedding, position_embedding, ids_, dx);
}

Tensor LanguageModel::decode_step(const Tensor& ids) {
  const char* fn = "mha::nn::LanguageModel::decode_step";
  check_ids(ids, fn);
  const Tensor x = embed_tokens(embedding, position_embedding, config_, ids, decoded_length(), fn);
  return head.forward(transformer.decode_step(x));
}

void LanguageModel::prune_heads(int64_t layer, const std::vector<int64_t>& ids) {
  transformer.prune_heads(layer, ids);
  config_.heads = transformer.config().heads;
}

}  // namespace mha::nn
