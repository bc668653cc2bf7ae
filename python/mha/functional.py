"""Attention functions.

scaled_dot_product_attention has the signature and semantics of PyTorch 2.x's
torch.nn.functional.scaled_dot_product_attention:

    softmax(Q Kᵀ · scale + mask) V,   scale = 1/sqrt(E) unless given,

with a boolean attn_mask meaning "True = may attend", a float attn_mask added
to the logits, is_causal the top-left causal mask, and grouped-query
attention (Hq a multiple of Hk) when enable_gqa. One deliberate difference:
a query row whose keys are all masked gives 0, where PyTorch gives NaN.

attention() is the same computation with what PyTorch lacks: the causal
mask aligned to the bottom right (decoding with a KV cache), sliding
windows, and the weights and the log-sum-exp returned.

The efficient variants (block sparse, linear, Performer, Linformer, LSH,
axial) are here too; see their module, mha._variants.
"""
from . import _mha
from ._autograd import drop_freed, ran_backward
from ._convert import draw_seed, is_torch, mask_to_numpy, to_numpy, to_torch, torch
from ._variants import *  # noqa: F401,F403  (the efficient variants)
from ._variants import __all__ as _variants_all

__all__ = ["scaled_dot_product_attention", "attention"] + _variants_all


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    fn = "mha.functional.scaled_dot_product_attention"
    if is_causal and attn_mask is not None:
        raise ValueError(f"[{fn}] attn_mask: expected None when is_causal=True (as PyTorch); got a mask")
    if not enable_gqa and len(query.shape) >= 3 and len(key.shape) >= 3:
        hq, hk = query.shape[-3], key.shape[-3]
        if hk != hq and hk != 1:
            raise ValueError(f"[{fn}] key: expected {hq} heads (or enable_gqa=True for grouped-query "
                             f"attention); got {hk}")
    return attention(query, key, value, attn_mask, causal="top_left" if is_causal else None, scale=scale,
                     dropout_p=dropout_p)


def attention(query, key, value, attn_mask=None, *, causal=None, window=None, scale=None, dropout_p=0.0,
              dropout_seed=None, return_weights=False, return_lse=False, path="automatic"):
    """Scaled dot-product attention with every option of the C++ library.

    query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev); leading dims broadcast;
    Hk dividing Hq is grouped-query attention.
    causal: None, "top_left" (key j <= query i) or "bottom_right" (j <= i + S - L).
    window: (left, right) keeps i + S - L - left <= j <= i + S - L + right; -1 = unbounded.
    dropout_seed: None draws one from torch's (tensors) or NumPy's (arrays) global generator.
    path: "automatic", "reference" or "fused" (see docs/design.md).
    Returns out, or a tuple (out, weights if return_weights, lse if return_lse).
    """
    use_torch = is_torch(query)
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = draw_seed(use_torch)
    left, right = (-1, -1) if window is None else window
    cfg = dict(causal=causal or "none", window_left=int(left), window_right=int(right), scale=scale,
               dropout_p=float(dropout_p), dropout_seed=int(dropout_seed or 0), path=path)
    if use_torch:
        out, weights, lse = _Attention.apply(query, key, value, attn_mask, cfg, return_weights)
    else:
        fn = "mha.functional.attention"
        q, bf16 = to_numpy(query, fn, "query")
        out, lse, weights, _ = _mha.attention_forward(
            q, to_numpy(key, fn, "key")[0], to_numpy(value, fn, "value")[0],
            mask_to_numpy(attn_mask, fn, "attn_mask"), return_weights=return_weights, bf16=bf16, **cfg)
    if not return_weights and not return_lse:
        return out
    return (out,) + ((weights,) if return_weights else ()) + ((lse,) if return_lse else ())


if torch is not None:
    class _Attention(torch.autograd.Function):
        """Forward and backward by the C++ library; saves out and the LSE, never the weights."""

        @staticmethod
        def forward(ctx, query, key, value, attn_mask, cfg, return_weights):
            drop_freed()
            fn = "mha.functional.attention"
            q, bf16 = to_numpy(query, fn, "query")
            k, v = to_numpy(key, fn, "key")[0], to_numpy(value, fn, "value")[0]
            m = mask_to_numpy(attn_mask, fn, "attn_mask")
            out, lse, weights, _ = _mha.attention_forward(q, k, v, m, return_weights=return_weights,
                                                           bf16=bf16, **cfg)
            out, lse, weights = to_torch(out, bf16), to_torch(lse), to_torch(weights, bf16)
            ctx.cfg, ctx.bf16, ctx.mask = cfg, bf16, m
            ctx.save_for_backward(query, key, value, attn_mask if is_torch(attn_mask) else None, out, lse)
            ctx.set_materialize_grads(False)
            ctx.mark_non_differentiable(lse)
            return out, weights, lse

        @staticmethod
        def backward(ctx, dout, dweights, _dlse):
            # A loss on the returned weights adds their gradient to the softmax's (the C++ reference path).
            drop_freed()
            query, key, value, mask, out, lse = ctx.saved_tensors
            if dout is None and dweights is None:
                return (None,) * 6
            if dout is None:
                dout = torch.zeros_like(out)
            fn = "mha.functional.attention.backward"
            mask_grad = bool(ctx.needs_input_grad[3]) and mask is not None and mask.is_floating_point()
            dq, dk, dv, dmask = _mha.attention_backward(
                to_numpy(dout, fn, "grad_out")[0], to_numpy(query, fn, "query")[0],
                to_numpy(key, fn, "key")[0], to_numpy(value, fn, "value")[0], to_numpy(out, fn, "out")[0],
                to_numpy(lse, fn, "lse")[0], ctx.mask, mask_grad=mask_grad, bf16=ctx.bf16,
                grad_weights=to_numpy(dweights.contiguous(), fn, "grad_weights")[0] if dweights is not None else None,
                **ctx.cfg)
            dmask = to_torch(dmask)
            if dmask is not None:
                dmask = dmask.to(mask.dtype)
            ran_backward(ctx, "mask")  # the mask as converted (a copy for bfloat16 or bytes)
            return (to_torch(dq, ctx.bf16), to_torch(dk, ctx.bf16), to_torch(dv, ctx.bf16), dmask, None, None)
