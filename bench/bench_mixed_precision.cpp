// Training throughput and activation memory, float32 against bf16-mixed, for
// the default model of `mha train --task copy` (d_model 64, 4 heads, 2
// layers, feed-forward 256; batch 32 of copy examples, lengths 10-20).
// Not a test: it prints a markdown table and asserts nothing.
//
//   bench_mixed_precision [--steps N] [--repeats R]
//
// Throughput: R rounds, each training two fresh models (same initialisation)
// side by side, one step of one and then the same step of the other on the
// same examples, so that the slow spells of a shared machine hit both alike.
// A step is what `mha train` times: gradients of the batch, clipping and the
// AdamW update. Tokens/s per step, medians over every step of every round
// but each round's first (the warm-up), with the quartiles.
// Memory: tensor memory (mha/memory.h) of the first forward and backward of
// a fresh model on a fixed batch, beyond the parameters, their gradients and
// (bf16-mixed) the bfloat16 weight copies: "held for backward" is what the
// forward and the loss leave alive (the activations saved for backward, the
// logits and their gradient), "peak" the most at any moment of the step.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/flash/dispatch.h"
#include "cpu/gemm.h"
#include "cpu/layers/layers.h"
#include "measure.h"
#include "mha/mha.h"
#include "mha/train/trainer.h"

using namespace mha;

namespace {

struct Memory {
  double held_mib = 0, peak_mib = 0;
};

nn::LanguageModelConfig default_model(nn::Precision precision) {
  return {.vocab_size = train::kVocab, .precision = precision};
}

Tensor ids_tensor(const std::vector<int64_t>& ids, int64_t rows, int64_t length) {
  Tensor t = Tensor::empty({rows, length}, DType::int64);
  std::copy(ids.begin(), ids.end(), t.data<int64_t>());
  return t;
}

// The first training step of a fresh model: layers keep what they saved
// until their next forward, so later steps would replace rather than add.
// The bfloat16 weight copies that a mixed forward makes (and keeps) are
// counted apart.
Memory step_memory(nn::Precision precision, const train::Batch& batch, int64_t weight_copy_bytes) {
  Generator g(1);
  nn::LanguageModel model(default_model(precision), g);
  const Tensor ids = ids_tensor(batch.ids, batch.rows, batch.length);
  const Tensor targets = ids_tensor(batch.targets, batch.rows, batch.length);
  const int64_t start = active_memory() + (precision == nn::Precision::bf16_mixed ? weight_copy_bytes : 0);
  reset_peak_memory();
  Memory m;
  {
    nn::CrossEntropyResult loss = nn::cross_entropy(model.forward(ids), targets);
    m.held_mib = double(active_memory() - start) / (1 << 20);
    model.backward(loss.dlogits);
  }
  m.peak_mib = double(peak_memory() - start) / (1 << 20);
  return m;
}

// The q-quantile of v (0.5: the median), from the sorted values.
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[size_t(q * double(v.size() - 1) + 0.5)];
}

double median(const std::vector<double>& v) { return quantile(v, 0.5); }

}  // namespace

int main(int argc, char** argv) try {
  int64_t steps = 60, repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--steps")) steps = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoll(argv[i + 1]);
  }
  const nn::Precision precisions[2] = {nn::Precision::float32, nn::Precision::bf16_mixed};
  const train::TaskConfig task{.task = train::Task::copy, .heldout = 16};
  const train::TaskData data(task, 0);
  std::printf("mha %s; attention kernels %s%s; %lld steps × %lld rounds, %d threads\n\n", std::string(version).c_str(),
              cpu::to_string(cpu::active_isa()).c_str(),
              __builtin_cpu_supports("avx512bf16") ? " (AVX512-BF16 present)" : "", (long long)steps,
              (long long)repeats, omp_get_max_threads());

  std::vector<double> rate[2];
  for (int64_t round = 0; round < repeats; ++round) {
    std::vector<std::unique_ptr<nn::LanguageModel>> models;
    std::vector<std::unique_ptr<optim::AdamW>> optimizers;
    for (nn::Precision precision : precisions) {
      Generator g(1);
      models.push_back(std::make_unique<nn::LanguageModel>(default_model(precision), g));
      optimizers.push_back(std::make_unique<optim::AdamW>(models.back()->named_parameters(), optim::AdamWConfig{}));
    }
    const train::TrainConfig c;
    Generator gen{uint64_t(round)};
    for (int64_t step = 0; step < steps; ++step) {
      std::vector<train::Example> examples;
      for (int64_t i = 0; i < c.batch_size; ++i) examples.push_back(data.sample(gen));
      for (int p = 0; p < 2; ++p) {
        const auto t0 = std::chrono::steady_clock::now();
        optimizers[p]->set_lr(optim::warmup_cosine(step, c.warmup, c.steps, c.lr, c.min_lr));
        train::DecoderOnly task_model(*models[p]);
        const train::StepLoss loss = train::accumulate_gradients(task_model, examples, c.batch_size);
        const std::vector<nn::NamedParameter> params = models[p]->named_parameters();
        optim::clip_grad_norm(params, c.clip);
        optimizers[p]->step();
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (step > 0) rate[p].push_back(double(loss.tokens) / seconds);
      }
    }
    std::printf("round %lld: median tokens/s float32 %.0f, bf16-mixed %.0f so far\n", (long long)round, median(rate[0]),
                median(rate[1]));
  }

  Generator g(2);
  std::vector<train::Example> examples;
  for (int i = 0; i < 32; ++i) examples.push_back(data.sample(g));
  const train::Batch batch = train::make_batch(examples);
  // The rounding of every weight that one mixed forward does.
  Generator init(1);
  nn::LanguageModel model(default_model(nn::Precision::float32), init);
  int64_t weights = 0;
  for (const nn::NamedParameter& p : model.named_parameters())
    if (p.value->dim() == 2 && p.name.find("embedding") == std::string::npos) weights += p.value->numel();
  std::vector<float> w(size_t(weights), 0.5f);
  std::vector<bfloat16> w16(w.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 100; ++r) cpu::round_to_bf16(w.data(), w16.data(), weights);
  const double round_us = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 100 * 1e6;

  std::printf("\nbatch 32 × %lld tokens; %lld weights in matrix products (rounded in %.0f µs per mixed forward)\n\n",
              (long long)batch.length, (long long)weights, round_us);
  std::printf("| precision | tokens/s per step, median (quartiles) | held for backward, MiB | peak in a step, MiB |\n"
              "|---|---|---|---|\n");
  for (int p = 0; p < 2; ++p) {
    const Memory m = step_memory(precisions[p], batch, 2 * weights);
    std::printf("| %s | %.0f (%.0f–%.0f) | %.2f | %.2f |\n", nn::to_string(precisions[p]).c_str(), median(rate[p]),
                quantile(rate[p], 0.25), quantile(rate[p], 0.75), m.held_mib, m.peak_mib);
  }
  std::printf("\nbf16-mixed / float32, medians of the per-step ratio: %.2f\n", [&] {
    std::vector<double> ratio;
    for (size_t i = 0; i < rate[0].size(); ++i) ratio.push_back(rate[1][i] / rate[0][i]);
    return median(ratio);
  }());
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
