// MultiheadAttention's decoding (a KV cache of self-attention's keys and
// values; cross-attention against a memory projected once) and its head
// surgery: gates on the heads and pruning them.
#include <algorithm>
#include <array>
#include <set>

#include "finite.h"
#include "mha/nn/multihead_attention.h"
#include "nn/attention_inputs.h"
#include "nn/mixed_precision.h"
#include "nn/multihead_attention_impl.h"

namespace mha::nn {

using namespace detail;

namespace {

constexpr const char* kForwardCached = "mha::nn::MultiheadAttention::forward_cached";
constexpr const char* kProjectMemory = "mha::nn::MultiheadAttention::project_memory";
constexpr const char* kForwardMemory = "mha::nn::MultiheadAttention::forward_memory";

}  // namespace

namespace {

// Room in `cache` for `rows` rows of batch N, keeping the filled ones: the
// capacity at least doubles, so appending costs O(I) per row amortised.
void reserve(KVCache& cache, int64_t N, int64_t rows, int64_t I, DType dtype) {
  const int64_t capacity = cache.key.defined() ? cache.key.size(1) : 0;
  if (rows <= capacity) return;
  const int64_t grown = std::max(rows, 2 * capacity);
  for (Tensor* t : {&cache.key, &cache.value}) {
    Tensor bigger = Tensor::empty({N, grown, I}, dtype);
    if (cache.length > 0) bigger.slice(1, 0, cache.length).copy_(t->slice(1, 0, cache.length));
    *t = bigger;
  }
}

}  // namespace

namespace {

// The in-projection weights (q, k, v) and bias, packed or separate, in float
// (decoding against a fixed memory computes in the parameters' dtype).
template <class T>
std::array<const T*, 4> in_projection(const MultiheadAttention& m) {
  const int64_t D = m.config().embed_dim, I = m.inner_dim();
  if (m.packed_in_proj()) {
    const T* w = m.in_proj_weight.data<T>();
    return {w, w + I * D, w + 2 * I * D, ptr_or_null<T>(m.in_proj_bias)};
  }
  return {m.q_proj_weight.data<T>(), m.k_proj_weight.data<T>(), m.v_proj_weight.data<T>(), ptr_or_null<T>(m.in_proj_bias)};
}

// Decoding: x's rows (layout of x) projected to queries, RoPE at positions
// position … when the module has it, attend to `keys` and `values` (N, H, S, hd)
// under `options`; their heads go through out_proj into a tensor shaped like x.
Tensor attend_rows(const MultiheadAttention& m, const Tensor& x, int64_t position, const Tensor& keys,
                   const Tensor& values, const AttentionOptions& options) {
  const MultiheadAttentionConfig& c = m.config();
  const int64_t H = c.num_heads, hd = c.head_dim, I = H * hd;
  const SeqLayout xs = layout_of(x.shape(), c.batch_first);
  const Tensor xc = x.contiguous();
  Tensor q = Tensor::empty({xs.N, xs.L, I}, c.dtype), heads = Tensor::empty({xs.N, xs.L, I}, c.dtype);
  Tensor output = Tensor::empty(x.shape(), c.dtype);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto [wq, wk, wv, b] = in_projection<T>(m);
    if (H > 0) {
      project<T, T>(xc.data<T>(), xs, wq, b, I, q.data<T>());
      if (c.rotary_base) rotate_rows(q, H, hd, 0, xs.L, position, *c.rotary_base);
      attention_forward_into(split_heads(heads, H, hd), split_heads(q, H, hd), keys, values, options);
      if (m.head_gates().defined()) gate_heads(heads, m.head_gates());
    }
    project_out<T, T>(heads.data<T>(), I, xs, m.out_proj_weight.data<T>(), ptr_or_null<T>(m.out_proj_bias),
                      output.data<T>());
  };
  if (c.dtype == DType::float64) run(double{});
  else run(float{});
  return output;
}

// Decoding needs keys and values that are plain projections of the rows.
void check_decodable(const char* fn, const MultiheadAttentionConfig& c) {
  if (c.add_bias_kv || c.add_zero_attn)
    raise<ValueError>(fn, "config", "no add_bias_kv and no add_zero_attn", "an extra-key configuration");
}

// Cross-attention against a memory projected once runs full attention.
void check_full(const char* fn, const MultiheadAttentionConfig& c) {
  if (c.attention.kind != AttentionKind::full)
    raise<ValueError>(fn, "config.attention", "full (memory attention)", to_string(c.attention.kind));
}

}  // namespace

Tensor MultiheadAttention::forward_cached(const Tensor& x, KVCache& cache, const MultiheadAttentionInputs& in) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads, hd = c.head_dim, I = H * hd;
  check_sequence(kForwardCached, x, "x", D, c.dtype);
  check_decodable(kForwardCached, c);
  if (!c.attention.computes_weights())
    raise<ValueError>(kForwardCached, "config.attention", "full or window (KV-cache decoding)",
                      to_string(c.attention.kind));
  if (!packed_)
    raise<ValueError>(kForwardCached, "config", "kdim = vdim = embed_dim (self-attention)",
                      "a cross-attention configuration");
  if (in.attn_mask.defined() || in.key_padding_mask.defined())
    raise<ValueError>(kForwardCached, "inputs", "no attn_mask or key_padding_mask (pass attn_bias)", "a mask");
  check_parameters(kForwardCached, named_parameters(), c.dtype);
  const SeqLayout xs = layout_of(x.shape(), c.batch_first);
  const int64_t N = xs.N, L = xs.L, past = cache.length, S = past + L;
  if (past < 0) raise<ValueError>(kForwardCached, "cache.length", ">= 0", std::to_string(past));
  const DType cache_dtype = operand_dtype(c.dtype, c.precision);
  const bool fits = cache.key.defined() && cache.key.size(0) == N && cache.key.size(2) == I &&
                    cache.key.dtype() == cache_dtype && cache.value.shape() == cache.key.shape();
  if (past > 0 && !fits)
    raise<ShapeError>(kForwardCached, "cache", "keys and values (N, capacity, I) with N = " + std::to_string(N) +
                      " (x's batch), I = " + std::to_string(I) + ", " + to_string(cache_dtype), describe(cache.key));
  if (in.attn_bias.defined()) check_attn_bias(kForwardCached, in.attn_bias, N, H, L, S, c.dtype);
  if (!fits) cache = {};
  reserve(cache, N, S, I, cache_dtype);

  Tensor output = Tensor::empty(x.shape(), c.dtype);
  AttentionOptions options{.mask = in.attn_bias, .causal = in.is_causal ? Causal::bottom_right : Causal::none};
  if (c.attention.kind == AttentionKind::window) options.window_left = options.window_right = c.attention.window;
  dispatch_products(c.dtype, c.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    const std::vector<Tensor> w = product_weights(training_);
    const T* b = ptr_or_null<T>(in_proj_bias);
    const Tensor x_op = as_operand<A>(x);
    Tensor heads = Tensor::empty({N, L, I}, cache_dtype);
    if (H > 0) {
      Tensor q = Tensor::empty({N, L, I}, c.dtype), k = Tensor::empty({N, L, I}, c.dtype),
             v = Tensor::empty({N, L, I}, c.dtype);
      project<T, A>(x_op.data<A>(), xs, w[0].data<A>(), b, I, q.data<T>());
      project<T, A>(x_op.data<A>(), xs, w[1].data<A>(), b ? b + I : nullptr, I, k.data<T>());
      project<T, A>(x_op.data<A>(), xs, w[2].data<A>(), b ? b + 2 * I : nullptr, I, v.data<T>());
      if (c.rotary_base) {
        rotate_rows(q, H, hd, 0, L, past, *c.rotary_base);
        rotate_rows(k, H, hd, 0, L, past, *c.rotary_base);
      }
      // The new keys and values become the cache's rows past … S − 1.
      cache.key.slice(1, past, S).copy_(k);
      cache.value.slice(1, past, S).copy_(v);
      attention_forward_into(split_heads(heads, H, hd), split_heads(as_operand<A>(q), H, hd),
                             split_heads(cache.key, H, hd).slice(2, 0, S),
                             split_heads(cache.value, H, hd).slice(2, 0, S), options);
      if (head_gate_.defined()) gate_heads(heads, head_gate_);
    }
    project_out<T, A>(heads.data<A>(), I, layout_of(x.shape(), c.batch_first), w[3].data<A>(),
                      ptr_or_null<T>(out_proj_bias), output.data<T>());
  });
  cache.length = S;
  return output;
}

KVCache MultiheadAttention::project_memory(const Tensor& key, const Tensor& value) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t I = inner_dim();
  const int64_t rank = check_sequence(kProjectMemory, key, "key", c.kdim, c.dtype);
  check_input(kProjectMemory, value, "value", rank, c.vdim, "vdim", c.dtype);
  check_decodable(kProjectMemory, c);
  check_full(kProjectMemory, c);
  if (c.rotary_base)
    raise<ValueError>(kProjectMemory, "config", "no rotary_base (cross-attention has no positions)", "rotary_base set");
  check_parameters(kProjectMemory, named_parameters(), c.dtype);
  const SeqLayout ks = layout_of(key.shape(), c.batch_first), vs = layout_of(value.shape(), c.batch_first);
  if (vs.N != ks.N || vs.L != ks.L)
    raise<ShapeError>(kProjectMemory, "value", "key's batch and length", shape_string(value.shape()));
  const Tensor kc = key.contiguous(), vc = value.contiguous();
  KVCache memory{Tensor::empty({ks.N, ks.L, I}, c.dtype), Tensor::empty({ks.N, ks.L, I}, c.dtype), ks.L};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto [wq, wk, wv, b] = in_projection<T>(*this);
    if (I == 0) return;
    project<T, T>(kc.data<T>(), ks, wk, b ? b + I : nullptr, I, memory.key.data<T>());
    project<T, T>(vc.data<T>(), vs, wv, b ? b + 2 * I : nullptr, I, memory.value.data<T>());
  };
  if (c.dtype == DType::float64) run(double{});
  else run(float{});
  return memory;
}

Tensor MultiheadAttention::forward_memory(const Tensor& query, const KVCache& memory,
                                          const MultiheadAttentionInputs& in) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads, hd = c.head_dim, I = H * hd;
  const int64_t rank = check_sequence(kForwardMemory, query, "query", D, c.dtype);
  const SeqLayout qs = layout_of(query.shape(), c.batch_first);
  const int64_t N = qs.N, L = qs.L, S = memory.length;
  if (!memory.key.defined() || memory.key.shape() != Shape{N, S, I} || memory.value.shape() != memory.key.shape() ||
      memory.key.dtype() != c.dtype || S < 1)
    raise<ShapeError>(kForwardMemory, "memory", "project_memory's keys and values (N, S, I) with N = " +
                      std::to_string(N) + " (query's batch), I = " + std::to_string(I) + ", " + to_string(c.dtype),
                      describe(memory.key));
  check_full(kForwardMemory, c);
  if (in.is_causal || in.attn_bias.defined())
    raise<ValueError>(kForwardMemory, "inputs", "no is_causal or attn_bias (masks only)", "one of them");
  check_parameters(kForwardMemory, named_parameters(), c.dtype);
  if (H == 0) return attend_rows(*this, query, 0, {}, {}, {});
  const Tensor mask = combine_masks(kForwardMemory, in, N, H, L, S, S, rank == 3, c.dtype, false);
  return attend_rows(*this, query, 0, split_heads(memory.key, H, hd), split_heads(memory.value, H, hd), {.mask = mask});
}

void MultiheadAttention::set_head_gates(const Tensor& gates) {
  if (!gates.defined()) {
    head_gate_ = head_gate_grad_ = Tensor();
    return;
  }
  const char* fn = "mha::nn::MultiheadAttention::set_head_gates";
  const int64_t H = config_.num_heads;
  if (gates.shape() != Shape{H}) raise<ShapeError>(fn, "gates", "shape " + shape_string({H}), shape_string(gates.shape()));
  if (gates.dtype() != config_.dtype) raise<DtypeError>(fn, "gates", to_string(config_.dtype), to_string(gates.dtype()));
  if (!all_finite(gates)) raise<ValueError>(fn, "gates", "finite values", "a NaN or infinity");
  head_gate_ = gates.clone();
  head_gate_grad_ = Tensor::zeros({H}, config_.dtype);
}

void MultiheadAttention::zero_head_gate_grad() {
  if (head_gate_grad_.defined()) head_gate_grad_.fill_(0.0);
}

namespace {

// The kept heads' slices of t along `dim`, where t holds `chunks` blocks of
// H slices of width w each (in_proj's q, k and v blocks: 3 of them).
Tensor keep_heads(const Tensor& t, int64_t dim, int64_t chunks, int64_t H, int64_t w, const std::vector<int64_t>& keep) {
  if (!t.defined()) return t;
  Shape shape = t.shape();
  const int64_t K = int64_t(keep.size());
  shape[dim] = chunks * K * w;
  Tensor out = Tensor::empty(shape, t.dtype());
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t j = 0; j < K; ++j)
      out.slice(dim, (c * K + j) * w, (c * K + j + 1) * w).copy_(t.slice(dim, (c * H + keep[j]) * w, (c * H + keep[j] + 1) * w));
  return out;
}

}  // namespace

void MultiheadAttention::prune_heads(const std::vector<int64_t>& heads) {
  const char* fn = "mha::nn::MultiheadAttention::prune_heads";
  const int64_t H = config_.num_heads, hd = config_.head_dim;
  const std::set<int64_t> gone(heads.begin(), heads.end());
  for (int64_t h : gone)
    if (h < 0 || h >= H)
      raise<ValueError>(fn, "heads", "indices in [0, " + std::to_string(H) + ") (the module's heads)", std::to_string(h));
  std::vector<int64_t> keep;
  for (int64_t h = 0; h < H; ++h)
    if (!gone.count(h)) keep.push_back(h);
  for (auto [t, chunks] : {std::pair{&in_proj_weight, 3}, {&in_proj_weight_grad, 3}, {&in_proj_bias, 3},
                           {&in_proj_bias_grad, 3}, {&q_proj_weight, 1}, {&q_proj_weight_grad, 1},
                           {&k_proj_weight, 1}, {&k_proj_weight_grad, 1}, {&v_proj_weight, 1}, {&v_proj_weight_grad, 1}})
    *t = keep_heads(*t, 0, chunks, H, hd, keep);
  for (Tensor* t : {&bias_k, &bias_k_grad, &bias_v, &bias_v_grad}) *t = keep_heads(*t, 2, 1, H, hd, keep);
  for (Tensor* t : {&out_proj_weight, &out_proj_weight_grad}) *t = keep_heads(*t, 1, 1, H, hd, keep);
  for (Tensor* t : {&head_gate_, &head_gate_grad_}) *t = keep_heads(*t, 0, 1, H, 1, keep);
  config_.num_heads = int64_t(keep.size());
  saved_.reset();
  bf16_.clear();
}

}  // namespace mha::nn
