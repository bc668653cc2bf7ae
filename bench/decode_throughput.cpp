// Greedy decoding throughput of `mha generate`'s path: the decoder-only model
// of bench/train_throughput (same configurations), in eval mode, reads a batch
// of copy-task prompts (BOS x SEP) in one step and then decodes --new tokens
// one at a time with its KV cache. Prints one JSON line: tokens/s of the
// prompt's step (prefill) and of the one-token steps after it (decode),
// medians of --reps.
// bench/torch_train.py --decode N runs the same in PyTorch (nn.TransformerEncoder
// has no KV cache: its greedy loop runs the whole sequence each step).
//   build/bench/decode_throughput --config mid [--new 32] [--reps 5] [--precision bf16-mixed]
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "measure.h"
#include "mha/nn/language_model.h"
#include "mha/train/tasks.h"

int main(int argc, char** argv) try {
  using namespace mha;
  CLI::App app{"Greedy decoding tokens/s of mha's decoder-only model with its KV cache"};
  std::string config = "mid", precision = "float32";
  int new_tokens = 32, reps = 5;
  app.add_option("--config", config, "small, mid, wide or long")->capture_default_str();
  app.add_option("--new", new_tokens, "Tokens to generate after the prompt")->capture_default_str();
  app.add_option("--reps", reps, "Timed repetitions (median)")->capture_default_str();
  app.add_option("--precision", precision, "float32 or bf16-mixed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  struct ModelShape {
    int64_t d_model, heads, layers, ff, batch, input;
  };
  const std::map<std::string, ModelShape> configs = {{"small", {64, 4, 2, 256, 32, 20}},
                                                     {"mid", {256, 8, 4, 1024, 16, 64}},
                                                     {"wide", {512, 8, 6, 2048, 8, 253}},
                                                     {"long", {256, 4, 2, 1024, 2, 1018}}};
  const auto found = configs.find(config);
  if (found == configs.end()) {
    std::fprintf(stderr, "decode_throughput: --config: expected small, mid, wide or long; got %s\n", config.c_str());
    return 2;
  }
  const ModelShape& s = found->second;
  Generator gen(0);
  nn::LanguageModel model({.vocab_size = train::kVocab, .d_model = s.d_model, .nhead = s.heads, .num_layers = s.layers,
                           .dim_feedforward = s.ff, .precision = nn::parse_precision(precision)},
                          gen);
  model.eval();
  const int64_t prompt = s.input + 2;
  std::vector<int64_t> ids(size_t(s.batch * prompt));
  for (int64_t r = 0; r < s.batch; ++r) {
    ids[size_t(r * prompt)] = train::kBos;
    for (int64_t t = 0; t < s.input; ++t) ids[size_t(r * prompt + 1 + t)] = int64_t(gen.next_u64() % 10);
    ids[size_t(r * prompt + prompt - 1)] = train::kSep;
  }
  const Tensor prompts = train::token_tensor(ids, s.batch, prompt);
  // The prompt's step, then new − 1 steps of one token each: timed apart.
  double prefill = 0, decode = 0;
  auto generate = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    model.begin_decode();
    Tensor logits = model.decode_step(prompts);
    const auto t1 = std::chrono::steady_clock::now();
    for (int step = 0; step < new_tokens; ++step) {
      const int64_t T = logits.size(1), V = logits.size(2);
      std::vector<int64_t> next(static_cast<size_t>(s.batch));
      for (int64_t r = 0; r < s.batch; ++r) {
        const float* last = logits.data<float>() + (r * T + T - 1) * V;
        next[size_t(r)] = int64_t(std::max_element(last, last + V) - last);
      }
      if (step + 1 < new_tokens) logits = model.decode_step(train::token_tensor(next, s.batch, 1));
    }
    prefill = std::chrono::duration<double>(t1 - t0).count();
    decode = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  };
  generate();  // warm-up
  std::vector<double> prefills, decodes;
  for (int r = 0; r < reps; ++r) generate(), prefills.push_back(prefill), decodes.push_back(decode);
  std::sort(prefills.begin(), prefills.end());
  std::sort(decodes.begin(), decodes.end());
  std::printf("{\"system\": \"mha\", \"config\": \"%s\", \"precision\": \"%s\", \"threads\": %d, \"batch\": %lld, \"prompt\": %lld, \"new\": %d, "
              "\"prefill_tokens_per_second\": %.1f, \"decode_tokens_per_second\": %.1f, \"cpu\": \"%s\"}\n",
              config.c_str(), precision.c_str(), omp_get_max_threads(), (long long)s.batch, (long long)prompt, new_tokens,
              double(s.batch * prompt) / prefills[prefills.size() / 2],
              double(s.batch * (new_tokens - 1)) / decodes[decodes.size() / 2], bench::cpu_name().c_str());
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
