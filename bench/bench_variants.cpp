// Scaling of the efficient-attention variants against exact attention: time
// and peak extra memory of one forward+backward, float32, one head, E = 64,
// for L = 1k … 64k, and the fitted log-log slope of time against L.
// Not a test: it prints markdown tables and asserts nothing.
//
//   bench_variants                      every variant, L = 1024 … 65536
//   bench_variants --max-length 16384   stop at that length (--min-length: start at one)
//   bench_variants --exact-max 16384    skip exact attention beyond that length (it is O(L²))
//   bench_variants --only NAME,NAME     run only these variants
//
// Every (variant, L) runs in a fresh process (this program again with --case):
// memory freed by earlier cases cannot hide a peak, and the CPU allocator's
// cache of large blocks, which keeps up to 256 MiB of freed blocks for reuse at
// the same size, is not left full of blocks of other lengths (which made
// later lengths map fresh pages on every call). The first forward+backward
// gives the peak extra resident memory (beyond the inputs; outputs and
// gradients included); the timed runs follow it.
//
// Times are wall-clock and process CPU time (all threads, user + system).
// On a shared machine other jobs stretch wall time; CPU time counts only the
// work done (threads wait passively with OMP_WAIT_POLICY=PASSIVE), so its
// ratios are the steadier ones there.
#include <malloc.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "measure.h"
#include "mha/mha.h"

using namespace mha;
using namespace mha::bench;

namespace {

constexpr int64_t kHeadDim = 64;

// One variant at one length: forward() then backward() of the same inputs.
struct Case {
  virtual ~Case() = default;
  virtual void forward() = 0;
  virtual void backward() = 0;
};

template <class Forward, class Backward>
struct LambdaCase final : Case {
  Forward f;
  Backward b;
  LambdaCase(Forward f_, Backward b_) : f(std::move(f_)), b(std::move(b_)) {}
  void forward() override { f(); }
  void backward() override { b(); }
};

template <class Forward, class Backward>
std::unique_ptr<Case> make_case(Forward f, Backward b) {
  return std::make_unique<LambdaCase<Forward, Backward>>(std::move(f), std::move(b));
}

// q, k, v, dout: (1, 1, L, 64) float32.
struct Inputs {
  Tensor q, k, v, dout;
  explicit Inputs(int64_t L) {
    Generator gen(1);
    for (Tensor* t : {&q, &k, &v, &dout}) *t = randn({1, 1, L, kHeadDim}, gen);
  }
};

int64_t blocks(int64_t L) { return (L + 63) / 64; }

// rows × cols = L, as square as powers of two allow.
std::pair<int64_t, int64_t> grid(int64_t L) {
  int64_t rows = 1;
  while (rows * rows * 4 <= L) rows *= 2;
  return {rows, L / rows};
}

struct Variant {
  std::string name, setting;
  std::function<std::unique_ptr<Case>(Inputs&, int64_t)> make;
};

std::vector<Variant> variants() {
  std::vector<Variant> list;
  auto attention_case = [](AttentionOptions o) {
    return [o](Inputs& in, int64_t) {
      auto state = std::make_shared<AttentionOutput>();
      return make_case([&in, o, state] { *state = attention_forward(in.q, in.k, in.v, o); },
                       [&in, o, state] { attention_backward(in.dout, in.q, in.k, in.v, *state, o); });
    };
  };
  list.push_back({"exact", "fused attention_forward/backward", attention_case({.path = AttentionPath::fused})});
  list.push_back({"window", "fused, window_left = window_right = 128",
                  attention_case({.window_left = 128, .window_right = 128, .path = AttentionPath::fused})});
  auto sparse_case = [](auto layout_of) {
    return [layout_of](Inputs& in, int64_t L) {
      auto o = std::make_shared<BlockSparseOptions>(BlockSparseOptions{.layout = layout_of(L)});
      auto state = std::make_shared<BlockSparseOutput>();
      return make_case([&in, o, state] { *state = block_sparse_attention_forward(in.q, in.k, in.v, *o); },
                       [&in, o, state] { block_sparse_attention_backward(in.dout, in.q, in.k, in.v, *state, *o); });
    };
  };
  list.push_back({"strided", "block 64, local 2, stride √(L/64) blocks", sparse_case([](int64_t L) {
                    const auto stride = std::max<int64_t>(1, int64_t(std::lround(std::sqrt(double(blocks(L))))));
                    return strided_layout(L, {.block = 64, .local_blocks = 2, .stride_blocks = stride});
                  })});
  list.push_back({"bigbird", "block 64, 1 global, 1 window each side, 2 random", sparse_case([](int64_t L) {
                    return bigbird_layout(L, {.block = 64, .global_blocks = 1, .window_blocks = 1, .random_blocks = 2});
                  })});
  auto feature_case = [](bool causal, bool performer) {
    return [causal, performer](Inputs& in, int64_t) {
      auto state = std::make_shared<LinearAttentionOutput>();
      auto po = std::make_shared<PerformerOptions>(
          PerformerOptions{.features = performer ? performer_features(256, kHeadDim, 1) : Tensor(), .causal = causal});
      const LinearAttentionOptions lo{.causal = causal};
      return make_case(
          [&in, po, lo, state, performer] {
            *state = performer ? performer_attention_forward(in.q, in.k, in.v, *po) : linear_attention_forward(in.q, in.k, in.v, lo);
          },
          [&in, po, lo, state, performer] {
            if (performer) performer_attention_backward(in.dout, in.q, in.k, in.v, *state, *po);
            else linear_attention_backward(in.dout, in.q, in.k, in.v, *state, lo);
          });
    };
  };
  list.push_back({"linear", "elu+1, non-causal", feature_case(false, false)});
  list.push_back({"linear causal", "elu+1, chunked running sums", feature_case(true, false)});
  list.push_back({"performer", "FAVOR+, 256 features, non-causal", feature_case(false, true)});
  list.push_back({"performer causal", "FAVOR+, 256 features, causal", feature_case(true, true)});
  list.push_back({"linformer", "k = 256", [](Inputs& in, int64_t L) {
                    auto o = std::make_shared<LinformerOptions>(LinformerOptions{
                        .key_projection = linformer_projection(256, L, 1), .value_projection = linformer_projection(256, L, 2)});
                    auto state = std::make_shared<LinformerOutput>();
                    return make_case([&in, o, state] { *state = linformer_attention_forward(in.q, in.k, in.v, *o); },
                                     [&in, o, state] { linformer_attention_backward(in.dout, in.q, in.k, in.v, *state, *o); });
                  }});
  list.push_back({"lsh", "4 rounds, chunk 64, L/64 buckets", [](Inputs& in, int64_t L) {
                    const LshOptions o{.buckets = std::max<int64_t>(2, blocks(L) / 2 * 2), .hashes = 4, .chunk = 64};
                    auto state = std::make_shared<LshOutput>();
                    return make_case([&in, o, state] { *state = lsh_attention_forward(in.q, in.v, o); },
                                     [&in, o, state] { lsh_attention_backward(in.dout, in.q, in.v, *state, o); });
                  }});
  list.push_back({"axial", "rows × cols = L, as square as possible", [](Inputs& in, int64_t L) {
                    const auto [rows, cols] = grid(L);
                    auto shape = std::make_shared<Shape>(Shape{1, 1, rows, cols, kHeadDim});
                    auto state = std::make_shared<AxialOutput>();
                    return make_case(
                        [&in, shape, state] {
                          *state = axial_attention_forward(in.q.view(*shape), in.k.view(*shape), in.v.view(*shape));
                        },
                        [&in, shape, state] {
                          axial_attention_backward(in.dout.view(*shape), in.q.view(*shape), in.k.view(*shape),
                                                   in.v.view(*shape), *state);
                        });
                  }});
  return list;
}

const Variant& find_variant(const std::vector<Variant>& list, const std::string& name) {
  for (const Variant& v : list)
    if (v.name == name) return v;
  std::fprintf(stderr, "unknown variant '%s'\n", name.c_str());
  std::exit(2);
}

struct Seconds {
  double wall = NAN, cpu = NAN;
};

struct Measurement {
  Seconds forward, backward;
  double mib = -1;
  Seconds total() const { return {forward.wall + backward.wall, forward.cpu + backward.cpu}; }
};

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// Medians over `reps` runs of f, of wall time and of CPU time.
Seconds timed(int reps, const std::function<void()>& f) {
  std::vector<double> cpu;
  const double wall = median_seconds(reps, [&] {
    const double c0 = cpu_seconds();
    f();
    cpu.push_back(cpu_seconds() - c0);
  });
  std::sort(cpu.begin(), cpu.end());
  return {wall, cpu[cpu.size() / 2]};
}

// In this fresh process: the first forward+backward for memory, then the
// timed runs; prints "MiB forward_wall backward_wall forward_cpu backward_cpu" (seconds).
int run_case(const std::string& name, int64_t L) {
  mallopt(M_MMAP_THRESHOLD, 1 << 20);  // big blocks go back to the system when freed
  const std::vector<Variant> list = variants();
  Inputs in(L);
  std::unique_ptr<Case> c = find_variant(list, name).make(in, L);
  Measurement m;
  m.mib = peak_extra_mib([&] {
    c->forward();
    c->backward();
  });
  const int reps = L <= 4096 ? 5 : (L <= 16384 ? 3 : 1);
  m.forward = timed(reps, [&] { c->forward(); });
  m.backward = timed(reps, [&] { c->backward(); });
  std::printf("%.3f %.6f %.6f %.6f %.6f\n", m.mib, m.forward.wall, m.backward.wall, m.forward.cpu, m.backward.cpu);
  return 0;
}

Measurement measure_in_child(const std::string& name, int64_t L) {
  const std::string cmd = "/proc/" + std::to_string(getpid()) + "/exe --case '" + name + "' " + std::to_string(L);
  Measurement m;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe) {
    if (std::fscanf(pipe, "%lf %lf %lf %lf %lf", &m.mib, &m.forward.wall, &m.backward.wall, &m.forward.cpu,
                    &m.backward.cpu) != 5)
      m = Measurement{};
    pclose(pipe);
  }
  return m;
}

// Least-squares slope of log(y) against log(x).
double loglog_slope(const std::vector<std::pair<double, double>>& points) {
  if (points.size() < 2) return NAN;
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = double(points.size());
  for (auto [x, y] : points) {
    const double lx = std::log(x), ly = std::log(y);
    sx += lx, sy += ly, sxx += lx * lx, sxy += lx * ly;
  }
  return (n * sxy - sx * sy) / (n * sxx - sx * sx);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  int64_t min_length = 1024, max_length = 65536, exact_max = 65536;
  std::vector<std::string> only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--max-length") && i + 1 < argc) max_length = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--min-length") && i + 1 < argc) min_length = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--exact-max") && i + 1 < argc) exact_max = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = split(argv[++i]);
    else if (!std::strcmp(argv[i], "--case") && i + 2 < argc) return run_case(argv[i + 1], std::atoll(argv[i + 2]));
    else {
      std::fprintf(stderr, "usage: bench_variants [--min-length L] [--max-length L] [--exact-max L] [--only a,b]\n");
      return 2;
    }
  }
  std::vector<Variant> list = variants();
  if (!only.empty()) {
    std::vector<Variant> chosen;
    for (const std::string& name : only) chosen.push_back(find_variant(list, name));
    list = chosen;
  }
  std::vector<int64_t> lengths;
  for (int64_t L = 1024; L <= max_length; L *= 2)
    if (L >= min_length) lengths.push_back(L);

  std::printf("CPU: %s, %d threads; mha %s. float32, one head, E = Ev = 64, self-attention (L = S).\n", cpu_name().c_str(),
              omp_get_max_threads(), version);
  std::printf("Exact attention is skipped beyond L = %lld.\n\n", (long long)exact_max);
  std::map<std::string, std::map<int64_t, Measurement>> results;
  for (const Variant& v : list)
    for (int64_t L : lengths) {
      if (v.name == "exact" && L > exact_max) continue;
      const Measurement m = results[v.name][L] = measure_in_child(v.name, L);
      std::fprintf(stderr, "%-17s L=%6lld  fwd %9.1f ms  bwd %9.1f ms  (CPU %9.1f + %9.1f ms)  %8.1f MiB\n", v.name.c_str(),
                   (long long)L, m.forward.wall * 1e3, m.backward.wall * 1e3, m.forward.cpu * 1e3, m.backward.cpu * 1e3, m.mib);
    }

  auto time_table = [&](const char* what, double Seconds::*field) {
    std::printf("Forward + backward, %s, ms (median; 5 runs up to 4k, 3 up to 16k, then 1). Slope: least-squares fit\n"
                "of log(time) on log(L) over every length, and over L >= 8k (where fixed costs no longer dominate).\n\n",
                what);
    std::printf("| variant | setting |");
    for (int64_t L : lengths) std::printf(" %lldk |", (long long)(L / 1024));
    std::printf(" slope | slope ≥ 8k |\n|---|---|");
    for (size_t x = 0; x < lengths.size() + 2; ++x) std::printf("---|");
    std::printf("\n");
    for (const Variant& v : list) {
      std::printf("| %s | %s |", v.name.c_str(), v.setting.c_str());
      std::vector<std::pair<double, double>> all, tail;
      for (int64_t L : lengths) {
        auto it = results[v.name].find(L);
        if (it == results[v.name].end()) {
          std::printf(" — |");
          continue;
        }
        const double t = it->second.total().*field;
        std::printf(" %.1f |", t * 1e3);
        all.push_back({double(L), t});
        if (L >= 8192) tail.push_back({double(L), t});
      }
      std::printf(" %.2f | %.2f |\n", loglog_slope(all), loglog_slope(tail));
    }
    std::printf("\n");
  };
  time_table("wall-clock time", &Seconds::wall);
  time_table("process CPU time (both threads)", &Seconds::cpu);

  std::printf("Peak extra resident memory of one forward+backward, MiB (beyond the inputs; outputs and gradients included).\n\n");
  std::printf("| variant |");
  for (int64_t L : lengths) std::printf(" %lldk |", (long long)(L / 1024));
  std::printf("\n|---|");
  for (size_t x = 0; x < lengths.size(); ++x) std::printf("---|");
  std::printf("\n");
  for (const Variant& v : list) {
    std::printf("| %s |", v.name.c_str());
    for (int64_t L : lengths) {
      auto it = results[v.name].find(L);
      if (it == results[v.name].end()) std::printf(" — |");
      else std::printf(" %.1f |", it->second.mib);
    }
    std::printf("\n");
  }

  // Ratios at the longest length that exact attention reached.
  if (results.count("exact") && !results["exact"].empty()) {
    const int64_t L = results["exact"].rbegin()->first;
    const Measurement exact = results["exact"][L];
    std::printf("\nAt L = %lld: speed-up over exact attention (time of exact / time of the variant), by wall-clock\n"
                "and by CPU time, and memory as a fraction of exact's.\n\n"
                "| variant | forward (wall) | backward (wall) | fwd+bwd (wall) | fwd+bwd (CPU) | memory |\n"
                "|---|---|---|---|---|---|\n",
                (long long)L);
    for (const Variant& v : list) {
      auto it = results[v.name].find(L);
      if (it == results[v.name].end()) continue;
      const Measurement& m = it->second;
      std::printf("| %s | %.1f× | %.1f× | %.1f× | %.1f× | %.2f |\n", v.name.c_str(), exact.forward.wall / m.forward.wall,
                  exact.backward.wall / m.backward.wall, exact.total().wall / m.total().wall,
                  exact.total().cpu / m.total().cpu, m.mib / exact.mib);
    }
  }
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
