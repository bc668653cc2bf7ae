// Data-parallel training: every rank holds the whole model, draws the same
// examples as a single process would, runs its share of each micro-batch, and
// the gradients are summed over the ranks in buckets while backward goes on.
//
// The loss is the mean over every target of the global batch, so each rank
// weights its micro-batches by (its targets) / (the global batch's targets):
// the sum over ranks is the single-process gradient, up to the order of the
// additions. The ring all-reduce leaves the same bits on every rank, so the
// parameters stay identical without being broadcast.
#pragma once

#include <unordered_map>
#include <vector>

#include "mha/dist/communicator.h"
#include "mha/train/trainer.h"

namespace mha::dist {

// The examples [begin, end) of n that rank `rank` of `size` takes: n / size
// each, one more for the first n % size ranks (possibly none: end == begin).
struct Share {
  int64_t begin = 0, end = 0;
};
Share share_of(int64_t n, int rank, int size);
// Rows [begin, end) of a batch, padded as the whole batch is: an encoder
// attends to its padding, so a rank's rows must keep the length the single
// process pads them to for the same logits.
train::Batch batch_rows(const train::Batch& batch, int64_t begin, int64_t end);

// When each bucket's all-reduce started, in seconds from begin(), beside the
// end of backward (finish() called) and the moment every bucket was done.
struct BucketTimeline {
  std::vector<double> start;     // per bucket, in the order they started
  std::vector<int64_t> elements; // per bucket, same order
  double backward_end = 0, done = 0;
};

// Buckets over the flat gradient block of `params` (nn::flatten_parameters):
// runs of consecutive parameters, taken from the last (backward reaches it
// first), of about bucket_bytes each (at least one parameter; the alignment
// gaps between parameters travel too, as zeros). A bucket's all-reduce starts
// (Communicator::all_reduce_start) as soon as each of its parameters was
// reported ready, and in the order of the buckets on every rank.
class GradientReducer {
 public:
  GradientReducer(Communicator& comm, const std::vector<nn::NamedParameter>& params, int64_t bucket_bytes);

  // A new step: no gradient ready yet.
  void begin();
  // These parameters' gradients are final (nn::GradientsReady); parameters
  // that are not among the reducer's are ignored.
  void ready(const std::vector<nn::NamedParameter>& params);
  // Every gradient is final: starts the rest and waits for all. On return the
  // gradients hold their sum over the ranks.
  void finish();

  int64_t buckets() const { return int64_t(buckets_.size()); }
  int64_t gradient_bytes() const { return bytes_; }
  const BucketTimeline& timeline() const { return timeline_; }

 private:
  struct Bucket {
    int64_t first = 0, last = 0;  // parameters [first, last]
    int64_t begin = 0, end = 0;   // elements of the flat block
    int64_t waiting = 0;          // parameters not yet ready
  };
  void start_ready_buckets();

  Communicator& comm_;
  Tensor grads_;
  DType dtype_;
  std::vector<int64_t> bucket_of_;  // per parameter
  std::vector<bool> is_ready_;
  std::unordered_map<const void*, int64_t> index_of_;  // a parameter by its gradient's data
  std::vector<Bucket> buckets_;
  std::vector<std::unique_ptr<Request>> requests_;
  size_t next_ = 0;  // the next bucket to start
  int64_t bytes_ = 0;
  double t0_ = 0;
  BucketTimeline timeline_;
};

// One step's gradients of `examples` over the ranks (the global batch; every
// rank passes the same): each micro_batch of them is shared out by share_of,
// the rank's parts run forward and backward with the cross-entropy weighted
// as above, the last backward reports to `reducer`, and the loss, counts and
// tokens returned are the global batch's (summed over the ranks).
train::StepLoss data_parallel_gradients(train::TaskModel& model, Communicator& comm, GradientReducer& reducer,
                                        const std::vector<train::Example>& examples, int64_t micro_batch);

// The held-out metric over the ranks: each evaluates its share of `examples`
// (share_of), the counts are summed.
train::Evaluation data_parallel_evaluate(train::TaskModel& model, Communicator& comm,
                                         const std::vector<train::Example>& examples);

}  // namespace mha::dist
