// Timing and memory measurements shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace mha::bench {

inline double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline double median_seconds(int reps, const std::function<void()>& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) t.push_back(seconds_of(f));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

inline long status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
  return 0;
}

// Peak resident memory (MiB) that f adds beyond what is resident when it starts.
inline double peak_extra_mib(const std::function<void()>& f) {
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
  const long before = status_kib("VmRSS:");
  f();
  return double(status_kib("VmHWM:") - before) / 1024.0;
}

// A benchmark's main ends here on an error (a bad --config, a typed error of
// the library's): the message and exit status 1, not std::terminate's abort.
inline int failed(const char* program, const std::exception& e) {
  std::fprintf(stderr, "%s: %s\n", program, e.what());
  return 1;
}

inline std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// Parameters that are matrices of products (not embeddings, norms or biases).
template <class Params>
int64_t dense_parameters(const Params& params) {
  int64_t dense = 0;
  for (const auto& p : params)
    if (p.value->dim() == 2 && p.name.find("embedding") == std::string::npos) dense += p.value->numel();
  return dense;
}

// A decoder-only training step's FLOPs for `tokens` tokens in rows of length
// T: 6 × dense parameters a token (2 forward, 4 backward) plus causal
// attention's 4·D·(T+1)/2 a token and layer forward, × 3.5 with backward.
inline double step_flops(double tokens, double T, int64_t dense, int64_t d_model, int64_t layers) {
  return tokens * (6.0 * double(dense) + 3.5 * 4.0 * double(d_model) * (T + 1) / 2 * double(layers));
}

}  // namespace mha::bench
