// Timing and memory measurements shared by the benchmark programs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
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

inline std::string cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace mha::bench
