// Context parallelism: models trained with their sequences spread over ranks
// (ring attention) against one process. ctest runs this program under mpirun
// -np 2, 3 and 4 (and once alone); each test tries C = P ranks a sequence
// and, where P is even, C = 2 with P / 2 data-parallel groups.
#include <gtest/gtest.h>

#include <cmath>

#include "mha/dist/context_parallel.h"
#include "mha/errors.h"
#include "mha/train/task_model.h"

namespace mha {
namespace {

dist::Communicator& comm() { return dist::world(); }

std::vector<int> context_sizes() {
  const int P = comm().size();
  std::vector<int> sizes{P};
  if (P % 2 == 0 && P > 2) sizes.push_back(2);
  return sizes;
}

std::unique_ptr<train::TaskModel> make_model(train::Architecture arch, DType dtype, nn::Position position) {
  nn::LanguageModelConfig c;
  c.vocab_size = train::kVocab, c.d_model = 16, c.nhead = 2, c.num_layers = 2, c.dim_feedforward = 32;
  c.dtype = dtype, c.position = position, c.max_len = 64;
  Generator gen(13);
  return train::make_task_model(arch, c, 0, gen);
}

std::vector<nn::NamedParameter> flat(train::TaskModel& model) {
  std::vector<nn::NamedParameter> params = model.named_parameters();
  nn::flatten_parameters(params);
  return params;
}

TEST(ContextParallel, ShardsOfABatchHoldEveryColumnOnce) {
  train::Batch b;
  b.rows = 2, b.length = 7;
  for (int64_t i = 0; i < 14; ++i) b.ids.push_back(20 + i), b.targets.push_back(100 + i);  // no PAD among them
  for (int C : {1, 2, 3}) {
    std::vector<int> seen(14, 0);
    for (int r = 0; r < C; ++r) {
      const train::Batch part = dist::shard_batch(b, r, C);
      EXPECT_EQ(part.length, dist::ring_block_length(7, C, dist::RingLayout::zigzag));
      for (size_t i = 0; i < part.ids.size(); ++i) {
        if (part.ids[i] == train::kPad) {
          EXPECT_EQ(part.targets[i], -100);
          continue;
        }
        ++seen[size_t(part.ids[i] - 20)];
        EXPECT_EQ(part.targets[i], 80 + part.ids[i]);
      }
    }
    for (int n : seen) EXPECT_EQ(n, 1) << C;
  }
}

TEST(ContextParallel, GradientsEqualOneProcessGradients) {
  const train::TaskData data({.task = train::Task::reverse, .min_length = 3, .max_length = 11, .heldout = 8}, 6);
  for (int C : context_sizes())
    for (train::Architecture arch : {train::Architecture::decoder, train::Architecture::encoder})
      for (nn::Position position : {nn::Position::sinusoidal, nn::Position::learned})
        for (DType dtype : {DType::float64, DType::float32}) {
          SCOPED_TRACE("C " + std::to_string(C) + " " + train::to_string(arch) + " " + nn::to_string(position) + " " +
                       to_string(dtype));
          Generator gen(9);
          std::vector<train::Example> examples;
          for (int i = 0; i < 6; ++i) examples.push_back(data.sample(gen));
          auto alone = make_model(arch, dtype, position), spread = make_model(arch, dtype, position);
          std::vector<nn::NamedParameter> pa = flat(*alone), ps = flat(*spread);
          const train::StepLoss want = train::accumulate_gradients(*alone, examples, 4);
          const dist::ContextGroups groups = dist::split_context(comm(), C);
          dist::GradientReducer reducer(comm(), ps, 4096);
          const train::StepLoss got = dist::context_parallel_gradients(*spread, comm(), groups, reducer, examples, 4);
          EXPECT_EQ(got.count, want.count);
          EXPECT_NEAR(got.loss, want.loss, (dtype == DType::float64 ? 1e-12 : 1e-6) * want.loss);
          const Tensor a = nn::flat_parameters_of(pa)->grads.to(DType::float64);
          const Tensor b = nn::flat_parameters_of(ps)->grads.to(DType::float64);
          double largest = 0, worst = 0;
          for (int64_t i = 0; i < a.numel(); ++i) {
            largest = std::max(largest, std::abs(a.data<double>()[i]));
            worst = std::max(worst, std::abs(a.data<double>()[i] - b.data<double>()[i]));
          }
          EXPECT_GT(largest, 0.0);
          EXPECT_LE(worst, (dtype == DType::float64 ? 1e-6 : 1e-5) * largest);
        }
}

TEST(ContextParallel, FiftyStepsTrainAsOneProcess) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 3, .max_length = 9, .heldout = 16}, 3);
  train::TrainConfig config{.steps = 50, .batch_size = 6, .lr = 3e-3, .warmup = 5, .seed = 2, .eval_every = 25,
                            .stop_when_perfect = false};
  for (int C : context_sizes()) {
    auto alone = make_model(train::Architecture::decoder, DType::float32, nn::Position::sinusoidal);
    const train::TrainResult want = train::train(*alone, data, config);
    auto spread = make_model(train::Architecture::decoder, DType::float32, nn::Position::sinusoidal);
    train::TrainConfig parallel = config;
    parallel.communicator = &comm(), parallel.context_parallel = C, parallel.bucket_bytes = 16 << 10;
    const train::TrainResult got = train::train(*spread, data, parallel);
    EXPECT_NEAR(got.final_loss, want.final_loss, 1e-5 * want.final_loss) << "C " << C;
  }
}

TEST(ContextParallel, RefusesWhatTheRingCannotTake) {
  const train::TaskData data({.task = train::Task::copy, .min_length = 3, .max_length = 5, .heldout = 4}, 1);
  Generator gen(1);
  const std::vector<train::Example> examples{data.sample(gen), data.sample(gen)};
  for (nn::Position position : {nn::Position::rope, nn::Position::relative, nn::Position::alibi}) {
    auto model = make_model(train::Architecture::decoder, DType::float32, position);
    std::vector<nn::NamedParameter> params = flat(*model);
    const dist::ContextGroups groups = dist::split_context(comm(), comm().size());
    dist::GradientReducer reducer(comm(), params, 1 << 20);
    EXPECT_THROW(dist::context_parallel_gradients(*model, comm(), groups, reducer, examples, 2), ValueError)
        << nn::to_string(position);
  }
  EXPECT_THROW(dist::split_context(comm(), comm().size() + 1), ValueError);
  auto model = make_model(train::Architecture::decoder, DType::float32, nn::Position::sinusoidal);
  train::TrainConfig config{.steps = 1, .batch_size = 2};
  config.communicator = &comm(), config.context_parallel = comm().size() + 1;
  EXPECT_THROW(train::train(*model, data, config), ValueError);
}

}  // namespace
}  // namespace mha
