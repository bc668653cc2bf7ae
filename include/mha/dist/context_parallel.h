// Context parallelism: one sequence spread over C ranks while a model trains.
//
// Every layer but attention works on each position alone, so a rank runs the
// whole model on its positions of the sequence (ring_positions: the zigzag
// layout by default) and only self-attention crosses ranks, as ring
// attention. While a ContextParallelScope lives on a thread, the layers that
// thread runs take part: MultiheadAttention's self-attention core runs
// ring_attention_forward/backward over the scope's communicator, and the
// token embeddings add the positions of the rank's rows (sinusoidal or
// learned). What the ring cannot take is refused: masks beyond causality
// (key padding, relative or ALiBi biases), rotary positions, attention
// dropout, returned weights, the efficient variants, bfloat16 operands.
//
// Training with P = C × D ranks: D data-parallel groups of C ranks; group d
// takes share_of(batch, d, D) of each micro-batch and its C ranks each take
// their positions of it; gradients are all-reduced over all P ranks.
#pragma once

#include <memory>
#include <vector>

#include "mha/dist/data_parallel.h"
#include "mha/dist/ring_attention.h"

namespace mha::dist {

// The sequence a scope spreads: `length` real positions over comm's ranks.
struct SequenceShard {
  Communicator* comm = nullptr;
  int64_t length = 0;
  RingLayout layout = RingLayout::zigzag;
};

class ContextParallelScope {
 public:
  ContextParallelScope(Communicator& comm, int64_t length, RingLayout layout = RingLayout::zigzag);
  ~ContextParallelScope();
  ContextParallelScope(const ContextParallelScope&) = delete;
  ContextParallelScope& operator=(const ContextParallelScope&) = delete;

 private:
  SequenceShard shard_;
  const SequenceShard* outer_;
};
// The innermost scope's shard on this thread, or null.
const SequenceShard* current_sequence_shard();

// For the layers (nn/): this rank's positions, and its self-attention core.
std::vector<int64_t> shard_positions(const SequenceShard& shard);
AttentionOutput shard_attention_forward(const SequenceShard& shard, const Tensor& query, const Tensor& key,
                                        const Tensor& value, const AttentionOptions& options, const char* fn);
AttentionGradients shard_attention_backward(const SequenceShard& shard, const Tensor& dout, const Tensor& query,
                                            const Tensor& key, const Tensor& value, const AttentionOutput& forward,
                                            const AttentionOptions& options, const char* fn);

// The ranks of `world` as D = size / C groups of C consecutive ranks, each
// group one sequence's ranks (`context`).
struct ContextGroups {
  std::unique_ptr<Communicator> context;
  int group = 0, groups = 1;
};
ContextGroups split_context(Communicator& world, int context_ranks);

// The columns (positions) of a (rows, length) batch that rank `rank` of
// `ranks` holds, padded (PAD ids, no targets) to ring_block_length.
train::Batch shard_batch(const train::Batch& batch, int rank, int ranks, RingLayout layout = RingLayout::zigzag);

// One step's gradients of the global batch over world's ranks, each group's
// sequences spread over its context ranks; returns the global batch's loss
// and counts, as data_parallel_gradients. Decoder-only and encoder models.
train::StepLoss context_parallel_gradients(train::TaskModel& model, Communicator& world, const ContextGroups& groups,
                                           GradientReducer& reducer, const std::vector<train::Example>& examples,
                                           int64_t micro_batch);

}  // namespace mha::dist
