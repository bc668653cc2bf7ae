// Settings checks and token embeddings shared by the two models.
#include "nn/model_util.h"

#include "mha/dist/context_parallel.h"
#include "nn/layer_util.h"

namespace mha::nn {

EmbeddingConfig checked_token_embedding(const LanguageModelConfig& c, const char* fn) {
  if (c.num_layers <= 0) raise<ValueError>(fn, "num_layers", "> 0", std::to_string(c.num_layers));
  if (c.position == Position::learned && c.max_len <= 0)
    raise<ValueError>(fn, "max_len", "> 0 (learned positions)", std::to_string(c.max_len));
  if (c.position == Position::relative && c.num_buckets < 2)
    raise<ValueError>(fn, "num_buckets", ">= 2 (relative positions)", std::to_string(c.num_buckets));
  if (c.position == Position::relative && c.max_distance <= c.num_buckets / 2)
    raise<ValueError>(fn, "max_distance", "> num_buckets / 2 = " + std::to_string(c.num_buckets / 2) +
                      " (relative positions)", std::to_string(c.max_distance));
  if (c.position == Position::rope && c.nhead > 0 && (c.d_model % c.nhead != 0 || (c.d_model / c.nhead) % 2 != 0))
    raise<ValueError>(fn, "d_model", "an even multiple of nhead = " + std::to_string(c.nhead) +
                      " (rope rotates pairs of each head's dims)", std::to_string(c.d_model));
  check_attention_variant(c.attention, fn);
  if (c.causal && !c.attention.supports_causal())
    raise<ValueError>(fn, "attention.kind", "one with a causal form for a causal model (linformer and axial have "
                      "none: use them in a bidirectional encoder)", to_string(c.attention.kind));
  if (!c.attention.computes_weights() && (c.position == Position::relative || c.position == Position::alibi))
    raise<ValueError>(fn, "position", "sinusoidal, learned or rope with " + to_string(c.attention.kind) +
                      " attention (relative and alibi are biases on weights it does not form)", to_string(c.position));
  return {.num_embeddings = c.vocab_size, .embedding_dim = c.d_model, .dtype = c.dtype};
}

TransformerStackConfig stack_config(const LanguageModelConfig& c, int64_t num_layers,
                                    const std::vector<std::vector<int64_t>>& heads,
                                    const std::vector<std::vector<int64_t>>& cross_heads) {
  const std::optional<double> rotary = c.position == Position::rope ? std::optional(c.rope_base) : std::nullopt;
  return {.layer = {.d_model = c.d_model, .nhead = c.nhead, .dim_feedforward = c.dim_feedforward, .dropout = c.dropout,
                    .activation = c.activation, .batch_first = true, .norm_first = c.norm_first, .dtype = c.dtype,
                    .rotary_base = rotary, .precision = c.precision, .checkpoint_activations = c.checkpoint_activations,
                    .attention = c.attention},
          .num_layers = num_layers,
          .position = c.position,
          .num_buckets = c.num_buckets,
          .max_distance = c.max_distance,
          .heads = heads,
          .cross_heads = cross_heads};
}

void make_position_embedding(std::optional<Embedding>& table, const LanguageModelConfig& c, Generator& gen) {
  if (c.position == Position::learned)
    table.emplace(EmbeddingConfig{.num_embeddings = c.max_len, .embedding_dim = c.d_model, .dtype = c.dtype}, gen);
}

void check_ids(const Tensor& ids, const char* fn, const char* name) {
  check_defined(ids, fn, name);
  if (ids.dim() != 2) raise<ShapeError>(fn, name, "(B, L)", shape_string(ids.shape()));
}

namespace {

// Context parallel: the positions of this rank's columns of the sequence
// (padding positions, whose rows nothing reads, take the last real one).
Tensor shard_position_ids(const dist::SequenceShard& shard, int64_t B, int64_t L, const char* fn) {
  const std::vector<int64_t> p = dist::shard_positions(shard);
  if (int64_t(p.size()) != L)
    raise<ShapeError>(fn, "ids", std::to_string(p.size()) + " columns (this rank's of a sequence of " +
                      std::to_string(shard.length) + ")", std::to_string(L));
  Tensor ids = Tensor::empty({B, L}, DType::int64);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) ids.data<int64_t>()[b * L + l] = std::min(p[size_t(l)], shard.length - 1);
  return ids;
}

Tensor embed_shard(const dist::SequenceShard& shard, Tensor x, std::optional<Embedding>& positions,
                   const LanguageModelConfig& c, const char* fn) {
  const int64_t B = x.size(0), L = x.size(1), D = x.size(2);
  if (c.position != Position::sinusoidal && c.position != Position::learned)
    raise<ValueError>(fn, "position", "sinusoidal or learned under context parallelism", to_string(c.position));
  const Tensor ids = shard_position_ids(shard, B, L, fn);
  if (c.position == Position::learned) {
    if (shard.length > c.max_len)
      raise<ValueError>(fn, "ids", "at most max_len = " + std::to_string(c.max_len) + " positions (learned position "
                        "embedding)", std::to_string(shard.length) + " positions");
    return add(x, positions->forward(ids));
  }
  const Tensor pe = sinusoidal_encoding(shard.length, D, x.dtype());
  Tensor out = x.contiguous().clone();
  dispatch_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* y = out.data<T>();
    const T* table = pe.data<T>();
    for (int64_t r = 0; r < B * L; ++r)
      for (int64_t e = 0; e < D; ++e) y[r * D + e] += table[ids.data<int64_t>()[r] * D + e];
  });
  return out;
}

}  // namespace

Tensor embed_tokens(Embedding& tokens, std::optional<Embedding>& positions, const LanguageModelConfig& c,
                    const Tensor& ids, int64_t offset, const char* fn) {
  const int64_t B = ids.size(0), L = ids.size(1);
  Tensor x = tokens.forward(ids);
  if (const dist::SequenceShard* shard = dist::current_sequence_shard()) return embed_shard(*shard, x, positions, c, fn);
  if (c.position == Position::sinusoidal) return add_sinusoidal_encoding(x, true, offset);
  if (c.position != Position::learned) return x;
  if (offset + L > c.max_len)
    raise<ValueError>(fn, "ids", "at most max_len = " + std::to_string(c.max_len) +
                      " positions (learned position embedding)", "positions up to " + std::to_string(offset + L));
  return add(x, positions->forward(position_ids(B, L, offset)));
}

void embed_tokens_backward(Embedding& tokens, std::optional<Embedding>& positions, const Tensor& ids, const Tensor& dy) {
  if (const dist::SequenceShard* shard = dist::current_sequence_shard(); shard && positions)
    positions->backward(dy, shard_position_ids(*shard, ids.size(0), ids.size(1), "mha::nn::embed_tokens_backward"));
  else if (positions)
    positions->backward(dy, position_ids(ids.size(0), ids.size(1)));
  tokens.backward(dy, ids);
}

}  // namespace mha::nn
