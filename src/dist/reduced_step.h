// The step data-parallel and context-parallel training share: each rank's
// share of the micro-batches, and their forward and backward with the
// gradients all-reduced in buckets.
#pragma once

#include <vector>

#include "mha/dist/data_parallel.h"

namespace mha::dist::detail {

// Group `group` of `groups`'s rows of each micro_batch of examples (share_of),
// each made as the whole micro-batch is made (batch_rows); none where a group
// has no rows of it.
std::vector<train::Batch> shared_batches(train::TaskModel& model, const std::vector<train::Example>& examples,
                                         int64_t micro_batch, int group, int groups, const char* fn);

struct StepPart {
  train::Batch batch;
  int64_t tokens = 0;    // the tokens it counts for (a context shard: its real positions)
  int64_t sequence = 0;  // a context shard: the length of the sequences it is cut from
};
// Forward and backward of every part (inside a ContextParallelScope over
// `context` when given), the cross-entropy weighted by the targets of all
// parts on all of world's ranks, the last backward reporting to `reducer`;
// the loss and counts summed over world.
train::StepLoss reduced_step(train::TaskModel& model, Communicator& world, GradientReducer& reducer,
                             const std::vector<StepPart>& parts, Communicator* context);

}  // namespace mha::dist::detail
