// Data-parallel steps: the global batch shared out, gradients all-reduced in
// buckets as backward finishes each layer, the held-out metric shared out.
#include "mha/dist/data_parallel.h"

#include <chrono>
#include <optional>

#include "check.h"
#include "dist/reduced_step.h"
#include "mha/dist/context_parallel.h"
#include "mha/nn/loss.h"

namespace mha::dist {
namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

train::Batch batch_rows(const train::Batch& b, int64_t begin, int64_t end) {
  train::Batch part = b;
  part.rows = end - begin;
  const auto rows = [&](const std::vector<int64_t>& v, int64_t width) {
    return std::vector<int64_t>(v.begin() + begin * width, v.begin() + end * width);
  };
  part.ids = rows(b.ids, b.length), part.targets = rows(b.targets, b.length);
  if (!b.source.empty()) part.source = rows(b.source, b.source_length);
  return part;
}

Share share_of(int64_t n, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size)
    raise<ValueError>("mha::dist::share_of", "rank", "0 <= rank < size (" + std::to_string(size) + ")",
                      std::to_string(rank));
  const int64_t base = n / size, extra = n % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

GradientReducer::GradientReducer(Communicator& comm, const std::vector<nn::NamedParameter>& params,
                                 int64_t bucket_bytes)
    : comm_(comm) {
  const char* fn = "mha::dist::GradientReducer";
  if (bucket_bytes < 1) raise<ValueError>(fn, "bucket_bytes", ">= 1", std::to_string(bucket_bytes));
  const std::optional<nn::FlatParameters> flat = nn::flat_parameters_of(params);
  if (params.empty() || !flat)
    raise<ValueError>(fn, "params", "parameters flattened into one block (nn::flatten_parameters)",
                      params.empty() ? "none" : "separate tensors");
  grads_ = flat->grads, dtype_ = grads_.dtype();
  bytes_ = flat->numel * dtype_size(dtype_);
  const int64_t n = int64_t(params.size());
  bucket_of_.assign(size_t(n), 0);
  is_ready_.assign(size_t(n), false);
  for (int64_t i = 0; i < n; ++i) index_of_[params[size_t(i)].grad->raw_data()] = i;
  // From the last parameter down: backward finishes the last layers first.
  for (int64_t last = n - 1; last >= 0;) {
    Bucket b;
    b.last = last, b.end = last + 1 < n ? flat->offsets[size_t(last + 1)] : flat->numel;
    int64_t first = last;
    while (first > 0 && (b.end - flat->offsets[size_t(first)]) * dtype_size(dtype_) < bucket_bytes) --first;
    b.first = first, b.begin = flat->offsets[size_t(first)];
    for (int64_t i = first; i <= last; ++i) bucket_of_[size_t(i)] = int64_t(buckets_.size());
    buckets_.push_back(b);
    last = first - 1;
  }
}

void GradientReducer::begin() {
  requests_.clear();
  next_ = 0;
  is_ready_.assign(is_ready_.size(), false);
  for (Bucket& b : buckets_) b.waiting = b.last - b.first + 1;
  timeline_ = {};
  t0_ = seconds_now();
}

void GradientReducer::ready(const std::vector<nn::NamedParameter>& params) {
  for (const nn::NamedParameter& p : params) {
    const auto found = index_of_.find(p.grad->raw_data());
    if (found == index_of_.end() || is_ready_[size_t(found->second)]) continue;
    is_ready_[size_t(found->second)] = true;
    --buckets_[size_t(bucket_of_[size_t(found->second)])].waiting;
  }
  start_ready_buckets();
}

void GradientReducer::start_ready_buckets() {
  const int64_t bytes = dtype_size(dtype_);
  char* base = static_cast<char*>(grads_.raw_data());
  // In bucket order on every rank: the ranks' background threads then pair
  // the same buckets with each other.
  while (next_ < buckets_.size() && buckets_[next_].waiting == 0) {
    const Bucket& b = buckets_[next_++];
    timeline_.start.push_back(seconds_now() - t0_);
    timeline_.elements.push_back(b.end - b.begin);
    requests_.push_back(comm_.all_reduce_start(base + b.begin * bytes, b.end - b.begin, dtype_));
  }
}

void GradientReducer::finish() {
  timeline_.backward_end = seconds_now() - t0_;
  for (Bucket& b : buckets_) b.waiting = 0;
  start_ready_buckets();
  for (auto& r : requests_) r->wait();
  requests_.clear();
  timeline_.done = seconds_now() - t0_;
}

namespace detail {

std::vector<train::Batch> shared_batches(train::TaskModel& model, const std::vector<train::Example>& examples,
                                         int64_t micro, int group, int groups, const char* fn) {
  if (micro < 1) raise<ValueError>(fn, "micro_batch", ">= 1", std::to_string(micro));
  std::vector<train::Batch> batches;
  for (size_t first = 0; first < examples.size(); first += size_t(micro)) {
    const int64_t n = std::min<int64_t>(micro, int64_t(examples.size() - first));
    const Share s = share_of(n, group, groups);
    if (s.end == s.begin) continue;
    const auto from = examples.begin() + int64_t(first);
    batches.push_back(batch_rows(model.make_batch({from, from + n}), s.begin, s.end));
  }
  return batches;
}

train::StepLoss reduced_step(train::TaskModel& model, Communicator& world, GradientReducer& reducer,
                             const std::vector<StepPart>& parts, Communicator* context) {
  int64_t total = 0;
  for (const StepPart& part : parts) total += train::target_count(part.batch);
  all_reduce(world, &total, 1);
  model.zero_grad();
  reducer.begin();
  double sums[4] = {0, 0, 0, 0};  // loss, targets, right argmaxes, tokens
  for (size_t i = 0; i < parts.size(); ++i) {
    const train::Batch& b = parts[i].batch;
    std::optional<ContextParallelScope> scope;
    if (context) scope.emplace(*context, parts[i].sequence);
    const Tensor logits = model.forward(b);
    nn::CrossEntropyResult loss = nn::cross_entropy(logits, train::token_tensor(b.targets, b.rows, b.length));
    const double share = total ? double(loss.count) / double(total) : 0.0;
    train::scale_gradient(loss.dlogits, share);
    if (i + 1 == parts.size()) {  // the gradients become final in this one
      nn::GradientsReadyScope ready([&](const std::vector<nn::NamedParameter>& ps) { reducer.ready(ps); });
      model.backward(loss.dlogits);
    } else {
      model.backward(loss.dlogits);
    }
    sums[0] += loss.loss * share, sums[1] += double(loss.count), sums[2] += double(loss.correct);
    sums[3] += double(parts[i].tokens);
  }
  reducer.finish();
  all_reduce(world, sums, 4);
  return {.loss = sums[0], .count = int64_t(sums[1]), .correct = int64_t(sums[2]), .tokens = int64_t(sums[3])};
}

}  // namespace detail

train::StepLoss data_parallel_gradients(train::TaskModel& model, Communicator& comm, GradientReducer& reducer,
                                        const std::vector<train::Example>& examples, int64_t micro) {
  std::vector<detail::StepPart> parts;
  for (train::Batch& b : detail::shared_batches(model, examples, micro, comm.rank(), comm.size(),
                                                "mha::dist::data_parallel_gradients")) {
    const int64_t tokens = b.rows * (b.source_length + b.length);
    parts.push_back({std::move(b), tokens});
  }
  return detail::reduced_step(model, comm, reducer, parts, nullptr);
}

train::Evaluation data_parallel_evaluate(train::TaskModel& model, Communicator& comm,
                                         const std::vector<train::Example>& examples) {
  const Share s = share_of(int64_t(examples.size()), comm.rank(), comm.size());
  const train::Evaluation mine =
      train::evaluate(model, {examples.begin() + s.begin, examples.begin() + s.end});
  int64_t counts[4] = {mine.examples, mine.exact, mine.tokens, mine.right_tokens};
  all_reduce(comm, counts, 4);
  if (counts[0] == 0) return {};
  return {.exact_match = double(counts[1]) / double(counts[0]),
          .token_accuracy = counts[2] > 0 ? double(counts[3]) / double(counts[2]) : 0.0,
          .examples = counts[0], .exact = counts[1], .tokens = counts[2], .right_tokens = counts[3]};
}

}  // namespace mha::dist
