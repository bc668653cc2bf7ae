// Activation checkpointing: memory held between forward and backward, peak
// memory of a training step, and the step's time, with and without it, for
// the decoder-only and the encoder–decoder model (float32, dropout 0.1).
//   bench_checkpointing [--quick]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>

#include "cpu/allocator.h"
#include "measure.h"
#include "mha/mha.h"

using namespace mha;

namespace {

struct Figures {
  double held_mib = 0, peak_mib = 0, ms = 0;
};

double mib(size_t bytes) { return double(bytes) / (1 << 20); }

Tensor random_ids(int64_t B, int64_t L, int64_t vocab, Generator& gen) {
  const Tensor u = rand_uniform({B, L}, gen, 0.0, double(vocab), DType::float64);
  std::vector<double> ids = u.to_vector();
  for (double& x : ids) x = double(int64_t(x));
  return Tensor::from_values(ids, {B, L}, DType::int64);
}

// One step: forward (then `held` = what it keeps, the logits aside), loss, backward.
Figures measure(nn::Module& model, const std::function<Tensor()>& forward, const std::function<void(const Tensor&)>& backward,
                const Tensor& targets, int repeats) {
  Figures f;
  for (int r = 0; r < repeats + 1; ++r) {  // the first is a warm-up
    model.zero_grad();
    model.release_activations();  // the last step's
    cpu::reset_host_bytes_peak();
    const size_t before = cpu::host_bytes_in_use();
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor logits = forward();
    const size_t held = cpu::host_bytes_in_use() - before - size_t(logits.numel()) * dtype_size(logits.dtype());
    backward(nn::cross_entropy(logits, targets).dlogits);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (r == 0) continue;
    f.held_mib = mib(held);
    f.peak_mib = mib(cpu::host_bytes_peak() - before);
    f.ms += ms / repeats;
  }
  return f;
}

void row(const char* model, const std::string& layers, bool checkpoint, const Figures& f, const Figures& plain) {
  std::printf("| %-15s | %6s | %-3s | %9.1f | %9.1f | %8.1f | %s |\n", model, layers.c_str(), checkpoint ? "on" : "off",
              f.held_mib, f.peak_mib, f.ms,
              checkpoint ? (std::to_string(int(100 * f.ms / plain.ms + 0.5)) + "%").c_str() : "100%");
}

}  // namespace

int main(int argc, char** argv) try {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int64_t B = quick ? 4 : 16, L = quick ? 32 : 128, D = quick ? 64 : 256, vocab = 64, repeats = quick ? 1 : 3;
  std::printf("B %lld, L = S = T %lld, d_model %lld, 8 heads, feed-forward %lld, float32, dropout 0.1; MiB of tensors\n\n",
              (long long)B, (long long)L, (long long)D, (long long)(4 * D));
  std::printf("| model           | layers | ckpt | held (MiB) | peak (MiB) | step (ms) | time |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  Generator data(7);
  const Tensor src = random_ids(B, L, vocab, data), tgt = random_ids(B, L, vocab, data), targets = random_ids(B, L, vocab, data);
  for (int64_t layers : {4, 8}) {
    Figures plain;
    for (bool checkpoint : {false, true}) {
      const nn::LanguageModelConfig c{.vocab_size = vocab, .d_model = D, .nhead = 8, .num_layers = layers,
                                      .dim_feedforward = 4 * D, .dropout = 0.1, .checkpoint_activations = checkpoint};
      Generator g(1);
      nn::LanguageModel model(c, g);
      const Figures f = measure(model, [&] { return model.forward(tgt); }, [&](const Tensor& d) { model.backward(d); },
                                targets, int(repeats));
      if (!checkpoint) plain = f;
      row("decoder-only", std::to_string(layers), checkpoint, f, plain);
    }
  }
  for (int64_t layers : {4, 8}) {  // half in the encoder, half in the decoder
    Figures plain;
    for (bool checkpoint : {false, true}) {
      const nn::LanguageModelConfig c{.vocab_size = vocab, .d_model = D, .nhead = 8, .num_layers = layers / 2,
                                      .dim_feedforward = 4 * D, .dropout = 0.1, .checkpoint_activations = checkpoint};
      Generator g(1);
      nn::EncoderDecoderModel model({.decoder = c, .num_encoder_layers = layers / 2}, g);
      const Figures f = measure(model, [&] { return model.forward(src, tgt); },
                                [&](const Tensor& d) { model.backward(d); }, targets, int(repeats));
      if (!checkpoint) plain = f;
      row("encoder-decoder", std::to_string(layers / 2) + " + " + std::to_string(layers / 2), checkpoint, f, plain);
    }
  }
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
