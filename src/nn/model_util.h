// What the decoder-only and the encoder–decoder model share: the check of
// their settings, their layer stacks' settings, and token embeddings plus
// absolute positions.
#pragma once

#include "mha/nn/language_model.h"

namespace mha::nn {

// Checks the model settings c (ValueError naming fn) and returns the token
// table's: a model's first initialiser, so that nothing is built before.
EmbeddingConfig checked_token_embedding(const LanguageModelConfig& c, const char* fn);

// The settings of a stack of num_layers layers of the model c.
// heads, cross_heads: TransformerStackConfig's lists.
TransformerStackConfig stack_config(const LanguageModelConfig& c, int64_t num_layers,
                                    const std::vector<std::vector<int64_t>>& heads,
                                    const std::vector<std::vector<int64_t>>& cross_heads = {});

// The learned position table (max_len, D) when c.position is learned.
void make_position_embedding(std::optional<Embedding>& table, const LanguageModelConfig& c, Generator& gen);

// ids: defined, (B, L).
void check_ids(const Tensor& ids, const char* fn, const char* name = "ids");

// Token embeddings (B, L, D) of ids (B, L) plus the absolute positions
// offset … offset + L − 1 (sinusoidal or learned; the other kinds act inside
// attention). Embeddings are N(0, 1) and sinusoids in [-1, 1]: comparable
// scales, so they are summed as they are (no √D factor).
Tensor embed_tokens(Embedding& tokens, std::optional<Embedding>& positions, const LanguageModelConfig& c,
                    const Tensor& ids, int64_t offset, const char* fn);
// Its backward for ids embedded at offset 0: into the token table and the
// learned position table (sinusoidal positions pass the gradient through).
void embed_tokens_backward(Embedding& tokens, std::optional<Embedding>& positions, const Tensor& ids, const Tensor& dy);

}  // namespace mha::nn
