// The communicator and data-parallel training, on the job's communicator:
// ctest runs this program under mpirun -np 2, 3 and 4 (and once alone, where
// every collective is a copy). Every rank runs every test in the same order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include "mha/dist/data_parallel.h"
#include "mha/errors.h"
#include "mha/train/task_model.h"

namespace mha {
namespace {

using dist::Communicator;

Communicator& comm() { return dist::world(); }

// Bits of a buffer folded into 64 (FNV-1a): equal on every rank or not.
uint64_t fingerprint(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Whether every rank holds the same `value`.
bool same_on_every_rank(uint64_t value) {
  std::vector<int64_t> all(static_cast<size_t>(comm().size()));
  const auto mine = int64_t(value);
  comm().all_gather(&mine, all.data(), 1, DType::int64);
  return std::all_of(all.begin(), all.end(), [&](int64_t v) { return v == mine; });
}

TEST(Communicator, AllReduceSumsAndLeavesTheSameBitsEverywhere) {
  const int P = comm().size(), r = comm().rank();
  for (int64_t n : {0, 1, 2, 3, 7, 1001}) {
    std::vector<double> x(static_cast<size_t>(n));
    std::vector<float> f(static_cast<size_t>(n));
    std::vector<int64_t> k(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      x[size_t(i)] = 1.0 / double(r + 1) + double(i) * 1e-3;
      f[size_t(i)] = float(x[size_t(i)]);
      k[size_t(i)] = (r + 1) * 1000 + i;
    }
    dist::all_reduce(comm(), x.data(), n);
    dist::all_reduce(comm(), f.data(), n);
    dist::all_reduce(comm(), k.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      double want = 0;
      for (int q = 0; q < P; ++q) want += 1.0 / double(q + 1) + double(i) * 1e-3;
      ASSERT_NEAR(x[size_t(i)], want, 1e-12) << "n " << n << " i " << i;
      ASSERT_NEAR(f[size_t(i)], want, 1e-5) << "n " << n << " i " << i;
      ASSERT_EQ(k[size_t(i)], 1000 * P * (P + 1) / 2 + P * i);
    }
    EXPECT_TRUE(same_on_every_rank(fingerprint(f.data(), f.size() * sizeof(float)))) << n;
  }
}

TEST(Communicator, AllReduceSendsTheRingsShareOfTheBuffer) {
  const int P = comm().size();
  std::vector<float> x(1 << 16, 1.0f);
  comm().reset_bytes_sent();
  dist::all_reduce(comm(), x.data(), int64_t(x.size()));
  const double want = 2.0 * (P - 1) / P * double(x.size() * sizeof(float));
  EXPECT_NEAR(double(comm().bytes_sent()), want, 0.01 * want + 1);
  EXPECT_EQ(x[12345], float(P));
}

TEST(Communicator, BackgroundAllReducesFinishInAnyOrderOfWaiting) {
  const int P = comm().size();
  std::vector<std::vector<double>> buffers(5);
  std::vector<std::unique_ptr<dist::Request>> requests;
  for (size_t b = 0; b < buffers.size(); ++b) {
    buffers[b].assign(size_t(1000 + 333 * b), double(b + 1) * (comm().rank() + 1));
    requests.push_back(comm().all_reduce_start(buffers[b].data(), int64_t(buffers[b].size()), DType::float64));
  }
  for (size_t b = buffers.size(); b-- > 0;) requests[b]->wait();
  for (size_t b = 0; b < buffers.size(); ++b) {
    EXPECT_TRUE(requests[b]->test());
    EXPECT_EQ(buffers[b].back(), double(b + 1) * P * (P + 1) / 2);
  }
}

TEST(Communicator, CollectivesAndTheRing) {
  const int P = comm().size(), r = comm().rank();
  // all_gather: rank q contributes {q, q + 0.5}.
  const double mine[2] = {double(r), r + 0.5};
  std::vector<double> gathered(size_t(2 * P));
  comm().all_gather(mine, gathered.data(), 2, DType::float64);
  for (int q = 0; q < P; ++q) EXPECT_EQ(gathered[size_t(2 * q + 1)], q + 0.5);
  // reduce_scatter: block q of the sum lands on rank q.
  std::vector<float> blocks(size_t(3 * P));
  for (int i = 0; i < 3 * P; ++i) blocks[size_t(i)] = float(i + r);
  float got[3];
  comm().reduce_scatter(blocks.data(), got, 3, DType::float32);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(got[i], float(P * (3 * r + i) + P * (P - 1) / 2));
  // all_to_all: block q from rank r holds 100 r + q.
  std::vector<int64_t> out(static_cast<size_t>(P)), in(static_cast<size_t>(P));
  for (int q = 0; q < P; ++q) out[size_t(q)] = 100 * r + q;
  comm().all_to_all(out.data(), in.data(), 1, DType::int64);
  for (int q = 0; q < P; ++q) EXPECT_EQ(in[size_t(q)], 100 * q + r);
  // send_receive around the ring: each rank receives its left neighbour's rank.
  int64_t token = r, received = -1;
  comm().send_receive(&token, 1, (r + 1) % P, &received, 1, (r + P - 1) % P, DType::int64, 7);
  EXPECT_EQ(received, (r + P - 1) % P);
  comm().barrier();
}

TEST(Communicator, RefusesWhatItCannotDo) {
  if (comm().size() == 1) {
    int64_t x = 0;
    EXPECT_THROW(comm().send(&x, 1, DType::int64, 1, 0), ValueError);
  }
  bfloat16 b[2];
  EXPECT_THROW(comm().all_reduce(b, 2, DType::bfloat16), DtypeError);
}

TEST(DataParallel, SharesCoverTheBatchOnce) {
  for (int P : {1, 2, 3, 4, 7})
    for (int64_t n : {0, 1, 5, 32, 33}) {
      int64_t next = 0;
      for (int r = 0; r < P; ++r) {
        const dist::Share s = dist::share_of(n, r, P);
        EXPECT_EQ(s.begin, next);
        EXPECT_LE(s.end - s.begin, n / P + 1);
        EXPECT_GE(s.end - s.begin, n / P);
        next = s.end;
      }
      EXPECT_EQ(next, n);
    }
  EXPECT_THROW(dist::share_of(4, 2, 2), ValueError);
}

nn::LanguageModelConfig model_config(DType dtype) {
  nn::LanguageModelConfig c;
  c.vocab_size = train::kVocab, c.d_model = 16, c.nhead = 2, c.num_layers = 2, c.dim_feedforward = 32;
  c.dtype = dtype;
  return c;
}

std::unique_ptr<train::TaskModel> make_model(train::Architecture arch, DType dtype) {
  Generator gen(11);
  return train::make_task_model(arch, model_config(dtype), arch == train::Architecture::encoder_decoder ? 2 : 0, gen);
}

std::vector<nn::NamedParameter> flat_parameters(train::TaskModel& model) {
  std::vector<nn::NamedParameter> params = model.named_parameters();
  nn::flatten_parameters(params);
  return params;
}

// Data-parallel gradients of the global batch against one process's, in
// every architecture, in float64 and float32, with batches P does not divide
// and with several micro-batches a step.
TEST(DataParallel, GradientsEqualOneProcessGradients) {
  const train::TaskData data({.task = train::Task::reverse, .min_length = 3, .max_length = 9, .heldout = 8}, 4);
  for (train::Architecture arch :
       {train::Architecture::decoder, train::Architecture::encoder_decoder, train::Architecture::encoder})
    for (DType dtype : {DType::float64, DType::float32})
      for (auto [batch, micro] : {std::pair<int64_t, int64_t>{7, 7}, {12, 5}, {2, 2}}) {
        SCOPED_TRACE(train::to_string(arch) + " " + to_string(dtype) + " batch " + std::to_string(batch) +
                     " micro " + std::to_string(micro));
        Generator gen(5);
        std::vector<train::Example> examples;
        for (int64_t i = 0; i < batch; ++i) examples.push_back(data.sample(gen));
        auto alone = make_model(arch, dtype), parallel = make_model(arch, dtype);
        std::vector<nn::NamedParameter> pa = flat_parameters(*alone), pp = flat_parameters(*parallel);
        const train::StepLoss want = train::accumulate_gradients(*alone, examples, micro);
        dist::GradientReducer reducer(comm(), pp, 4096);  // small buckets: many of them
        const train::StepLoss got = dist::data_parallel_gradients(*parallel, comm(), reducer, examples, micro);
        EXPECT_EQ(got.count, want.count);
        EXPECT_EQ(got.correct, want.correct);
        EXPECT_NEAR(got.loss, want.loss, (dtype == DType::float64 ? 1e-12 : 1e-6) * want.loss);
        const Tensor a = nn::flat_parameters_of(pa)->grads.to(DType::float64);
        const Tensor b = nn::flat_parameters_of(pp)->grads.to(DType::float64);
        const double* x = a.data<double>();
        const double* y = b.data<double>();
        double largest = 0, worst = 0;
        for (int64_t i = 0; i < a.numel(); ++i) largest = std::max(largest, std::abs(x[i]));
        for (int64_t i = 0; i < a.numel(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
        EXPECT_LE(worst, (dtype == DType::float64 ? 1e-6 : 1e-5) * largest) << "largest " << largest;
        EXPECT_GT(largest, 0.0);
        const Tensor g = nn::flat_parameters_of(pp)->grads;
        EXPECT_TRUE(same_on_every_rank(fingerprint(g.raw_data(), size_t(g.numel() * dtype_size(g.dtype())))));
      }
}

// The reducer's buckets start while backward goes on, and each rank sends
// 2 (P − 1) / P of the gradient bytes a step.
TEST(DataParallel, BucketsStartDuringBackwardAndSendTheRingsBytes) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 4, .max_length = 8, .heldout = 8}, 2);
  auto model = make_model(train::Architecture::decoder, DType::float32);
  std::vector<nn::NamedParameter> params = flat_parameters(*model);
  dist::GradientReducer reducer(comm(), params, 8 << 10);
  Generator gen(1);
  std::vector<train::Example> examples;
  for (int i = 0; i < 8; ++i) examples.push_back(data.sample(gen));
  comm().reset_bytes_sent();
  const int64_t before = comm().bytes_sent();
  dist::data_parallel_gradients(*model, comm(), reducer, examples, 8);
  const int P = comm().size();
  const double want = 2.0 * (P - 1) / P * double(reducer.gradient_bytes());
  EXPECT_NEAR(double(comm().bytes_sent() - before), want, 0.01 * want + 1);
  const dist::BucketTimeline& t = reducer.timeline();
  ASSERT_GT(reducer.buckets(), 2);
  ASSERT_EQ(int64_t(t.start.size()), reducer.buckets());
  EXPECT_EQ(std::accumulate(t.elements.begin(), t.elements.end(), int64_t(0)) * 4, reducer.gradient_bytes());
  // The layers' buckets start before backward ends; the embedding's at its end.
  EXPECT_LT(t.start.front(), t.backward_end);
  EXPECT_LE(t.backward_end, t.done);
}

// 50 steps of data-parallel training against one process's: the loss within
// 1e-5, and the same parameters on every rank.
TEST(DataParallel, FiftyStepsTrainAsOneProcess) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 3, .max_length = 7, .heldout = 16}, 3);
  train::TrainConfig config{.steps = 50, .batch_size = 9, .lr = 3e-3, .warmup = 5, .seed = 2, .eval_every = 25,
                            .stop_when_perfect = false};
  auto alone = make_model(train::Architecture::decoder, DType::float32);
  const train::TrainResult want = train::train(*alone, data, config);
  auto parallel = make_model(train::Architecture::decoder, DType::float32);
  config.communicator = &comm();
  config.bucket_bytes = 16 << 10;
  const train::TrainResult got = train::train(*parallel, data, config);
  EXPECT_EQ(got.steps, 50);
  EXPECT_NEAR(got.final_loss, want.final_loss, 1e-5 * want.final_loss);
  EXPECT_EQ(got.heldout_exact_match, want.heldout_exact_match);
  const auto flat = nn::flat_parameters_of(parallel->named_parameters());
  ASSERT_TRUE(flat);
  EXPECT_TRUE(same_on_every_rank(fingerprint(flat->values.raw_data(), size_t(flat->numel) * 4)));
  double worst = 0;
  const auto ref = nn::flat_parameters_of(alone->named_parameters());
  for (int64_t i = 0; i < flat->numel; ++i)
    worst = std::max(worst, double(std::abs(flat->values.data<float>()[i] - ref->values.data<float>()[i])));
  // Not the same bits as one process's: AdamW's step is about ±lr for a
  // gradient near zero whatever its size, so rounding-level differences of
  // such gradients move a parameter by up to lr a step (here 8e-4 at most
  // against 50 · 3e-3). Still far below what other data would do.
  EXPECT_LT(worst, 0.05 * config.lr * double(config.steps));
}

TEST(DataParallel, RefusesWhatItCannotRun) {
  auto model = make_model(train::Architecture::decoder, DType::float32);
  std::vector<nn::NamedParameter> loose = model->named_parameters();
  EXPECT_THROW(dist::GradientReducer(comm(), loose, 1 << 20), ValueError);
  std::vector<nn::NamedParameter> params = flat_parameters(*model);
  EXPECT_THROW(dist::GradientReducer(comm(), params, 0), ValueError);
}

}  // namespace
}  // namespace mha
