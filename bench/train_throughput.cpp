// Training throughput of `mha train`'s decoder-only model on copy-task
// sequences, step by step through train::train (what a user's run does),
// for the four configurations of bench/torch_train.py:
//   small  d 64,  4 heads, 2 layers, ff 256,  batch 32, inputs 10–20 (~43 tokens)
//   mid    d 256, 8 heads, 4 layers, ff 1024, batch 16, inputs 64    (131 tokens)
//   wide   d 512, 8 heads, 6 layers, ff 2048, batch 8,  inputs 253   (509 tokens)
//   long   d 256, 4 heads, 2 layers, ff 1024, batch 2,  inputs 1018  (2039 tokens)
// Prints one JSON line: median tokens/s over the timed steps (padded tokens,
// evaluation excluded), the step's GFLOP/s and its share of the FP32 FMA peak
// measured here, the memory bandwidth measured here (copy_gbs: a run bound by
// memory, as PyTorch's long step is, moves with it on a shared host), and the
// peak resident memory the steps add.
//
// FLOPs per token: 6 × dense parameters (the layers' and the head's matrices:
// 2 forward, 4 backward) plus causal attention's 4·D·(T+1)/2 per layer
// forward (QKᵀ and PV over the visible pairs), × 3.5 with backward.
//
//   build/bench/train_throughput --config mid [--steps 20] [--warmup 3] [--precision bf16-mixed]
//                                [--score-memory-mib M]
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <string>

#include "cpu/flash/dispatch.h"
#include "cpu/gemm.h"
#include "measure.h"
#include "mha/memory.h"
#include "mha/nn/multihead_attention.h"
#include "mha/train/trainer.h"
#include "peak.h"

namespace {

struct ModelShape {
  int64_t d_model, heads, layers, ff, batch, min_length, max_length;
};

const std::map<std::string, ModelShape> kConfigs = {
    {"small", {64, 4, 2, 256, 32, 10, 20}},
    {"mid", {256, 8, 4, 1024, 16, 64, 64}},
    {"wide", {512, 8, 6, 2048, 8, 253, 253}},
    {"long", {256, 4, 2, 1024, 2, 1018, 1018}},
};

}  // namespace

int main(int argc, char** argv) try {
  using namespace mha;
  CLI::App app{"Training tokens/s of mha's decoder-only model"};
  std::string config = "mid", precision = "float32";
  int steps = 20, warmup = 3;
  app.add_option("--config", config, "small, mid, wide or long")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--precision", precision, "float32 or bf16-mixed")->capture_default_str();
  int64_t score_mib = -1;
  app.add_option("--score-memory-mib", score_mib,
                 "MiB each attention call may keep its scores in for the backward (nn::set_score_memory_limit; "
                 "-1: the library's default)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (score_mib >= 0) nn::set_score_memory_limit(score_mib << 20);
  const auto found = kConfigs.find(config);
  if (found == kConfigs.end()) {
    std::fprintf(stderr, "train_throughput: --config: expected small, mid, wide or long; got %s\n", config.c_str());
    return 2;
  }
  const ModelShape& s = found->second;

  nn::LanguageModelConfig model_config{.vocab_size = train::kVocab, .d_model = s.d_model, .nhead = s.heads,
                                       .num_layers = s.layers, .dim_feedforward = s.ff,
                                       .precision = nn::parse_precision(precision)};
  const train::TaskConfig task{.task = train::Task::copy, .min_length = s.min_length, .max_length = s.max_length,
                               .heldout = 2};
  train::TrainConfig tc{.steps = warmup + steps, .batch_size = s.batch, .eval_every = 0, .stop_when_perfect = false};
  Generator gen(tc.seed);
  auto model = train::make_task_model(train::Architecture::decoder, model_config, 0, gen);
  const train::TaskData data(task, tc.seed);

  const int64_t dense = bench::dense_parameters(model->named_parameters());

  std::vector<double> step_seconds, step_tokens;
  double last_elapsed = 0, last_tokens = 0;
  const auto on_progress = [&](const train::TrainProgress& p) {
    const double tokens = p.tokens_per_second * p.elapsed_seconds;
    if (p.step > warmup) step_seconds.push_back(p.elapsed_seconds - last_elapsed), step_tokens.push_back(tokens - last_tokens);
    last_elapsed = p.elapsed_seconds, last_tokens = tokens;
  };
  reset_peak_memory();
  const double extra_mib = bench::peak_extra_mib([&] { train::train(*model, data, tc, on_progress); });

  std::vector<double> rates, flops;
  for (size_t i = 0; i < step_seconds.size(); ++i) {
    const double tokens = step_tokens[i], T = tokens / double(s.batch);
    rates.push_back(tokens / step_seconds[i]);
    flops.push_back(bench::step_flops(tokens, T, dense, s.d_model, s.layers) / step_seconds[i]);
  }
  std::sort(rates.begin(), rates.end());
  std::sort(flops.begin(), flops.end());
  const int threads = omp_get_max_threads();
  // The peak of the vectors the kernels run on (MHA_ISA=avx2 on an AVX-512
  // CPU: 256-bit FMAs), and the CPU's own widest, both named.
  const bool avx512_kernels = cpu::active_isa() == cpu::Isa::avx512;
  const double peak = bench::fma_peak_gflops(threads, avx512_kernels);
  const double gflops = flops[flops.size() / 2] / 1e9, copy_gbs = bench::copy_bandwidth_gbs(threads);
  std::printf("{\"system\": \"mha\", \"config\": \"%s\", \"precision\": \"%s\", \"threads\": %d, \"tokens_per_second\": %.1f, "
              "\"gflops\": %.2f, \"peak_gflops\": %.1f, \"percent_of_peak\": %.1f, \"copy_gbs\": %.1f, \"peak_extra_mib\": %.1f, "
              "\"peak_tensor_mib\": %.1f, \"score_memory_mib\": %lld, \"dense_parameters\": %lld, \"cpu\": \"%s\", \"cpu_isa\": \"%s\", \"kernels\": \"%s\", \"gemm\": \"%s\"}\n",
              config.c_str(), precision.c_str(), threads, rates[rates.size() / 2], gflops, peak, 100 * gflops / peak, copy_gbs,
              extra_mib, double(peak_memory()) / (1 << 20), (long long)(nn::score_memory_limit() >> 20), (long long)dense, bench::cpu_name().c_str(),
              __builtin_cpu_supports("avx512f") ? "AVX-512" : "AVX2", cpu::to_string(cpu::active_isa()).c_str(),
              cpu::to_string(cpu::sgemm_backend()).c_str());
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
