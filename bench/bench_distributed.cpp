// What can be measured of distributed training on one machine, run under
// mpirun -np P (docs/distributed.md); rank 0 prints JSON lines.
//
//   --allreduce        the ring all-reduce's time against message size (8 B to
//                      16 MiB), medians; bytes sent per rank, counted
//   --train CONFIG     data-parallel steps of train_throughput's CONFIG model
//                      (small, mid, wide): step time, compute rate, bytes sent
//                      per rank against 2 (P − 1) / P of the gradient, and the
//                      bucket timeline (first all-reduce start against the end
//                      of backward)
//   --ring L           ring attention forward + backward over a sequence of L
//                      (B 1, 4 heads, E 64, causal), zigzag and contiguous:
//                      per-rank seconds and visible pairs, bytes sent
//   --memory L         a context-parallel training step over one sequence of
//                      about L tokens with C = P: each rank's peak tensor memory
#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>

#include "measure.h"
#include "mha/dist/context_parallel.h"
#include "mha/memory.h"
#include "mha/random.h"

namespace {

using namespace mha;

struct ModelShape {
  int64_t d_model, heads, layers, ff, batch, length;
};
const std::map<std::string, ModelShape> kConfigs = {
    {"small", {64, 4, 2, 256, 32, 15}}, {"mid", {256, 8, 4, 1024, 16, 64}}, {"wide", {512, 8, 6, 2048, 8, 253}}};

dist::Communicator& world() { return dist::world(); }
bool root() { return world().rank() == 0; }

// Every rank's value, gathered.
std::vector<double> gather(double x) {
  std::vector<double> all(static_cast<size_t>(world().size()));
  world().all_gather(&x, all.data(), 1, DType::float64);
  return all;
}
double largest(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}

void all_reduce_sweep(int reps) {
  for (int64_t bytes = 8; bytes <= (int64_t(64) << 20); bytes *= 8) {
    std::vector<float> x(size_t(bytes / 4), 1.0f);
    world().barrier();
    world().reset_bytes_sent();
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      world().barrier();
      t.push_back(bench::seconds_of([&] { dist::all_reduce(world(), x.data(), int64_t(x.size())); }));
    }
    std::sort(t.begin(), t.end());
    const double slowest = largest(gather(t[t.size() / 2]));  // a collective ends when its last rank does
    const double sent = double(world().bytes_sent()) / reps;
    if (root())
      std::printf("{\"bench\": \"allreduce\", \"ranks\": %d, \"bytes\": %lld, \"seconds\": %.3e, \"sent_per_rank\": "
                  "%.0f, \"ring_share\": %.4f}\n",
                  world().size(), (long long)bytes, slowest, sent, sent / double(bytes));
  }
}

void train_steps(const std::string& name, int steps, double bucket_mib) {
  const ModelShape& s = kConfigs.at(name);
  nn::LanguageModelConfig mc{.vocab_size = train::kVocab, .d_model = s.d_model, .nhead = s.heads,
                             .num_layers = s.layers, .dim_feedforward = s.ff};
  Generator gen(1);
  auto model = train::make_task_model(train::Architecture::decoder, mc, 0, gen);
  std::vector<nn::NamedParameter> params = model->named_parameters();
  nn::flatten_parameters(params);
  dist::GradientReducer reducer(world(), params, int64_t(bucket_mib * (1 << 20)));
  const train::TaskData data({.task = train::Task::copy, .min_length = s.length, .max_length = s.length, .heldout = 2}, 1);
  const int64_t dense = bench::dense_parameters(params);
  for (int step = 0; step < steps + 1; ++step) {
    std::vector<train::Example> examples;
    for (int64_t i = 0; i < s.batch; ++i) examples.push_back(data.sample(gen));
    world().barrier();
    world().reset_bytes_sent();
    train::StepLoss loss;
    const double seconds = bench::seconds_of(
        [&] { loss = dist::data_parallel_gradients(*model, world(), reducer, examples, s.batch); });
    const double sent = double(world().bytes_sent());
    const dist::BucketTimeline& t = reducer.timeline();
    const double T = double(loss.tokens) / double(s.batch);
    // This rank's share of the step's work, at this rank's pace.
    const double flops = bench::step_flops(double(loss.tokens) / world().size(), T, dense, s.d_model, s.layers);
    const std::vector<double> compute = gather(t.backward_end), all_seconds = gather(seconds);
    if (root() && step > 0)  // the first step warms the caches and the communication thread
      std::printf("{\"bench\": \"train\", \"config\": \"%s\", \"ranks\": %d, \"step_seconds\": %.4f, "
                  "\"compute_seconds_max\": %.4f, \"gflops_per_rank\": %.2f, \"gradient_bytes\": %lld, "
                  "\"sent_per_rank\": %.0f, \"sent_over_ring_bytes\": %.5f, \"buckets\": %lld, "
                  "\"first_bucket_start\": %.4f, \"backward_end\": %.4f, \"all_done\": %.4f, \"cpu\": \"%s\"}\n",
                  name.c_str(), world().size(), largest(all_seconds), largest(compute), flops / t.backward_end / 1e9,
                  (long long)reducer.gradient_bytes(), sent,
                  world().size() == 1 ? 0.0  // one rank sends nothing
                                      : sent / (2.0 * (world().size() - 1) / world().size() * double(reducer.gradient_bytes())),
                  (long long)reducer.buckets(), t.start.front(), t.backward_end, t.done, bench::cpu_name().c_str());
  }
}

void ring(int64_t L, int reps) {
  for (dist::RingLayout layout : {dist::RingLayout::zigzag, dist::RingLayout::contiguous}) {
    const auto rows = [&](uint64_t seed) {
      Generator g{seed};
      return dist::ring_shard(randn({1, 4, L, 64}, g, 0, 1, DType::float32), world(), layout);
    };
    const Tensor q = rows(1), k = rows(2), v = rows(3), dout = rows(4);
    dist::RingOptions o;
    o.layout = layout, o.length = L, o.causal = Causal::top_left;
    dist::RingWork work;
    o.work = &work;
    std::vector<double> t;
    int64_t sent = 0;
    for (int r = 0; r < reps; ++r) {
      world().barrier();
      const int64_t before = world().bytes_sent();
      t.push_back(bench::seconds_of([&] {
        const AttentionOutput f = dist::ring_attention_forward(world(), q, k, v, o);
        dist::ring_attention_backward(world(), dout, q, k, v, f, o);
      }));
      sent = world().bytes_sent() - before;
    }
    std::sort(t.begin(), t.end());
    const std::vector<double> seconds = gather(t[t.size() / 2]), pairs = gather(double(work.pairs));
    if (root())
      std::printf("{\"bench\": \"ring\", \"layout\": \"%s\", \"ranks\": %d, \"length\": %lld, \"seconds_max\": %.4f, "
                  "\"seconds_mean\": %.4f, \"pairs_max_over_mean\": %.4f, \"sent_per_rank\": %lld}\n",
                  layout == dist::RingLayout::zigzag ? "zigzag" : "contiguous", world().size(), (long long)L,
                  largest(seconds), mean(seconds), largest(pairs) / mean(pairs), (long long)sent);
  }
}

void memory(int64_t L) {
  nn::LanguageModelConfig mc{.vocab_size = train::kVocab, .d_model = 256, .nhead = 4, .num_layers = 2,
                             .dim_feedforward = 1024, .max_len = 2 * L + 8};
  Generator gen(1);
  auto model = train::make_task_model(train::Architecture::decoder, mc, 0, gen);
  std::vector<nn::NamedParameter> params = model->named_parameters();
  nn::flatten_parameters(params);
  dist::GradientReducer reducer(world(), params, 25 << 20);
  const dist::ContextGroups groups = dist::split_context(world(), world().size());
  const train::TaskData data({.task = train::Task::copy, .min_length = L / 2 - 1, .max_length = L / 2 - 1, .heldout = 2}, 1);
  const std::vector<train::Example> examples{data.sample(gen)};
  const int64_t before = peak_memory();
  reset_peak_memory();
  double seconds = bench::seconds_of(
      [&] { dist::context_parallel_gradients(*model, world(), groups, reducer, examples, 1); });
  const std::vector<double> peaks = gather(double(peak_memory() - before) / (1 << 20));
  const std::vector<double> all_seconds = gather(seconds);
  if (root())
    std::printf("{\"bench\": \"memory\", \"ranks\": %d, \"tokens\": %lld, \"peak_step_mib_max\": %.1f, "
                "\"peak_step_mib_mean\": %.1f, \"parameters_mib\": %.1f, \"step_seconds\": %.3f}\n",
                world().size(), (long long)(2 * (L / 2 - 1) + 3), largest(peaks), mean(peaks),
                double(reducer.gradient_bytes()) / (1 << 20), largest(all_seconds));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Distributed measurements on one machine (run under mpirun)"};
  bool allreduce = false;
  std::string config;
  int64_t ring_length = 0, memory_length = 0;
  int steps = 3, reps = 5;
  double bucket_mib = 25;
  app.add_flag("--allreduce", allreduce, "The all-reduce's time against message size");
  app.add_option("--train", config, "Data-parallel steps of this model: small, mid or wide");
  app.add_option("--ring", ring_length, "Ring attention over a sequence of this length");
  app.add_option("--memory", memory_length, "A context-parallel step's memory per rank for this sequence length");
  app.add_option("--steps", steps, "Timed training steps")->capture_default_str();
  app.add_option("--reps", reps, "Repetitions (medians)")->capture_default_str();
  app.add_option("--bucket-mb", bucket_mib, "All-reduce bucket size (MiB)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (allreduce) all_reduce_sweep(reps);
  if (!config.empty()) train_steps(config, steps, bucket_mib);
  if (ring_length > 0) ring(ring_length, reps);
  if (memory_length > 0) memory(memory_length);
  return 0;
}
