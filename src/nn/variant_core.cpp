// One efficient variant as the attention core of a MultiheadAttention: the
// per-head tensors reshaped to what each variant function takes, and the
// variant's options built from the layer's AttentionVariant.
#include "nn/variant_core.h"

#include <algorithm>

#include "nn/layer_util.h"

namespace mha::nn {

namespace {

std::string dims(int64_t L, int64_t S) { return "L = " + std::to_string(L) + ", S = " + std::to_string(S); }

void require_self(const char* fn, const AttentionVariant& a, int64_t L, int64_t S) {
  if (L != S)
    raise<ShapeError>(fn, "key", to_string(a.kind) + " attention over one sequence (L = S)", dims(L, S));
}

// (N, H, L, hd) as axial's (N, H, L / w, w, hd) grid.
Tensor as_grid(const Tensor& t, int64_t width) {
  return t.view({t.size(0), t.size(1), t.size(2) / width, width, t.size(3)});
}

// A (k, max_length) projection cut to the first S columns.
Tensor first_columns(const Tensor& projection, int64_t S) { return projection.slice(1, 0, S).contiguous(); }

// dP (k, S) into a zero (k, max_length) gradient.
Tensor widen(const Tensor& d, int64_t max_length) {
  Tensor out = Tensor::zeros({d.size(0), max_length}, d.dtype());
  out.slice(1, 0, d.size(1)).copy_(d);
  return out;
}

}  // namespace

Tensor variant_forward(const char* fn, const VariantCall& call, const Tensor& q_in, const Tensor& k_in,
                       const Tensor& v_in, VariantSaved& s) {
  const AttentionVariant& a = *call.variant;
  s.call = call;
  s.q = q_in.contiguous(), s.k = k_in.contiguous(), s.v = v_in.contiguous();
  const int64_t L = s.q.size(2), S = s.k.size(2), hd = s.q.size(3);
  if (call.causal && !a.supports_causal())
    raise<ValueError>(fn, "is_causal", "false: " + to_string(a.kind) + " attention has no causal form", "true");
  switch (a.kind) {
    case AttentionKind::strided:
    case AttentionKind::bigbird: {
      require_self(fn, a, L, S);
      s.sparse.causal = call.causal;
      s.sparse.layout =
          a.kind == AttentionKind::strided
              ? strided_layout(L, {.block = a.block, .local_blocks = a.local_blocks, .stride_blocks = a.stride_blocks},
                               call.causal)
              : bigbird_layout(L, {.block = a.block, .global_blocks = a.global_blocks, .window_blocks = a.window_blocks,
                                   .random_blocks = a.random_blocks, .seed = a.seed},
                               call.causal);
      s.sparse_out = block_sparse_attention_forward(s.q, s.k, s.v, s.sparse);
      return s.sparse_out.out;
    }
    case AttentionKind::linear:
      s.linear.causal = call.causal;
      if (call.causal) require_self(fn, a, L, S);
      s.kernel_out = linear_attention_forward(s.q, s.k, s.v, s.linear);
      return s.kernel_out.out;
    case AttentionKind::performer:
      if (call.causal) require_self(fn, a, L, S);
      s.performer = {.features = performer_features(a.features, hd, call.feature_seed, s.q.dtype()),
                     .causal = call.causal};
      s.kernel_out = performer_attention_forward(s.q, s.k, s.v, s.performer);
      return s.kernel_out.out;
    case AttentionKind::linformer:
      if (S > a.max_length)
        raise<ShapeError>(fn, "key", "at most attention.max_length = " + std::to_string(a.max_length) +
                          " keys (linformer's projections)", dims(L, S));
      s.linformer = {.key_projection = first_columns(call.key_projection, S),
                     .value_projection = first_columns(call.value_projection, S)};
      s.linformer_out = linformer_attention_forward(s.q, s.k, s.v, s.linformer);
      return s.linformer_out.out;
    case AttentionKind::lsh:
      require_self(fn, a, L, S);
      s.lsh = {.buckets = a.buckets > 0 ? a.buckets : std::max<int64_t>(2, ((L + a.chunk - 1) / a.chunk + 1) / 2 * 2),
               .hashes = a.hashes, .chunk = a.chunk, .seed = a.seed, .causal = call.causal};
      s.lsh_out = lsh_attention_forward(s.q, s.v, s.lsh);
      return s.lsh_out.out;
    case AttentionKind::axial:
      require_self(fn, a, L, S);
      if (L % a.axial_width != 0)
        raise<ShapeError>(fn, "query", "a length that is a multiple of attention.axial_width = " +
                          std::to_string(a.axial_width), dims(L, S));
      s.axial_out = axial_attention_forward(as_grid(s.q, a.axial_width), as_grid(s.k, a.axial_width),
                                            as_grid(s.v, a.axial_width));
      return s.axial_out.out.view(s.q.shape());
    case AttentionKind::full:
    case AttentionKind::window: break;
  }
  raise<ValueError>(fn, "attention.kind", "an efficient variant (full and window run attention_forward)",
                    to_string(a.kind));
}

VariantGradients variant_backward(const VariantSaved& s, const Tensor& dout_in) {
  const AttentionVariant& a = *s.call.variant;
  const Tensor dout = dout_in.contiguous();
  VariantGradients g;
  auto take = [&](const AttentionGradients& ag) { g.dq = ag.dquery, g.dk = ag.dkey, g.dv = ag.dvalue; };
  switch (a.kind) {
    case AttentionKind::strided:
    case AttentionKind::bigbird:
      take(block_sparse_attention_backward(dout, s.q, s.k, s.v, s.sparse_out, s.sparse));
      break;
    case AttentionKind::linear: take(linear_attention_backward(dout, s.q, s.k, s.v, s.kernel_out, s.linear)); break;
    case AttentionKind::performer:
      take(performer_attention_backward(dout, s.q, s.k, s.v, s.kernel_out, s.performer));
      break;
    case AttentionKind::linformer: {
      const LinformerGradients lg = linformer_attention_backward(dout, s.q, s.k, s.v, s.linformer_out, s.linformer);
      g.dq = lg.dquery, g.dk = lg.dkey, g.dv = lg.dvalue;
      g.dkey_projection = widen(lg.dkey_projection, a.max_length);
      g.dvalue_projection = widen(lg.dvalue_projection, a.max_length);
      break;
    }
    case AttentionKind::lsh: {
      const LshGradients lg = lsh_attention_backward(dout, s.q, s.v, s.lsh_out, s.lsh);
      g.dq = lg.dquery, g.dv = lg.dvalue, g.dk = Tensor::zeros(s.k.shape(), s.k.dtype());
      break;
    }
    case AttentionKind::axial: {
      const int64_t w = a.axial_width;
      take(axial_attention_backward(as_grid(dout, w), as_grid(s.q, w), as_grid(s.k, w), as_grid(s.v, w), s.axial_out));
      g.dq = g.dq.view(s.q.shape()), g.dk = g.dk.view(s.k.shape()), g.dv = g.dv.view(s.v.shape());
      break;
    }
    case AttentionKind::full:
    case AttentionKind::window: break;
  }
  return g;
}

}  // namespace mha::nn
