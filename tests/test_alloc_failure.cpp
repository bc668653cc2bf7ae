// An allocation the system refuses becomes a typed error, never an abort,
// wherever it happens: on the calling thread, or on any thread inside a
// kernel's OpenMP region (an exception that leaves a region calls
// std::terminate). This binary replaces operator new; a run "refused at k"
// refuses the k-th allocation of one call, for k = 1, 2, ... until the call
// needs fewer. Each refused call must throw mha::MemoryError or
// std::bad_alloc (or, had it survived the refusal, give the clean results),
// and the library must be whole afterwards: a clean call at the end gives the
// results of a call on a thread no refusal touched (a scratch slot left
// half-grown would crash it or change them).
//
// The tensor allocator (cpu/allocator.cpp) takes its blocks from
// aligned_alloc, not operator new: its refusals are tested in test_errors
// (memory limit) and are not swept here. Containers, per-thread scratch and
// every other operator new are.
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <optional>
#include <thread>

#include "cpu/flash/dispatch.h"
#include "mha/variants.h"
#include "testing.h"

namespace {

std::atomic<int64_t> refuse_at{0};  // 0: grant everything
std::atomic<int64_t> counted{0}, refused{0}, refused_in_region{0};

void* allocate(std::size_t n, std::size_t align, bool nothrow) {
  const int64_t at = refuse_at.load(std::memory_order_relaxed);
  if (at > 0 && counted.fetch_add(1, std::memory_order_relaxed) + 1 == at) {
    refused.fetch_add(1, std::memory_order_relaxed);
    if (omp_in_parallel()) refused_in_region.fetch_add(1, std::memory_order_relaxed);
    if (nothrow) return nullptr;
    throw std::bad_alloc();
  }
  if (n == 0) n = 1;
  void* p = align > alignof(std::max_align_t) ? std::aligned_alloc(align, (n + align - 1) / align * align) : std::malloc(n);
  if (!p && !nothrow) throw std::bad_alloc();
  return p;
}

}  // namespace

// Every form of operator new and delete: none is left to the runtime's (or
// the sanitizer's) definitions, so that the pairs match.
void* operator new(std::size_t n) { return allocate(n, 0, false); }
void* operator new[](std::size_t n) { return allocate(n, 0, false); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0, true); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0, true); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate(n, std::size_t(a), false); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate(n, std::size_t(a), false); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept { return allocate(n, std::size_t(a), true); }
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, std::size_t(a), true);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

using namespace mha;
using namespace mha::testing;

namespace {

using Results = std::vector<std::vector<double>>;
using Call = std::function<Results()>;

struct Sweep {
  int64_t calls = 0, typed_errors = 0, survived = 0, in_region = 0;
};

// The results of `call` in a state no refusal has touched: on a thread of its
// own, whose thread-local scratch and OpenMP team (libgomp keeps a team per
// thread that starts regions) are not this thread's, so that the sweep still
// finds this thread's grow-only scratch to grow, and to refuse.
Results fresh_results(const Call& call) {
  Results r;
  std::thread([&] { r = call(); }).join();
  return r;
}

// Refuses allocation k of `call` for k = 1, 2, ... until a call needs fewer
// than k; then a clean call. Every call must equal `fresh` or have thrown a
// typed error.
Sweep sweep(const Call& call) {
  const Results fresh = fresh_results(call);
  Sweep s;
  std::vector<Results> survivors;
  for (int64_t k = 1;; ++k) {
    counted = 0, refused = 0, refused_in_region = 0;
    std::optional<Results> got;
    bool typed = false;
    refuse_at = k;
    try {
      got = call();
    } catch (const MemoryError&) {
      typed = true;
    } catch (const std::bad_alloc&) {
      typed = true;
    } catch (...) {
    }
    refuse_at = 0;
    if (refused == 0) {  // the call made fewer than k allocations: done
      EXPECT_TRUE(got.has_value()) << "a call that was refused nothing failed";
      if (got) {
        EXPECT_EQ(*got, fresh) << "the unrefused run";
      }
      break;
    }
    ++s.calls;
    s.in_region += refused_in_region;
    if (typed) ++s.typed_errors;
    else if (got) ++s.survived, survivors.push_back(*got);
    else ADD_FAILURE() << "allocation " << k << " refused: an exception other than MemoryError or std::bad_alloc";
  }
  for (const Results& r : survivors) EXPECT_EQ(r, fresh) << "a call that survived a refusal";
  EXPECT_EQ(call(), fresh) << "a clean call after the sweep";
  EXPECT_GT(s.calls, 0);
  std::printf("%lld refused calls: %lld typed errors, %lld survived; %lld refusals inside parallel regions\n",
              (long long)s.calls, (long long)s.typed_errors, (long long)s.survived, (long long)s.in_region);
  return s;
}

Results attention(DType dtype, AttentionPath path, const Shape& qs, const Shape& ks, bool weights,
                  bool weights_grad = false) {
  const Shape vs{ks[0], ks[1], ks[2], 5};
  const Tensor q = random_tensor(qs, 1, dtype), k = random_tensor(ks, 2, dtype), v = random_tensor(vs, 3, dtype),
               dout = random_tensor({qs[0], qs[1], qs[2], 5}, 4, dtype);
  std::vector<bool> allowed;
  for (int64_t i = 0; i < qs[2] * ks[2]; ++i) allowed.push_back(i % 7 != 3);
  const AttentionOptions o{.mask = Tensor::from_bools(allowed, {qs[2], ks[2]}), .causal = Causal::bottom_right,
                           .dropout_p = 0.2, .dropout_seed = 3,
                           .return_weights = weights, .path = path};
  const AttentionOutput f = attention_forward(q, k, v, o);
  const Tensor dweights = weights_grad ? random_tensor(f.weights.shape(), 5, dtype) : Tensor();
  const AttentionGradients g = attention_backward(dout, q, k, v, f, o, false, dweights);
  Results r{f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  if (weights) r.push_back(f.weights.to_vector());
  return r;
}

class AllocationFailure : public ::testing::Test {
 protected:
  void SetUp() override { omp_set_num_threads(std::max(2, omp_get_max_threads())); }
  void TearDown() override { cpu::force_isa(std::nullopt); }
};

// The reference path allocates each thread's row buffers inside its region.
TEST_F(AllocationFailure, ReferencePathInsideItsRegions) {
  for (DType dtype : {DType::float64, DType::float32}) {
    const Call call = [&] { return attention(dtype, AttentionPath::reference, {2, 2, 7, 6}, {2, 1, 9, 6}, true); };
    const Sweep s = sweep(call);
    EXPECT_GT(s.in_region, 0) << "no refusal reached a parallel region";
  }
}

// The fused kernels take every thread's scratch before their regions, on
// each instruction set, in float32 and bfloat16, with batch ≥ threads (one
// entry per work item) and batch < threads (tiles of keys, then of queries).
// Each shape is new to the process, so that the grow-only scratch is grown
// (and refused) during the sweep.
TEST_F(AllocationFailure, FusedPathOnEveryInstructionSet) {
  int64_t E = 6;
  for (cpu::Isa isa : cpu::supported_isas())
    for (DType dtype : {DType::float32, DType::bfloat16})
      for (int64_t batch : {int64_t(1), int64_t(omp_get_max_threads())}) {
        SCOPED_TRACE(cpu::to_string(isa) + (dtype == DType::float32 ? " float32" : " bfloat16") +
                     " batch " + std::to_string(batch));
        cpu::force_isa(isa);
        E += 2;
        const Shape qs{batch, 2, 37, E}, ks{batch, 2, 45, E};
        sweep([&] { return attention(dtype, AttentionPath::fused, qs, ks, batch == 1); });
      }
}

// A loss on the returned weights: the fused backward's products for their
// share take their scratch inside a region (through RegionErrors).
TEST_F(AllocationFailure, FusedWeightsGradientOnEveryInstructionSet) {
  int64_t E = 40;
  for (cpu::Isa isa : cpu::supported_isas()) {
    SCOPED_TRACE(cpu::to_string(isa));
    cpu::force_isa(isa);
    E += 2;
    const Shape qs{2, 2, 70, E}, ks{2, 2, 81, E};
    sweep([&] { return attention(DType::float32, AttentionPath::fused, qs, ks, true, true); });
  }
}

TEST_F(AllocationFailure, Variants) {
  const Tensor q = random_tensor({2, 40, 6}, 1, DType::float32), k = random_tensor({2, 40, 6}, 2, DType::float32),
               v = random_tensor({2, 40, 5}, 3, DType::float32), dout = random_tensor({2, 40, 5}, 4, DType::float32);
  const BlockSparseOptions bs{.layout = strided_layout(40, {.block = 8, .local_blocks = 1, .stride_blocks = 2}, true),
                              .causal = true};
  const Call block_sparse = [&] {
    const BlockSparseOutput f = block_sparse_attention_forward(q, k, v, bs);
    const AttentionGradients g = block_sparse_attention_backward(dout, q, k, v, f, bs);
    return Results{f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  const LshOptions lsh{.buckets = 4, .hashes = 2, .chunk = 5, .causal = true};
  const Call lsh_call = [&] {
    const LshOutput f = lsh_attention_forward(q, v, lsh);
    const LshGradients g = lsh_attention_backward(dout, q, v, f, lsh);
    return Results{f.out.to_vector(), g.dquery.to_vector(), g.dvalue.to_vector()};
  };
  const LinearAttentionOptions linear{.causal = true};
  const Call linear_call = [&] {
    const LinearAttentionOutput f = linear_attention_forward(q, k, v, linear);
    const AttentionGradients g = linear_attention_backward(dout, q, k, v, f, linear);
    return Results{f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  const PerformerOptions performer{.features = performer_features(8, 6, 5), .causal = true};
  const Call performer_call = [&] {
    const LinearAttentionOutput f = performer_attention_forward(q, k, v, performer);
    const AttentionGradients g = performer_attention_backward(dout, q, k, v, f, performer);
    return Results{f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  const LinformerOptions linformer{.key_projection = linformer_projection(7, 40, 1, DType::float32),
                                   .value_projection = linformer_projection(7, 40, 2, DType::float32)};
  const Call linformer_call = [&] {
    const LinformerOutput f = linformer_attention_forward(q, k, v, linformer);
    const LinformerGradients g = linformer_attention_backward(dout, q, k, v, f, linformer);
    return Results{f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  const Tensor aq = random_tensor({1, 2, 5, 8, 6}, 5, DType::float32), av = random_tensor({1, 2, 5, 8, 4}, 6, DType::float32),
               adout = random_tensor({1, 2, 5, 8, 4}, 7, DType::float32);
  const Call axial = [&] {
    const AxialOutput f = axial_attention_forward(aq, aq, av, {});
    const AttentionGradients g = axial_attention_backward(adout, aq, aq, av, f, {});
    return Results{f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  int64_t in_region = 0;
  for (const auto& [name, call] : std::vector<std::pair<std::string, Call>>{
           {"block_sparse", block_sparse}, {"lsh", lsh_call}, {"linear", linear_call}, {"performer", performer_call},
           {"linformer", linformer_call}, {"axial", axial}}) {
    SCOPED_TRACE(name);
    std::printf("%s: ", name.c_str());
    in_region += sweep(call).in_region;
  }
  EXPECT_GT(in_region, 0) << "no refusal reached a parallel region";
}

// Modules: projections (mha's sgemm), LayerNorm, GELU, softmax, dropout;
// the layer is built inside the call (its dropout draws from its generator,
// and construction allocates too).
TEST_F(AllocationFailure, ModulesForwardAndBackward) {
  const Tensor x = random_tensor({2, 11, 24}, 8, DType::float32), dy = random_tensor({2, 11, 24}, 9, DType::float32);
  sweep([&] {
    Generator gen(7);
    nn::TransformerEncoderLayer layer(
        {.d_model = 24, .nhead = 3, .dim_feedforward = 40, .dropout = 0.1, .batch_first = true, .norm_first = true}, gen);
    const Tensor y = layer.forward(x);
    const Tensor dx = layer.backward(dy);
    Results r{y.to_vector(), dx.to_vector()};
    for (const nn::NamedParameter& p : layer.named_parameters()) r.push_back(p.grad->to_vector());
    return r;
  });
}

}  // namespace
