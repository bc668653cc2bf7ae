// MultiheadAttention: projections (BLAS), masks in torch's conventions, and
// the attention core (mha::attention_forward/backward) per head. The
// products take operands of type A: the module's dtype T, or bfloat16 under
// bf16_mixed precision (with float32 sums into T = float).
#include "mha/nn/multihead_attention.h"

#include <array>
#include <cmath>

#include "check.h"
#include "cpu/gemm.h"
#include "finite.h"
#include "mha/nn/positional.h"
#include "nn/attention_inputs.h"
#include "nn/mixed_precision.h"
#include "nn/variant_core.h"

namespace mha::nn {

namespace {

constexpr const char* kCtor = "mha::nn::MultiheadAttention";
constexpr const char* kForward = "mha::nn::MultiheadAttention::forward";
constexpr const char* kBackward = "mha::nn::MultiheadAttention::backward";
constexpr const char* kForwardCached = "mha::nn::MultiheadAttention::forward_cached";
constexpr const char* kProjectMemory = "mha::nn::MultiheadAttention::project_memory";
constexpr const char* kForwardMemory = "mha::nn::MultiheadAttention::forward_memory";

// Row (n, l) of a sequence tensor, (L, N, X), (N, L, X) when batch_first, or
// unbatched (L, X), sits at data + n·batch_stride + l·seq_stride.
struct SeqLayout {
  int64_t N = 1, L = 0, X = 0, seq_stride = 0, batch_stride = 0;
};

SeqLayout layout_of(const Shape& shape, bool batch_first) {
  SeqLayout s;
  s.X = shape.back();
  if (shape.size() == 2) {
    s.L = shape[0], s.seq_stride = s.X;
  } else if (batch_first) {
    s.N = shape[0], s.L = shape[1], s.seq_stride = s.X, s.batch_stride = s.L * s.X;
  } else {
    s.L = shape[0], s.N = shape[1], s.seq_stride = s.N * s.X, s.batch_stride = s.X;
  }
  return s;
}

// Whether the N·L rows of a layout are evenly spaced (batch_first or
// unbatched, contiguous): then a product over every batch entry is one GEMM
// of N·L rows, row stride seq_stride.
bool rows_in_order(const SeqLayout& s) { return s.N == 1 || s.batch_stride == s.L * s.seq_stride; }

// y = rows · bias-broadcast: every one of `rows` rows (stride ld) ← bias, or 0.
template <class T>
void fill_rows(T* y, int64_t rows, int64_t D, int64_t ld, const T* bias) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < D; ++e) y[r * ld + e] = bias ? bias[e] : T(0);
}

// y_n = x_n Wᵀ + b for each batch entry n; y is (N, L, D) contiguous.
template <class T, class A>
void project(const A* x, const SeqLayout& xs, const A* w, const T* bias, int64_t D, T* y) {
  if (rows_in_order(xs)) {
    const int64_t rows = xs.N * xs.L;
    if (bias) fill_rows(y, rows, D, D, bias);
    cpu::gemm(false, true, rows, D, xs.X, T(1), x, xs.seq_stride, w, xs.X, bias ? T(1) : T(0), y, D);
    return;
  }
  for (int64_t n = 0; n < xs.N; ++n) {
    T* yn = y + n * xs.L * D;
    if (bias) fill_rows(yn, xs.L, D, D, bias);
    cpu::gemm(false, true, xs.L, D, xs.X, T(1), x + n * xs.batch_stride, xs.seq_stride, w, xs.X,
              bias ? T(1) : T(0), yn, D);
  }
}

// Backward of project for rows [0, L) of dy (N, Ly, D), given as T (for
// the bias) and as the operand dy_op:
//   dW += Σ_n dy_nᵀ x_n,  db += Σ_n Σ_l dy_n,  dx_n = dy_n W.
template <class T, class A>
void project_backward(const T* dy, const A* dy_op, int64_t Ly, const A* x, const SeqLayout& xs, const A* w,
                      int64_t D, T* dw, T* dbias, T* dx) {
  if (rows_in_order(xs) && (xs.N == 1 || Ly == xs.L)) {
    const int64_t rows = xs.N * xs.L;
    cpu::gemm(true, false, D, xs.X, rows, T(1), dy_op, D, x, xs.seq_stride, T(1), dw, xs.X);
    if (dbias) add_bias_gradient(dy, rows, D, dbias);
    cpu::gemm(false, false, rows, xs.X, D, T(1), dy_op, D, w, xs.X, T(0), dx, xs.seq_stride);
    return;
  }
  for (int64_t n = 0; n < xs.N; ++n) {
    const A* dyn = dy_op + n * Ly * D;
    cpu::gemm(true, false, D, xs.X, xs.L, T(1), dyn, D, x + n * xs.batch_stride, xs.seq_stride, T(1), dw, xs.X);
    if (dbias)
      for (int64_t l = 0; l < xs.L; ++l)
        for (int64_t e = 0; e < D; ++e) dbias[e] += dy[(n * Ly + l) * D + e];
    cpu::gemm(false, false, xs.L, xs.X, D, T(1), dyn, D, w, xs.X, T(0), dx + n * xs.batch_stride, xs.seq_stride);
  }
}

// output = heads Woᵀ + bo, heads (N, L, D) contiguous, output rows in layout os.
template <class T, class A>
void project_out(const A* heads, const SeqLayout& os, const A* w, const T* bias, int64_t D, T* output) {
  if (rows_in_order(os)) {
    const int64_t rows = os.N * os.L;
    fill_rows(output, rows, D, os.seq_stride, bias);
    cpu::gemm(false, true, rows, D, D, T(1), heads, D, w, D, T(1), output, os.seq_stride);
    return;
  }
  for (int64_t n = 0; n < os.N; ++n) {
    T* yn = output + n * os.batch_stride;
    fill_rows(yn, os.L, D, os.seq_stride, bias);
    cpu::gemm(false, true, os.L, D, D, T(1), heads + n * os.L * D, D, w, D, T(1), yn, os.seq_stride);
  }
}

// (N, R, H·hd) contiguous  <->  (N, H, R, hd) view of the same memory.
Tensor split_heads(const Tensor& t, int64_t H) {
  return t.view({t.size(0), t.size(1), H, t.size(2) / H}).permute({0, 2, 1, 3});
}

void check_config(const MultiheadAttentionConfig& c) {
  if (c.embed_dim <= 0) raise<ValueError>(kCtor, "embed_dim", "> 0", std::to_string(c.embed_dim));
  if (c.num_heads <= 0) raise<ValueError>(kCtor, "num_heads", "> 0", std::to_string(c.num_heads));
  if (c.embed_dim % c.num_heads != 0)
    raise<ValueError>(kCtor, "embed_dim", "a multiple of num_heads = " + std::to_string(c.num_heads),
                      std::to_string(c.embed_dim));
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    raise<ValueError>(kCtor, "dropout", "a probability in [0, 1)", std::to_string(c.dropout));
  if (c.kdim < 0) raise<ValueError>(kCtor, "kdim", ">= 0 (0 = embed_dim)", std::to_string(c.kdim));
  if (c.vdim < 0) raise<ValueError>(kCtor, "vdim", ">= 0 (0 = embed_dim)", std::to_string(c.vdim));
  if (c.dtype != DType::float32 && c.dtype != DType::float64)
    raise<DtypeError>(kCtor, "dtype", "float32 or float64", to_string(c.dtype));
  check_precision(c.dtype, c.precision, kCtor);
  if (c.rotary_base && !(*c.rotary_base > 0 && std::isfinite(*c.rotary_base)))
    raise<ValueError>(kCtor, "rotary_base", "finite and > 0", std::to_string(*c.rotary_base));
  if (c.rotary_base && (c.embed_dim / c.num_heads) % 2 != 0)
    raise<ValueError>(kCtor, "rotary_base", "an even head dim (RoPE rotates pairs)",
                      "head dim " + std::to_string(c.embed_dim / c.num_heads));
  check_attention_variant(c.attention, kCtor);
  if (!c.attention.computes_weights()) {
    const std::string kind = to_string(c.attention.kind) + " attention";
    if (c.dropout > 0)
      raise<ValueError>(kCtor, "dropout", "0 with " + kind + " (it has no weights to drop)", std::to_string(c.dropout));
    if (c.add_bias_kv || c.add_zero_attn)
      raise<ValueError>(kCtor, "add_bias_kv", "false, and add_zero_attn false, with " + kind, "an extra key");
    if (c.precision != Precision::float32)
      raise<ValueError>(kCtor, "precision", "float32 with " + kind, to_string(c.precision));
  }
}

Tensor xavier_uniform(const Shape& shape, int64_t fan_in, int64_t fan_out, Generator& gen, DType dtype) {
  const double bound = std::sqrt(6.0 / double(fan_in + fan_out));
  return rand_uniform(shape, gen, -bound, bound, dtype);
}

}  // namespace

// The tensors below "operands" are of the products' operand type
// (bfloat16 under bf16_mixed, else the module's dtype).
struct MultiheadAttention::Saved {
  Tensor query, key, value;  // operands: the inputs, contiguous
  SeqLayout qs, ks, vs;
  int64_t S_total = 0;        // S + add_bias_kv + add_zero_attn
  Tensor q, k, v;             // operands: projections (N, L, D), (N, S_total, D), after RoPE
  Tensor heads;               // operand (N, L, D): the heads concatenated, input of out_proj
  Tensor ungated_heads;       // the heads before the gates (when gated)
  AttentionOptions options;
  AttentionOutput attention;  // out (N, H, L, hd) and lse
  Shape output_shape;
  Shape bias_shape;           // attn_bias's, when backward returns its gradient
  Shape weights_shape;        // the returned weights', when need_weights (else empty)
  bool averaged_weights = false;
  std::shared_ptr<VariantSaved> variant;  // an efficient variant's core, instead of `attention`
};

MultiheadAttention::MultiheadAttention(const MultiheadAttentionConfig& config, Generator& gen)
    : config_(config) {
  check_config(config_);
  MultiheadAttentionConfig& c = config_;
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.vdim == 0) c.vdim = c.embed_dim;
  const int64_t D = c.embed_dim;
  const DType t = c.dtype;
  packed_ = c.kdim == D && c.vdim == D;
  if (packed_) {
    in_proj_weight = xavier_uniform({3 * D, D}, D, 3 * D, gen, t);
    in_proj_weight_grad = Tensor::zeros({3 * D, D}, t);
  } else {
    q_proj_weight = xavier_uniform({D, D}, D, D, gen, t);
    k_proj_weight = xavier_uniform({D, c.kdim}, c.kdim, D, gen, t);
    v_proj_weight = xavier_uniform({D, c.vdim}, c.vdim, D, gen, t);
    q_proj_weight_grad = Tensor::zeros({D, D}, t);
    k_proj_weight_grad = Tensor::zeros({D, c.kdim}, t);
    v_proj_weight_grad = Tensor::zeros({D, c.vdim}, t);
  }
  if (c.bias) {
    in_proj_bias = Tensor::zeros({3 * D}, t);
    in_proj_bias_grad = Tensor::zeros({3 * D}, t);
  }
  if (c.add_bias_kv) {  // xavier_normal on (1, 1, D): fan_in = fan_out = D
    bias_k = randn({1, 1, D}, gen, 0.0, std::sqrt(1.0 / double(D)), t);
    bias_v = randn({1, 1, D}, gen, 0.0, std::sqrt(1.0 / double(D)), t);
    bias_k_grad = Tensor::zeros({1, 1, D}, t);
    bias_v_grad = Tensor::zeros({1, 1, D}, t);
  }
  const double bound = 1.0 / std::sqrt(double(D));  // kaiming_uniform(a=√5) of nn.Linear
  out_proj_weight = rand_uniform({D, D}, gen, -bound, bound, t);
  out_proj_weight_grad = Tensor::zeros({D, D}, t);
  if (c.bias) {
    out_proj_bias = Tensor::zeros({D}, t);
    out_proj_bias_grad = Tensor::zeros({D}, t);
  }
  dropout_gen_ = Generator(gen.next_u64());
  const AttentionVariant& a = c.attention;
  if (a.kind == AttentionKind::performer) feature_gen_ = Generator(gen.next_u64());
  if (a.kind == AttentionKind::linformer) {
    linformer_key_projection = linformer_projection(a.projected, a.max_length, gen.next_u64(), t);
    linformer_value_projection = linformer_projection(a.projected, a.max_length, gen.next_u64(), t);
    linformer_key_projection_grad = Tensor::zeros({a.projected, a.max_length}, t);
    linformer_value_projection_grad = Tensor::zeros({a.projected, a.max_length}, t);
  }
}

std::vector<NamedGenerator> MultiheadAttention::named_generators() {
  std::vector<NamedGenerator> out{{"dropout_generator", &dropout_gen_}};
  if (config_.attention.kind == AttentionKind::performer) out.push_back({"feature_generator", &feature_gen_});
  return out;
}

uint64_t MultiheadAttention::feature_seed() {
  const int64_t every = config_.attention.redraw_every;
  // Training forward t (counted from 0) uses draw t / every; eval the last one used.
  const uint64_t t = training_ ? feature_gen_.advance(1) : (feature_gen_.offset() > 0 ? feature_gen_.offset() - 1 : 0);
  const uint64_t draw = every > 0 ? t / uint64_t(every) : 0;
  return Generator(feature_gen_.seed() ^ (draw * 0x9E3779B97F4A7C15ull)).next_u64();
}

void MultiheadAttention::train(bool on) {
  Module::train(on);
  bf16_.clear();
}

std::vector<Tensor> MultiheadAttention::product_weights(bool refresh) {
  const int64_t D = config_.embed_dim;
  const bool mixed = config_.precision == Precision::bf16_mixed;
  auto operand = [&](const Tensor& w, size_t slot) { return mixed ? bf16_.get(slot, w, refresh) : w; };
  const Tensor wo = operand(out_proj_weight, 0);
  if (packed_) {
    const Tensor w = operand(in_proj_weight, 1);
    return {w.slice(0, 0, D), w.slice(0, D, 2 * D), w.slice(0, 2 * D, 3 * D), wo};
  }
  return {operand(q_proj_weight, 1), operand(k_proj_weight, 2), operand(v_proj_weight, 3), wo};
}

std::vector<NamedParameter> MultiheadAttention::named_parameters() {
  std::vector<NamedParameter> out;
  auto add = [&](const char* name, Tensor& v, Tensor& g) {
    if (v.defined()) out.push_back({name, &v, &g});
  };
  add("in_proj_weight", in_proj_weight, in_proj_weight_grad);
  add("q_proj_weight", q_proj_weight, q_proj_weight_grad);
  add("k_proj_weight", k_proj_weight, k_proj_weight_grad);
  add("v_proj_weight", v_proj_weight, v_proj_weight_grad);
  add("in_proj_bias", in_proj_bias, in_proj_bias_grad);
  add("bias_k", bias_k, bias_k_grad);
  add("bias_v", bias_v, bias_v_grad);
  add("out_proj.weight", out_proj_weight, out_proj_weight_grad);
  add("out_proj.bias", out_proj_bias, out_proj_bias_grad);
  add("linformer.key_projection", linformer_key_projection, linformer_key_projection_grad);
  add("linformer.value_projection", linformer_value_projection, linformer_value_projection_grad);
  return out;
}


namespace {

template <class T>
const T* ptr_or_null(const Tensor& t, int64_t offset = 0) {
  return t.defined() ? t.data<T>() + offset : nullptr;
}
template <class T>
T* mut_ptr_or_null(Tensor& t, int64_t offset = 0) {
  return t.defined() ? t.data<T>() + offset : nullptr;
}

void check_input(const char* fn, const Tensor& t, const char* name, int64_t rank, int64_t last, const char* last_name,
                 DType dtype) {
  check_defined(t, fn, name);
  if (t.dtype() != dtype) raise<DtypeError>(fn, name, to_string(dtype) + " (the module's dtype)", to_string(t.dtype()));
  if (t.device() != Device::cpu) raise<DeviceError>(fn, name, "a cpu tensor", to_string(t.device()));
  if (t.dim() != rank)
    raise<ShapeError>(fn, name, std::to_string(rank) + " dims, like query", shape_string(t.shape()));
  if (t.size(-1) != last)
    raise<ShapeError>(fn, name, std::string("last dim ") + last_name + " = " + std::to_string(last),
                      shape_string(t.shape()));
  for (int64_t n : t.shape())
    if (n == 0) raise<ShapeError>(fn, name, "non-empty dims", shape_string(t.shape()));
}

// A query-like sequence: (L, N, D), (N, L, D) or unbatched (L, D), of the
// module's dtype, non-empty. Returns its rank.
int64_t check_sequence(const char* fn, const Tensor& t, const char* name, int64_t D, DType dtype) {
  check_defined(t, fn, name);
  if (t.dim() != 2 && t.dim() != 3)
    raise<ShapeError>(fn, name, "(L, N, D), (N, L, D) with batch_first, or unbatched (L, D)", shape_string(t.shape()));
  check_input(fn, t, name, t.dim(), D, "embed_dim", dtype);
  return t.dim();
}

void check_parameters(const char* fn, const std::vector<NamedParameter>& parameters, DType dtype) {
  for (const NamedParameter& p : parameters)
    if (p.value->dtype() != dtype || !p.value->is_contiguous() || p.grad->shape() != p.value->shape())
      raise<StateError>(fn, p.name, "a contiguous " + to_string(dtype) + " parameter shaped like its grad " +
                        shape_string(p.grad->shape()), describe(*p.value));
}

// Key and value are often the query tensor itself (self-attention): then
// they share its operand copy.
bool same_view(const Tensor& a, const Tensor& b) {
  return a.raw_data() == b.raw_data() && a.dtype() == b.dtype() && a.shape() == b.shape() && a.strides() == b.strides();
}

// RoPE through the (N, H, R, hd) view of rows [begin, end) of t (N, R, D),
// the first of them at position `position`.
void rotate_rows(const Tensor& t, int64_t H, int64_t begin, int64_t end, int64_t position, double base,
                 bool inverse = false) {
  rotate_positions_(split_heads(t, H).slice(2, begin, end), position, base, inverse);
}

}  // namespace

MultiheadAttentionOutput MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                     const MultiheadAttentionInputs& in) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads;
  const int64_t rank = check_sequence(kForward, query, "query", D, c.dtype);
  check_input(kForward, key, "key", rank, c.kdim, "kdim", c.dtype);
  check_input(kForward, value, "value", rank, c.vdim, "vdim", c.dtype);
  check_parameters(kForward, named_parameters(), c.dtype);

  auto saved = std::make_shared<Saved>();
  Saved& s = *saved;
  s.qs = layout_of(query.shape(), c.batch_first);
  s.ks = layout_of(key.shape(), c.batch_first);
  s.vs = layout_of(value.shape(), c.batch_first);
  const int64_t N = s.qs.N, L = s.qs.L, S = s.ks.L;
  if (s.ks.N != N) raise<ShapeError>(kForward, "key", "batch size " + std::to_string(N) + " (query's)", shape_string(key.shape()));
  if (s.vs.N != N) raise<ShapeError>(kForward, "value", "batch size " + std::to_string(N) + " (query's)", shape_string(value.shape()));
  if (s.vs.L != S) raise<ShapeError>(kForward, "value", "sequence length " + std::to_string(S) + " (key's)", shape_string(value.shape()));
  s.S_total = S + (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);

  const Tensor& bias = in.attn_bias;
  s.options.mask = combine_masks(kForward, in, N, H, L, S, s.S_total, rank == 3, c.dtype, bias.defined());
  if (bias.defined()) {
    check_attn_bias(kForward, bias, N, H, L, S, c.dtype);
    // Alone and without extra key columns, the bias is the mask itself (no copy).
    s.options.mask = s.options.mask.defined() || s.S_total != S ? add_bias(s.options.mask, bias, s.S_total) : bias;
    if (in.attn_bias_grad) s.bias_shape = bias.shape();
  }
  s.options.causal = in.is_causal ? Causal::top_left : Causal::none;
  s.options.return_weights = in.need_weights;
  const AttentionVariant& variant = c.attention;
  if (variant.kind == AttentionKind::window) s.options.window_left = s.options.window_right = variant.window;
  VariantCall call{.variant = &variant, .causal = in.is_causal};
  if (!variant.computes_weights()) {
    const std::string kind = "false with " + to_string(variant.kind) + " attention (it computes no weights)";
    if (in.need_weights) raise<ValueError>(kForward, "need_weights", kind, "true");
    if (in.attn_mask.defined() || in.key_padding_mask.defined() || bias.defined())
      raise<ValueError>(kForward, "inputs", "no attn_mask, key_padding_mask or attn_bias with " +
                        to_string(variant.kind) + " attention", "one of them");
    if (variant.kind == AttentionKind::lsh && !(same_view(key, query) && same_view(value, key)))
      raise<ValueError>(kForward, "key", "query itself (lsh attention is self-attention: its keys are the queries)",
                        "another tensor");
    if (variant.kind == AttentionKind::performer) call.feature_seed = feature_seed();
    call.key_projection = linformer_key_projection, call.value_projection = linformer_value_projection;
    s.variant = std::make_shared<VariantSaved>();
  }
  if (training_ && c.dropout > 0) {
    s.options.dropout_p = c.dropout;
    s.options.dropout_seed = dropout_gen_.next_u64();
  }

  s.output_shape = query.shape();
  Tensor output = Tensor::empty(s.output_shape, c.dtype);

  dispatch_products(c.dtype, c.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    s.query = as_operand<A>(query);
    s.key = same_view(key, query) ? s.query : as_operand<A>(key);
    s.value = same_view(value, key) ? s.key : as_operand<A>(value);
    const std::vector<Tensor> w = product_weights(training_);
    const T* b = ptr_or_null<T>(in_proj_bias);
    Tensor q = Tensor::empty({N, L, D}, c.dtype), k = Tensor::zeros({N, s.S_total, D}, c.dtype),
           v = Tensor::zeros({N, s.S_total, D}, c.dtype);
    project<T, A>(s.query.data<A>(), s.qs, w[0].data<A>(), b, D, q.data<T>());
    // k and v hold S_total rows per batch entry: project each entry's S rows,
    // then bias_k / bias_v, then the zero row (already zero).
    if (s.S_total == S) {
      project<T, A>(s.key.data<A>(), s.ks, w[1].data<A>(), b ? b + D : nullptr, D, k.data<T>());
      project<T, A>(s.value.data<A>(), s.vs, w[2].data<A>(), b ? b + 2 * D : nullptr, D, v.data<T>());
    }
    for (int64_t n = 0; n < N && s.S_total != S; ++n) {
      SeqLayout one = s.ks;
      one.N = 1;
      project<T, A>(s.key.data<A>() + n * s.ks.batch_stride, one, w[1].data<A>(), b ? b + D : nullptr, D,
                    k.data<T>() + n * s.S_total * D);
      one = s.vs;
      one.N = 1;
      project<T, A>(s.value.data<A>() + n * s.vs.batch_stride, one, w[2].data<A>(), b ? b + 2 * D : nullptr, D,
                    v.data<T>() + n * s.S_total * D);
      if (c.add_bias_kv)
        for (int64_t e = 0; e < D; ++e) {
          k.data<T>()[(n * s.S_total + S) * D + e] = bias_k.data<T>()[e];
          v.data<T>()[(n * s.S_total + S) * D + e] = bias_v.data<T>()[e];
        }
    }
    if (c.rotary_base) {
      rotate_rows(q, H, 0, L, 0, *c.rotary_base);
      rotate_rows(k, H, 0, S, 0, *c.rotary_base);
    }
    s.q = as_operand<A>(q), s.k = as_operand<A>(k), s.v = as_operand<A>(v);
    s.heads = Tensor::empty({N, L, D}, s.q.dtype());
    if (s.variant) {
      split_heads(s.heads, H).copy_(
          variant_forward(kForward, call, split_heads(s.q, H), split_heads(s.k, H), split_heads(s.v, H), *s.variant));
    } else {
      s.attention = attention_forward(split_heads(s.q, H), split_heads(s.k, H), split_heads(s.v, H), s.options);
      split_heads(s.heads, H).copy_(s.attention.out);
    }
    if (head_gate_.defined()) {
      s.ungated_heads = s.heads.clone();
      gate_heads(s.heads, head_gate_);
    }
    project_out<T, A>(s.heads.data<A>(), layout_of(s.output_shape, c.batch_first), w[3].data<A>(),
                      ptr_or_null<T>(out_proj_bias), D, output.data<T>());
  });

  MultiheadAttentionOutput result;
  result.output = output;
  if (in.need_weights) {
    Tensor w = s.attention.weights;  // (N, H, L, S_total)
    if (in.average_attn_weights) w = average_heads(w, N, H, L, s.S_total);
    w = w.to(c.dtype);  // bfloat16 under bf16_mixed
    result.weights = rank == 2 ? w.select(0, 0) : w;
    s.weights_shape = result.weights.shape(), s.averaged_weights = in.average_attn_weights;
  }
  saved_ = std::move(saved);
  return result;
}

MultiheadAttentionInputGradients MultiheadAttention::backward(const Tensor& doutput, const Tensor& dweights) {
  if (!saved_) throw StateError(std::string("[") + kBackward + "] state: expected a forward call first; got none");
  Saved& s = *saved_;
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads, N = s.qs.N, L = s.qs.L, S = s.ks.L;
  check_defined(doutput, kBackward, "doutput");
  if (dweights.defined()) {
    if (s.weights_shape.empty())
      raise<ValueError>(kBackward, "dweights", "a forward with need_weights = true", "a forward without weights");
    if (dweights.shape() != s.weights_shape)
      raise<ShapeError>(kBackward, "dweights", "the weights' shape " + shape_string(s.weights_shape),
                        shape_string(dweights.shape()));
    if (dweights.dtype() != c.dtype) raise<DtypeError>(kBackward, "dweights", to_string(c.dtype), to_string(dweights.dtype()));
  }
  if (doutput.shape() != s.output_shape)
    raise<ShapeError>(kBackward, "doutput", "the output's shape " + shape_string(s.output_shape), shape_string(doutput.shape()));
  if (doutput.dtype() != c.dtype) raise<DtypeError>(kBackward, "doutput", to_string(c.dtype), to_string(doutput.dtype()));
  const Tensor dy = doutput.contiguous();
  MultiheadAttentionInputGradients g;
  g.dquery = Tensor::empty(s.query.shape(), c.dtype);
  g.dkey = Tensor::empty(s.key.shape(), c.dtype);
  g.dvalue = Tensor::empty(s.value.shape(), c.dtype);

  dispatch_products(c.dtype, c.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    const std::vector<Tensor> w = product_weights(false);
    const SeqLayout os = layout_of(s.output_shape, c.batch_first);
    // out_proj: y_n = heads_n Woᵀ + bo.
    Tensor dheads = Tensor::empty({N, L, D}, c.dtype);
    const Tensor dy_op = as_operand<A>(dy);
    T* dbo = mut_ptr_or_null<T>(out_proj_bias_grad);
    if (rows_in_order(os)) {
      const int64_t rows = N * L;
      cpu::gemm(false, false, rows, D, D, T(1), dy_op.data<A>(), os.seq_stride, w[3].data<A>(), D, T(0),
                dheads.data<T>(), D);
      cpu::gemm(true, false, D, D, rows, T(1), dy_op.data<A>(), os.seq_stride, s.heads.data<A>(), D, T(1),
                out_proj_weight_grad.data<T>(), D);
      if (dbo) add_bias_gradient(dy.data<T>(), rows, D, dbo);  // rows in order: seq_stride = D
    }
    for (int64_t n = 0; n < N && !rows_in_order(os); ++n) {
      const A* dyn = dy_op.data<A>() + n * os.batch_stride;
      cpu::gemm(false, false, L, D, D, T(1), dyn, os.seq_stride, w[3].data<A>(), D, T(0), dheads.data<T>() + n * L * D, D);
      cpu::gemm(true, false, D, D, L, T(1), dyn, os.seq_stride, s.heads.data<A>() + n * L * D, D, T(1),
                out_proj_weight_grad.data<T>(), D);
      if (dbo) {
        const T* dy_rows = dy.data<T>() + n * os.batch_stride;
        for (int64_t l = 0; l < L; ++l)
          for (int64_t e = 0; e < D; ++e) dbo[e] += dy_rows[l * os.seq_stride + e];
      }
    }
    if (s.ungated_heads.defined()) gate_heads_backward(dheads, s.ungated_heads, head_gate_, head_gate_grad_);
    const bool bias_grad = !s.bias_shape.empty();
    AttentionGradients ag;
    if (s.variant) {
      const VariantGradients vg = variant_backward(*s.variant, split_heads(dheads, H));
      ag = {.dquery = vg.dq, .dkey = vg.dk, .dvalue = vg.dv};
      for (auto [grad, d] : {std::pair{&linformer_key_projection_grad, &vg.dkey_projection},
                             std::pair{&linformer_value_projection_grad, &vg.dvalue_projection}})
        if (d->defined()) {
          T* sum = grad->template data<T>();
          const T* add = d->template data<T>();
          for (int64_t i = 0; i < d->numel(); ++i) sum[i] += add[i];
        }
    } else {
      const Tensor dw = dweights.defined() ? heads_weights_gradient(dweights, s.averaged_weights, N, H, L, s.S_total,
                                                                    s.attention.weights.dtype())
                                           : Tensor{};
      ag = attention_backward(split_heads(as_operand<A>(dheads), H), split_heads(s.q, H), split_heads(s.k, H),
                              split_heads(s.v, H), s.attention, s.options, bias_grad, dw);
    }
    if (bias_grad) g.dattn_bias = ag.dmask.shape() == s.bias_shape ? ag.dmask : bias_gradient(ag.dmask, s.bias_shape);
    Tensor dq = Tensor::empty({N, L, D}, c.dtype), dk = Tensor::empty({N, s.S_total, D}, c.dtype),
           dv = Tensor::empty({N, s.S_total, D}, c.dtype);
    split_heads(dq, H).copy_(ag.dquery);
    split_heads(dk, H).copy_(ag.dkey);
    split_heads(dv, H).copy_(ag.dvalue);
    if (c.rotary_base) {  // q = R q_proj with R orthogonal: dq_proj = Rᵀ dq
      rotate_rows(dq, H, 0, L, 0, *c.rotary_base, true);
      rotate_rows(dk, H, 0, S, 0, *c.rotary_base, true);
    }
    if (c.add_bias_kv)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < D; ++e) {
          bias_k_grad.data<T>()[e] += dk.data<T>()[(n * s.S_total + S) * D + e];
          bias_v_grad.data<T>()[e] += dv.data<T>()[(n * s.S_total + S) * D + e];
        }
    T* dw = packed_ ? in_proj_weight_grad.data<T>() : nullptr;
    T* db = mut_ptr_or_null<T>(in_proj_bias_grad);
    const Tensor dq_op = as_operand<A>(dq), dk_op = as_operand<A>(dk), dv_op = as_operand<A>(dv);
    project_backward<T, A>(dq.data<T>(), dq_op.data<A>(), L, s.query.data<A>(), s.qs, w[0].data<A>(), D,
                           packed_ ? dw : q_proj_weight_grad.data<T>(), db, g.dquery.data<T>());
    if (s.S_total == S) {
      project_backward<T, A>(dk.data<T>(), dk_op.data<A>(), S, s.key.data<A>(), s.ks, w[1].data<A>(), D,
                             packed_ ? dw + D * D : k_proj_weight_grad.data<T>(), db ? db + D : nullptr,
                             g.dkey.data<T>());
      project_backward<T, A>(dv.data<T>(), dv_op.data<A>(), S, s.value.data<A>(), s.vs, w[2].data<A>(), D,
                             packed_ ? dw + 2 * D * D : v_proj_weight_grad.data<T>(), db ? db + 2 * D : nullptr,
                             g.dvalue.data<T>());
    }
    for (int64_t n = 0; n < N && s.S_total != S; ++n) {
      const int64_t rows = n * s.S_total * D;
      SeqLayout one = s.ks;
      one.N = 1;
      project_backward<T, A>(dk.data<T>() + rows, dk_op.data<A>() + rows, s.S_total, s.key.data<A>() + n * s.ks.batch_stride,
                             one, w[1].data<A>(), D, packed_ ? dw + D * D : k_proj_weight_grad.data<T>(),
                             db ? db + D : nullptr, g.dkey.data<T>() + n * s.ks.batch_stride);
      one = s.vs;
      one.N = 1;
      project_backward<T, A>(dv.data<T>() + rows, dv_op.data<A>() + rows, s.S_total,
                             s.value.data<A>() + n * s.vs.batch_stride, one, w[2].data<A>(), D,
                             packed_ ? dw + 2 * D * D : v_proj_weight_grad.data<T>(), db ? db + 2 * D : nullptr,
                             g.dvalue.data<T>() + n * s.vs.batch_stride);
    }
  });
  return g;
}

namespace {

// Room in `cache` for `rows` rows of batch N, keeping the filled ones: the
// capacity at least doubles, so appending costs O(D) per row amortised.
void reserve(KVCache& cache, int64_t N, int64_t rows, int64_t D, DType dtype) {
  const int64_t capacity = cache.key.defined() ? cache.key.size(1) : 0;
  if (rows <= capacity) return;
  const int64_t grown = std::max(rows, 2 * capacity);
  for (Tensor* t : {&cache.key, &cache.value}) {
    Tensor bigger = Tensor::empty({N, grown, D}, dtype);
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
  const int64_t D = m.config().embed_dim;
  if (m.packed_in_proj()) {
    const T* w = m.in_proj_weight.data<T>();
    return {w, w + D * D, w + 2 * D * D, ptr_or_null<T>(m.in_proj_bias)};
  }
  return {m.q_proj_weight.data<T>(), m.k_proj_weight.data<T>(), m.v_proj_weight.data<T>(), ptr_or_null<T>(m.in_proj_bias)};
}

// Decoding: x's rows (layout of x) projected to queries, RoPE at positions
// position … when the module has it, attend to `keys` and `values` (N, H, S, E)
// under `options`; their heads go through out_proj into a tensor shaped like x.
Tensor attend_rows(const MultiheadAttention& m, const Tensor& x, int64_t position, const Tensor& keys,
                   const Tensor& values, const AttentionOptions& options) {
  const MultiheadAttentionConfig& c = m.config();
  const int64_t D = c.embed_dim, H = c.num_heads;
  const SeqLayout xs = layout_of(x.shape(), c.batch_first);
  const Tensor xc = x.contiguous();
  Tensor q = Tensor::empty({xs.N, xs.L, D}, c.dtype), heads = Tensor::empty({xs.N, xs.L, D}, c.dtype);
  Tensor output = Tensor::empty(x.shape(), c.dtype);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto [wq, wk, wv, b] = in_projection<T>(m);
    project<T, T>(xc.data<T>(), xs, wq, b, D, q.data<T>());
    if (c.rotary_base) rotate_rows(q, H, 0, xs.L, position, *c.rotary_base);
    split_heads(heads, H).copy_(attention_forward(split_heads(q, H), keys, values, options).out);
    if (m.head_gates().defined()) gate_heads(heads, m.head_gates());
    project_out<T, T>(heads.data<T>(), xs, m.out_proj_weight.data<T>(), ptr_or_null<T>(m.out_proj_bias), D,
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
  const int64_t D = c.embed_dim, H = c.num_heads;
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
  const bool fits = cache.key.defined() && cache.key.size(0) == N && cache.key.size(2) == D &&
                    cache.key.dtype() == cache_dtype && cache.value.shape() == cache.key.shape();
  if (past > 0 && !fits)
    raise<ShapeError>(kForwardCached, "cache", "keys and values (N, capacity, D) with N = " + std::to_string(N) +
                      " (x's batch), D = " + std::to_string(D) + ", " + to_string(cache_dtype), describe(cache.key));
  if (in.attn_bias.defined()) check_attn_bias(kForwardCached, in.attn_bias, N, H, L, S, c.dtype);
  if (!fits) cache = {};
  reserve(cache, N, S, D, cache_dtype);

  Tensor output = Tensor::empty(x.shape(), c.dtype);
  AttentionOptions options{.mask = in.attn_bias, .causal = in.is_causal ? Causal::bottom_right : Causal::none};
  if (c.attention.kind == AttentionKind::window) options.window_left = options.window_right = c.attention.window;
  dispatch_products(c.dtype, c.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    const std::vector<Tensor> w = product_weights(training_);
    const T* b = ptr_or_null<T>(in_proj_bias);
    const Tensor x_op = as_operand<A>(x);
    Tensor q = Tensor::empty({N, L, D}, c.dtype), k = Tensor::empty({N, L, D}, c.dtype),
           v = Tensor::empty({N, L, D}, c.dtype);
    project<T, A>(x_op.data<A>(), xs, w[0].data<A>(), b, D, q.data<T>());
    project<T, A>(x_op.data<A>(), xs, w[1].data<A>(), b ? b + D : nullptr, D, k.data<T>());
    project<T, A>(x_op.data<A>(), xs, w[2].data<A>(), b ? b + 2 * D : nullptr, D, v.data<T>());
    if (c.rotary_base) {
      rotate_rows(q, H, 0, L, past, *c.rotary_base);
      rotate_rows(k, H, 0, L, past, *c.rotary_base);
    }
    // The new keys and values become the cache's rows past … S − 1.
    cache.key.slice(1, past, S).copy_(k);
    cache.value.slice(1, past, S).copy_(v);
    const AttentionOutput a = attention_forward(split_heads(as_operand<A>(q), H), split_heads(cache.key, H).slice(2, 0, S),
                                                split_heads(cache.value, H).slice(2, 0, S), options);
    Tensor heads = Tensor::empty({N, L, D}, cache_dtype);
    split_heads(heads, H).copy_(a.out);
    if (head_gate_.defined()) gate_heads(heads, head_gate_);
    project_out<T, A>(heads.data<A>(), layout_of(x.shape(), c.batch_first), w[3].data<A>(),
                      ptr_or_null<T>(out_proj_bias), D, output.data<T>());
  });
  cache.length = S;
  return output;
}

KVCache MultiheadAttention::project_memory(const Tensor& key, const Tensor& value) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim;
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
  KVCache memory{Tensor::empty({ks.N, ks.L, D}, c.dtype), Tensor::empty({ks.N, ks.L, D}, c.dtype), ks.L};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto [wq, wk, wv, b] = in_projection<T>(*this);
    project<T, T>(kc.data<T>(), ks, wk, b ? b + D : nullptr, D, memory.key.data<T>());
    project<T, T>(vc.data<T>(), vs, wv, b ? b + 2 * D : nullptr, D, memory.value.data<T>());
  };
  if (c.dtype == DType::float64) run(double{});
  else run(float{});
  return memory;
}

Tensor MultiheadAttention::forward_memory(const Tensor& query, const KVCache& memory,
                                          const MultiheadAttentionInputs& in) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads;
  const int64_t rank = check_sequence(kForwardMemory, query, "query", D, c.dtype);
  const SeqLayout qs = layout_of(query.shape(), c.batch_first);
  const int64_t N = qs.N, L = qs.L, S = memory.length;
  if (!memory.key.defined() || memory.key.shape() != Shape{N, S, D} || memory.value.shape() != memory.key.shape() ||
      memory.key.dtype() != c.dtype || S < 1)
    raise<ShapeError>(kForwardMemory, "memory", "project_memory's keys and values (N, S, D) with N = " +
                      std::to_string(N) + " (query's batch), D = " + std::to_string(D) + ", " + to_string(c.dtype),
                      describe(memory.key));
  check_full(kForwardMemory, c);
  if (in.is_causal || in.attn_bias.defined())
    raise<ValueError>(kForwardMemory, "inputs", "no is_causal or attn_bias (masks only)", "one of them");
  check_parameters(kForwardMemory, named_parameters(), c.dtype);
  const Tensor mask = combine_masks(kForwardMemory, in, N, H, L, S, S, rank == 3, c.dtype, false);
  return attend_rows(*this, query, 0, split_heads(memory.key, H), split_heads(memory.value, H), {.mask = mask});
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

}  // namespace mha::nn
