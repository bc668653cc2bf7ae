// Context parallelism: the scope the layers consult, their ring-attention
// core, the batch's columns per rank, and the training step over C × D ranks.
#include "mha/dist/context_parallel.h"

#include "check.h"
#include "dist/reduced_step.h"

namespace mha::dist {
namespace {

thread_local const SequenceShard* innermost = nullptr;

RingOptions ring_options(const SequenceShard& shard, const AttentionOptions& o, const Tensor& query, const char* fn) {
  const auto refuse = [&](const char* argument, const std::string& got) {
    raise<ValueError>(fn, argument, "what ring attention takes under context parallelism (no mask beyond causality, "
                      "no window, no attention dropout, no returned weights)", got);
  };
  if (o.mask.defined()) refuse("mask", "a mask or attention bias of shape " + shape_string(o.mask.shape()));
  if (o.window_left >= 0 || o.window_right >= 0) refuse("window", "a sliding window");
  if (o.dropout_p > 0) refuse("dropout_p", std::to_string(o.dropout_p));
  if (o.return_weights) refuse("return_weights", "true");
  if (o.causal == Causal::bottom_right) refuse("causal", "bottom_right");
  if (query.dtype() == DType::bfloat16)
    raise<DtypeError>(fn, "query", "float32 or float64 operands under context parallelism (no bf16-mixed)", "bfloat16");
  RingOptions r;
  r.layout = shard.layout, r.length = shard.length, r.causal = o.causal, r.scale = o.scale;
  return r;
}

}  // namespace

ContextParallelScope::ContextParallelScope(Communicator& comm, int64_t length, RingLayout layout)
    : shard_{&comm, length, layout}, outer_(innermost) {
  if (length < 1) raise<ValueError>("mha::dist::ContextParallelScope", "length", ">= 1", std::to_string(length));
  innermost = &shard_;
}

ContextParallelScope::~ContextParallelScope() { innermost = outer_; }

const SequenceShard* current_sequence_shard() { return innermost; }

std::vector<int64_t> shard_positions(const SequenceShard& s) {
  return ring_positions(s.length, s.comm->rank(), s.comm->size(), s.layout);
}

AttentionOutput shard_attention_forward(const SequenceShard& s, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const AttentionOptions& o, const char* fn) {
  return ring_attention_forward(*s.comm, q, k, v, ring_options(s, o, q, fn));
}

AttentionGradients shard_attention_backward(const SequenceShard& s, const Tensor& dout, const Tensor& q,
                                            const Tensor& k, const Tensor& v, const AttentionOutput& forward,
                                            const AttentionOptions& o, const char* fn) {
  return ring_attention_backward(*s.comm, dout, q, k, v, forward, ring_options(s, o, q, fn));
}

ContextGroups split_context(Communicator& world, int C) {
  const int P = world.size();
  if (C < 1 || P % C != 0)
    raise<ValueError>("mha::dist::split_context", "context_ranks", "a divisor of the " + std::to_string(P) + " ranks",
                      std::to_string(C));
  ContextGroups g;
  g.group = world.rank() / C, g.groups = P / C;
  g.context = world.split(g.group, world.rank() % C);
  return g;
}

train::Batch shard_batch(const train::Batch& b, int rank, int ranks, RingLayout layout) {
  if (!b.source.empty())
    raise<ValueError>("mha::dist::shard_batch", "batch", "a decoder-only or encoder batch (ids and targets)",
                      "an encoder-decoder's (with a source)");
  const std::vector<int64_t> positions = ring_positions(b.length, rank, ranks, layout);
  train::Batch part;
  part.rows = b.rows, part.length = int64_t(positions.size());
  for (int64_t r = 0; r < b.rows; ++r)
    for (int64_t p : positions) {
      part.ids.push_back(p < b.length ? b.ids[size_t(r * b.length + p)] : train::kPad);
      part.targets.push_back(p < b.length ? b.targets[size_t(r * b.length + p)] : -100);
    }
  return part;
}

train::StepLoss context_parallel_gradients(train::TaskModel& model, Communicator& world, const ContextGroups& groups,
                                           GradientReducer& reducer, const std::vector<train::Example>& examples,
                                           int64_t micro) {
  const char* fn = "mha::dist::context_parallel_gradients";
  if (model.architecture() == train::Architecture::encoder_decoder)
    raise<ValueError>(fn, "model", "a decoder-only or encoder model", "an encoder-decoder");
  Communicator& context = *groups.context;
  std::vector<detail::StepPart> parts;
  for (const train::Batch& whole : detail::shared_batches(model, examples, micro, groups.group, groups.groups, fn)) {
    int64_t real = 0;  // of this rank's positions
    for (int64_t p : ring_positions(whole.length, context.rank(), context.size(), RingLayout::zigzag))
      real += p < whole.length;
    parts.push_back({shard_batch(whole, context.rank(), context.size()), whole.rows * real, whole.length});
  }
  return detail::reduced_step(model, world, reducer, parts, &context);
}

}  // namespace mha::dist
