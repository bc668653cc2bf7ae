// MultiheadAttention: projections (BLAS), masks in torch's conventions, and
// the attention core (mha::attention_forward/backward) per head. The
// products take operands of type A: the module's dtype T, or bfloat16 under
// bf16_mixed precision (with float32 sums into T = float).
#include "mha/nn/multihead_attention.h"

#include <array>
#include <atomic>
#include <cmath>

#include "check.h"
#include "cpu/gemm.h"
#include "finite.h"
#include "mha/dist/context_parallel.h"
#include "mha/nn/positional.h"
#include "mha/nn/transformer.h"
#include "nn/attention_inputs.h"
#include "nn/multihead_attention_impl.h"
#include "nn/mixed_precision.h"
#include "nn/variant_core.h"

namespace mha::nn {

using namespace detail;

namespace {

constexpr const char* kCtor = "mha::nn::MultiheadAttention";
constexpr const char* kForward = "mha::nn::MultiheadAttention::forward";
constexpr const char* kBackward = "mha::nn::MultiheadAttention::backward";

void check_config(const MultiheadAttentionConfig& c) {
  if (c.embed_dim <= 0) raise<ValueError>(kCtor, "embed_dim", "> 0", std::to_string(c.embed_dim));
  if (c.num_heads < 0) raise<ValueError>(kCtor, "num_heads", ">= 0", std::to_string(c.num_heads));
  if (c.head_dim < 0) raise<ValueError>(kCtor, "head_dim", ">= 0 (0 = embed_dim / num_heads)", std::to_string(c.head_dim));
  if (c.head_dim == 0 && c.num_heads == 0)
    raise<ValueError>(kCtor, "head_dim", "> 0 with num_heads = 0 (a module whose heads were all pruned)", "0");
  if (c.head_dim == 0 && c.embed_dim % c.num_heads != 0)
    raise<ValueError>(kCtor, "embed_dim", "a multiple of num_heads = " + std::to_string(c.num_heads) +
                      " (or set head_dim)", std::to_string(c.embed_dim));
  const int64_t hd = c.head_dim > 0 ? c.head_dim : c.embed_dim / c.num_heads;
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    raise<ValueError>(kCtor, "dropout", "a probability in [0, 1)", std::to_string(c.dropout));
  if (c.kdim < 0) raise<ValueError>(kCtor, "kdim", ">= 0 (0 = embed_dim)", std::to_string(c.kdim));
  if (c.vdim < 0) raise<ValueError>(kCtor, "vdim", ">= 0 (0 = embed_dim)", std::to_string(c.vdim));
  if (c.dtype != DType::float32 && c.dtype != DType::float64)
    raise<DtypeError>(kCtor, "dtype", "float32 or float64", to_string(c.dtype));
  check_precision(c.dtype, c.precision, kCtor);
  if (c.rotary_base && !(*c.rotary_base > 0 && std::isfinite(*c.rotary_base)))
    raise<ValueError>(kCtor, "rotary_base", "finite and > 0", std::to_string(*c.rotary_base));
  if (c.rotary_base && hd % 2 != 0)
    raise<ValueError>(kCtor, "rotary_base", "an even head dim (RoPE rotates pairs)", "head dim " + std::to_string(hd));
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
  // Operands: the projections after RoPE as heads, (N, H, L, hd) and (N, H, S_total, hd):
  // views of (N, L, I) tensors, or with one input and the packed projection
  // (fused) of one (N, L, 3I) tensor, each row q, k and v side by side.
  Tensor q, k, v;
  bool fused = false;
  Tensor heads;               // operand (N, L, I): the heads concatenated, input of out_proj
  Tensor ungated_heads;       // the heads before the gates (when gated)
  AttentionOptions options;
  AttentionOutput attention;  // out (N, H, L, hd) and lse
  Shape output_shape;
  Shape bias_shape;           // attn_bias's, when backward returns its gradient
  Shape weights_shape;        // the returned weights', when need_weights (else empty)
  bool averaged_weights = false;
  std::shared_ptr<VariantSaved> variant;  // an efficient variant's core, instead of `attention`
  std::optional<dist::SequenceShard> shard;  // context parallel: the core ran as ring attention over it
};

MultiheadAttention::MultiheadAttention(const MultiheadAttentionConfig& config, Generator& gen)
    : config_(config) {
  check_config(config_);
  MultiheadAttentionConfig& c = config_;
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.vdim == 0) c.vdim = c.embed_dim;
  if (c.head_dim == 0) c.head_dim = c.embed_dim / c.num_heads;
  const int64_t D = c.embed_dim, I = inner_dim();
  const DType t = c.dtype;
  packed_ = c.kdim == D && c.vdim == D;
  // Torch's initialisation with the heads' width I in place of D (I = D unless head_dim is set).
  if (packed_) {
    in_proj_weight = xavier_uniform({3 * I, D}, D, 3 * I, gen, t);
    in_proj_weight_grad = Tensor::zeros({3 * I, D}, t);
  } else {
    q_proj_weight = xavier_uniform({I, D}, D, I, gen, t);
    k_proj_weight = xavier_uniform({I, c.kdim}, c.kdim, I, gen, t);
    v_proj_weight = xavier_uniform({I, c.vdim}, c.vdim, I, gen, t);
    q_proj_weight_grad = Tensor::zeros({I, D}, t);
    k_proj_weight_grad = Tensor::zeros({I, c.kdim}, t);
    v_proj_weight_grad = Tensor::zeros({I, c.vdim}, t);
  }
  if (c.bias) {
    in_proj_bias = Tensor::zeros({3 * I}, t);
    in_proj_bias_grad = Tensor::zeros({3 * I}, t);
  }
  if (c.add_bias_kv) {  // xavier_normal on (1, 1, I): fan_in = fan_out = I
    const double sd = I > 0 ? std::sqrt(1.0 / double(I)) : 0.0;
    bias_k = randn({1, 1, I}, gen, 0.0, sd, t);
    bias_v = randn({1, 1, I}, gen, 0.0, sd, t);
    bias_k_grad = Tensor::zeros({1, 1, I}, t);
    bias_v_grad = Tensor::zeros({1, 1, I}, t);
  }
  const double bound = I > 0 ? 1.0 / std::sqrt(double(I)) : 0.0;  // kaiming_uniform(a=√5) of nn.Linear
  out_proj_weight = rand_uniform({D, I}, gen, -bound, bound, t);
  out_proj_weight_grad = Tensor::zeros({D, I}, t);
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
  const int64_t I = inner_dim();
  const bool mixed = config_.precision == Precision::bf16_mixed;
  auto operand = [&](const Tensor& w, size_t slot) { return mixed ? bf16_.get(slot, w, refresh) : w; };
  const Tensor wo = operand(out_proj_weight, 0);
  if (packed_) {
    const Tensor w = operand(in_proj_weight, 1);
    return {w.slice(0, 0, I), w.slice(0, I, 2 * I), w.slice(0, 2 * I, 3 * I), wo};
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


namespace detail {

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

}  // namespace detail

namespace {

// Key and value are often the query tensor itself (self-attention): then
// they share its operand copy.
bool same_view(const Tensor& a, const Tensor& b) {
  return a.raw_data() == b.raw_data() && a.dtype() == b.dtype() && a.shape() == b.shape() && a.strides() == b.strides();
}

std::atomic<int64_t> score_limit{int64_t(256) << 20};  // nn::score_memory_limit()

}  // namespace

void set_score_memory_limit(int64_t bytes) {
  if (bytes < 0) raise<ValueError>("mha::nn::set_score_memory_limit", "bytes", ">= 0 (0: keep no scores)", std::to_string(bytes));
  score_limit.store(bytes, std::memory_order_relaxed);
}

int64_t score_memory_limit() { return score_limit.load(std::memory_order_relaxed); }

MultiheadAttentionOutput MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                     const MultiheadAttentionInputs& in) {
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads, hd = c.head_dim, I = H * hd;
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
  if (H == 0) return forward_without_heads(query, key, value, in, std::move(saved));

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
  if (training_) s.options.keep_scores_bytes = score_memory_limit();
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
    // Self-attention with the packed projection: q, k and v in one product
    // (x · W_inᵀ, 3I wide), which backward's gradients mirror (one dW, one dx).
    s.fused = packed_ && s.S_total == S && same_view(key, query) && same_view(value, key) &&
              !dist::current_sequence_shard();
    if (s.fused) {
      Tensor qkv = Tensor::empty({N, L, 3 * I}, c.dtype);
      project<T, A>(s.query.data<A>(), s.qs, w[0].data<A>(), b, 3 * I, qkv.data<T>());
      if (c.rotary_base)
        for (int part : {0, 1}) rotate_positions_(projection_heads(qkv, part, H, hd), 0, *c.rotary_base);
      const Tensor op = as_operand<A>(qkv);
      s.q = projection_heads(op, 0, H, hd), s.k = projection_heads(op, 1, H, hd), s.v = projection_heads(op, 2, H, hd);
    } else {
      // Zeroed only where rows past the projected ones (bias_k/v, the zero row) are.
      const auto kv = [&] {
        return s.S_total == S ? Tensor::empty({N, S, I}, c.dtype) : Tensor::zeros({N, s.S_total, I}, c.dtype);
      };
      Tensor q = Tensor::empty({N, L, I}, c.dtype), k = kv(), v = kv();
      project<T, A>(s.query.data<A>(), s.qs, w[0].data<A>(), b, I, q.data<T>());
      // k and v hold S_total rows per batch entry: project each entry's S rows,
      // then bias_k / bias_v, then the zero row (already zero).
      if (s.S_total == S) {
        project<T, A>(s.key.data<A>(), s.ks, w[1].data<A>(), b ? b + I : nullptr, I, k.data<T>());
        project<T, A>(s.value.data<A>(), s.vs, w[2].data<A>(), b ? b + 2 * I : nullptr, I, v.data<T>());
      }
      for (int64_t n = 0; n < N && s.S_total != S; ++n) {
        SeqLayout one = s.ks;
        one.N = 1;
        project<T, A>(s.key.data<A>() + n * s.ks.batch_stride, one, w[1].data<A>(), b ? b + I : nullptr, I,
                      k.data<T>() + n * s.S_total * I);
        one = s.vs;
        one.N = 1;
        project<T, A>(s.value.data<A>() + n * s.vs.batch_stride, one, w[2].data<A>(), b ? b + 2 * I : nullptr, I,
                      v.data<T>() + n * s.S_total * I);
        if (c.add_bias_kv)
          for (int64_t e = 0; e < I; ++e) {
            k.data<T>()[(n * s.S_total + S) * I + e] = bias_k.data<T>()[e];
            v.data<T>()[(n * s.S_total + S) * I + e] = bias_v.data<T>()[e];
          }
      }
      if (c.rotary_base) {
        rotate_rows(q, H, hd, 0, L, 0, *c.rotary_base);
        rotate_rows(k, H, hd, 0, S, 0, *c.rotary_base);
      }
      s.q = split_heads(as_operand<A>(q), H, hd), s.k = split_heads(as_operand<A>(k), H, hd);
      s.v = split_heads(as_operand<A>(v), H, hd);
    }
    s.heads = Tensor::empty({N, L, I}, s.q.dtype());
    if (s.variant) {
      split_heads(s.heads, H, hd).copy_(variant_forward(kForward, call, s.q, s.k, s.v, *s.variant));
    } else if (const dist::SequenceShard* shard = dist::current_sequence_shard()) {
      // Context parallel: this rank's rows of one sequence; the core is ring attention.
      if (c.rotary_base || !same_view(key, query) || s.S_total != S)
        raise<ValueError>(kForward, "inputs", "self-attention without rotary positions or extra key rows under "
                          "context parallelism", "another kind");
      s.shard = *shard;
      s.attention = dist::shard_attention_forward(*shard, s.q, s.k, s.v, s.options, kForward);
      split_heads(s.heads, H, hd).copy_(s.attention.out);
    } else if (!head_gate_.defined()) {  // the heads written in place (the gates would change the saved out)
      s.attention = attention_forward_into(split_heads(s.heads, H, hd), s.q, s.k, s.v, s.options);
    } else {
      s.attention = attention_forward(s.q, s.k, s.v, s.options);
      split_heads(s.heads, H, hd).copy_(s.attention.out);
    }
    if (head_gate_.defined()) {
      s.ungated_heads = s.heads.clone();
      gate_heads(s.heads, head_gate_);
    }
    project_out<T, A>(s.heads.data<A>(), I, layout_of(s.output_shape, c.batch_first), w[3].data<A>(),
                      ptr_or_null<T>(out_proj_bias), output.data<T>());
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

// Every head pruned: each output row is bo (0 without bias); the weights are
// those of no head, (N, 0, L, S_total) per head and 0 averaged.
MultiheadAttentionOutput MultiheadAttention::forward_without_heads(const Tensor& query, const Tensor& key,
                                                                   const Tensor& value, const MultiheadAttentionInputs& in,
                                                                   std::shared_ptr<Saved> saved) {
  const MultiheadAttentionConfig& c = config_;
  Saved& s = *saved;
  const int64_t N = s.qs.N, L = s.qs.L, S = s.ks.L;
  if (in.attn_bias.defined()) {
    check_attn_bias(kForward, in.attn_bias, N, 0, L, S, c.dtype);
    if (in.attn_bias_grad) s.bias_shape = in.attn_bias.shape();
  }
  s.query = query, s.key = key, s.value = value, s.output_shape = query.shape();
  MultiheadAttentionOutput result{.output = Tensor::empty(s.output_shape, c.dtype)};
  dispatch_float(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    project_out<T, T>(nullptr, 0, layout_of(s.output_shape, c.batch_first), nullptr, ptr_or_null<T>(out_proj_bias),
                      result.output.data<T>());
  });
  if (in.need_weights) {
    const Tensor w = in.average_attn_weights ? Tensor::zeros({N, L, s.S_total}, c.dtype)
                                             : Tensor::zeros({N, 0, L, s.S_total}, c.dtype);
    result.weights = query.dim() == 2 ? w.select(0, 0) : w;
    s.weights_shape = result.weights.shape(), s.averaged_weights = in.average_attn_weights;
  }
  saved_ = std::move(saved);
  return result;
}

MultiheadAttentionInputGradients MultiheadAttention::backward(const Tensor& doutput, const Tensor& dweights, bool summed) {
  if (!saved_) throw StateError(std::string("[") + kBackward + "] state: expected a forward call first; got none");
  Saved& s = *saved_;
  const MultiheadAttentionConfig& c = config_;
  const int64_t D = c.embed_dim, H = c.num_heads, hd = c.head_dim, I = H * hd, N = s.qs.N, L = s.qs.L, S = s.ks.L;
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
  if (summed && (s.key.shape() != s.query.shape() || s.value.shape() != s.query.shape()))
    raise<ShapeError>(kBackward, "summed", "query, key and value of one shape " + shape_string(s.query.shape()),
                      "key " + shape_string(s.key.shape()) + ", value " + shape_string(s.value.shape()));
  const Tensor dy = doutput.contiguous();
  MultiheadAttentionInputGradients g;
  // Summed where the products did not already sum them (fused projections).
  const auto finish = [&] {
    if (summed && g.dkey.defined()) {
      g.dquery = add(add(g.dquery, g.dkey), g.dvalue);
      g.dkey = g.dvalue = Tensor{};
    }
    return g;
  };
  if (H == 0) {  // the output is bo: only its gradient is not zero
    g = {.dquery = Tensor::zeros(s.query.shape(), c.dtype), .dkey = Tensor::zeros(s.key.shape(), c.dtype),
         .dvalue = Tensor::zeros(s.value.shape(), c.dtype)};
    if (!s.bias_shape.empty()) g.dattn_bias = Tensor::zeros(s.bias_shape, c.dtype);
    if (out_proj_bias_grad.defined())
      dispatch_float(c.dtype, [&](auto tag) {
        using T = decltype(tag);
        const SeqLayout os = layout_of(s.output_shape, c.batch_first);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t l = 0; l < L; ++l)
            for (int64_t e = 0; e < D; ++e)
              out_proj_bias_grad.data<T>()[e] += dy.data<T>()[n * os.batch_stride + l * os.seq_stride + e];
      });
    return finish();
  }
  g.dquery = Tensor::empty(s.query.shape(), c.dtype);
  if (!(summed && s.fused)) {
    g.dkey = Tensor::empty(s.key.shape(), c.dtype);
    g.dvalue = Tensor::empty(s.value.shape(), c.dtype);
  }

  dispatch_products(c.dtype, c.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    const std::vector<Tensor> w = product_weights(false);
    const SeqLayout os = layout_of(s.output_shape, c.batch_first);
    // out_proj: y_n = heads_n Woᵀ + bo, Wo (D, I): dheads_n = dy_n Wo, dWo += Σ_n dy_nᵀ heads_n.
    Tensor dheads = Tensor::empty({N, L, I}, c.dtype);
    const Tensor dy_op = as_operand<A>(dy);
    T* dbo = mut_ptr_or_null<T>(out_proj_bias_grad);
    if (rows_in_order(os)) {
      const int64_t rows = N * L;
      cpu::gemm(false, false, rows, I, D, T(1), dy_op.data<A>(), os.seq_stride, w[3].data<A>(), I, T(0),
                dheads.data<T>(), I);
      cpu::gemm(true, false, D, I, rows, T(1), dy_op.data<A>(), os.seq_stride, s.heads.data<A>(), I, T(1),
                out_proj_weight_grad.data<T>(), I);
      if (dbo) add_bias_gradient(dy.data<T>(), rows, D, dbo);  // rows in order: seq_stride = D
    }
    for (int64_t n = 0; n < N && !rows_in_order(os); ++n) {
      const A* dyn = dy_op.data<A>() + n * os.batch_stride;
      cpu::gemm(false, false, L, I, D, T(1), dyn, os.seq_stride, w[3].data<A>(), I, T(0), dheads.data<T>() + n * L * I, I);
      cpu::gemm(true, false, D, I, L, T(1), dyn, os.seq_stride, s.heads.data<A>() + n * L * I, I, T(1),
                out_proj_weight_grad.data<T>(), I);
      if (dbo) {
        const T* dy_rows = dy.data<T>() + n * os.batch_stride;
        for (int64_t l = 0; l < L; ++l)
          for (int64_t e = 0; e < D; ++e) dbo[e] += dy_rows[l * os.seq_stride + e];
      }
    }
    if (s.ungated_heads.defined()) gate_heads_backward(dheads, s.ungated_heads, head_gate_, head_gate_grad_);
    const bool bias_grad = !s.bias_shape.empty();
    // q, k and v's gradients as (N, ·, I) rows, heads side by side: parts of
    // one (N, L, 3I) buffer when fused, else three; the attention core writes
    // its gradients straight into their heads where they share the dtype.
    // Under bf16-mixed the products take them as bfloat16, the attention
    // core's own output type: it writes them into one bfloat16 buffer that the
    // products read and the bias gradient sums (no float32 copy of the core's
    // output and no rounding pass). Rotary positions turn them in float32.
    const bool rounded_dqkv = !std::is_same_v<T, A> && s.fused && !c.rotary_base && !s.variant && !s.shard;
    Tensor dqkv, dq, dk, dv;
    if (s.fused) {
      dqkv = Tensor::empty({N, L, 3 * I}, rounded_dqkv ? DType::bfloat16 : c.dtype);
    } else {
      dq = Tensor::empty({N, L, I}, c.dtype), dk = Tensor::empty({N, s.S_total, I}, c.dtype);
      dv = Tensor::empty({N, s.S_total, I}, c.dtype);
    }
    const auto heads_of = [&](int part) {
      return s.fused ? projection_heads(dqkv, part, H, hd) : split_heads(part == 0 ? dq : part == 1 ? dk : dv, H, hd);
    };
    AttentionGradients ag;
    bool written = false;
    if (s.variant) {
      const VariantGradients vg = variant_backward(*s.variant, split_heads(dheads, H, hd));
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
      if (s.shard) {
        if (dw.defined() || bias_grad)
          raise<ValueError>("mha::nn::MultiheadAttention::backward", "dweights", "none under context parallelism",
                            "a weights or bias gradient");
        ag = dist::shard_attention_backward(*s.shard, split_heads(as_operand<A>(dheads), H, hd), s.q, s.k, s.v,
                                            s.attention, s.options, "mha::nn::MultiheadAttention::backward");
      } else {
        const Tensor dout = split_heads(as_operand<A>(dheads), H, hd);
        if (std::is_same_v<T, A> || rounded_dqkv) {
          ag = {.dquery = heads_of(0), .dkey = heads_of(1), .dvalue = heads_of(2)};
          attention_backward_into(ag, dout, s.q, s.k, s.v, s.attention, s.options, bias_grad, dw);
          written = true;
        } else {
          ag = attention_backward(dout, s.q, s.k, s.v, s.attention, s.options, bias_grad, dw);
        }
      }
    }
    if (bias_grad) g.dattn_bias = ag.dmask.shape() == s.bias_shape ? ag.dmask : bias_gradient(ag.dmask, s.bias_shape);
    if (!written) {
      const Tensor* parts[] = {&ag.dquery, &ag.dkey, &ag.dvalue};
      for (int part = 0; part < 3; ++part) heads_of(part).copy_(*parts[part]);
    }
    if (c.rotary_base)  // q = R q_proj with R orthogonal: dq_proj = Rᵀ dq (k's S rows, not the extra ones)
      for (int part : {0, 1}) rotate_positions_(heads_of(part).slice(2, 0, part == 0 ? L : S), 0, *c.rotary_base, true);
    if (s.fused) {
      // q, k and v's gradients side by side as the forward projected them:
      // W_in's gradient and bias in one product and one sum over 3I columns,
      // and summed, x's gradient in one product 3I deep.
      const Tensor dqkv_op = as_operand<A>(dqkv);
      const auto weight_backward = [&](const auto* summed_dy) {
        project_weight_backward<T, A>(summed_dy, dqkv_op.data<A>(), L, s.query.data<A>(), s.qs, 3 * I,
                                      in_proj_weight_grad.data<T>(), mut_ptr_or_null<T>(in_proj_bias_grad));
      };
      if (rounded_dqkv) weight_backward(dqkv_op.data<A>());
      else weight_backward(dqkv.data<T>());
      if (summed)
        return project_input_backward<T, A>(dqkv_op.data<A>(), 3 * I, L, s.qs, w[0].data<A>(), 3 * I,
                                            g.dquery.data<T>());
      Tensor* dx[] = {&g.dquery, &g.dkey, &g.dvalue};
      for (int part = 0; part < 3; ++part)
        project_input_backward<T, A>(dqkv_op.data<A>() + part * I, 3 * I, L, s.qs, w[size_t(part)].data<A>(), I,
                                     dx[part]->data<T>());
      return;
    }
    if (c.add_bias_kv)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < I; ++e) {
          bias_k_grad.data<T>()[e] += dk.data<T>()[(n * s.S_total + S) * I + e];
          bias_v_grad.data<T>()[e] += dv.data<T>()[(n * s.S_total + S) * I + e];
        }
    T* dw = packed_ ? in_proj_weight_grad.data<T>() : nullptr;
    T* db = mut_ptr_or_null<T>(in_proj_bias_grad);
    const Tensor dq_op = as_operand<A>(dq), dk_op = as_operand<A>(dk), dv_op = as_operand<A>(dv);
    project_backward<T, A>(dq.data<T>(), dq_op.data<A>(), L, s.query.data<A>(), s.qs, w[0].data<A>(), I,
                           packed_ ? dw : q_proj_weight_grad.data<T>(), db, g.dquery.data<T>());
    if (s.S_total == S) {
      project_backward<T, A>(dk.data<T>(), dk_op.data<A>(), S, s.key.data<A>(), s.ks, w[1].data<A>(), I,
                             packed_ ? dw + I * D : k_proj_weight_grad.data<T>(), db ? db + I : nullptr,
                             g.dkey.data<T>());
      project_backward<T, A>(dv.data<T>(), dv_op.data<A>(), S, s.value.data<A>(), s.vs, w[2].data<A>(), I,
                             packed_ ? dw + 2 * I * D : v_proj_weight_grad.data<T>(), db ? db + 2 * I : nullptr,
                             g.dvalue.data<T>());
    }
    for (int64_t n = 0; n < N && s.S_total != S; ++n) {
      const int64_t rows = n * s.S_total * I;
      SeqLayout one = s.ks;
      one.N = 1;
      project_backward<T, A>(dk.data<T>() + rows, dk_op.data<A>() + rows, s.S_total, s.key.data<A>() + n * s.ks.batch_stride,
                             one, w[1].data<A>(), I, packed_ ? dw + I * D : k_proj_weight_grad.data<T>(),
                             db ? db + I : nullptr, g.dkey.data<T>() + n * s.ks.batch_stride);
      one = s.vs;
      one.N = 1;
      project_backward<T, A>(dv.data<T>() + rows, dv_op.data<A>() + rows, s.S_total,
                             s.value.data<A>() + n * s.vs.batch_stride, one, w[2].data<A>(), I,
                             packed_ ? dw + 2 * I * D : v_proj_weight_grad.data<T>(), db ? db + 2 * I : nullptr,
                             g.dvalue.data<T>() + n * s.vs.batch_stride);
    }
  });
  return finish();
}

}  // namespace mha::nn
