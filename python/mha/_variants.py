"""The efficient variants (docs/variants.md), re-exported by mha.functional.

Each takes NumPy arrays (giving NumPy arrays) or torch CPU tensors (giving
tensors with autograd: backward runs the variant's C++ backward). Shapes:
query (..., L, E), key (..., S, E), value (..., S, Ev); leading dims are batch
dims that must match (no broadcasting, as in the C++ API).

    block_sparse_attention   exact softmax attention over a block layout
                             (strided_layout, bigbird_layout; block_sparse_mask draws it)
    linear_attention         phi(x) = elu(x) + 1 feature maps, O(L)
    performer_attention      FAVOR+ random features (performer_features), approximates softmax
    linformer_attention      keys and values projected along the sequence (linformer_projection)
    lsh_attention            Reformer's shared-QK attention within hash buckets
    axial_attention          along rows, then columns, of (..., rows, cols, E)
"""
from . import _mha
from ._autograd import drop_freed, ran_backward
from ._convert import is_torch, to_numpy, to_torch, torch

__all__ = ["block_sparse_attention", "strided_layout", "bigbird_layout", "block_sparse_mask", "linear_attention",
           "performer_attention", "performer_features", "linformer_attention", "linformer_projection",
           "lsh_attention", "lsh_buckets", "axial_attention"]

strided_layout = _mha.strided_layout
bigbird_layout = _mha.bigbird_layout
performer_features = _mha.performer_features
linformer_projection = _mha.linformer_projection


def block_sparse_mask(layout, L, S, causal=False):
    """The layout as a dense (L, S) bool mask (True = attends), for checks and pictures."""
    return _mha.block_sparse_mask(layout, L, S, causal)


def lsh_buckets(query, *, buckets=8, hashes=1, chunk=64, seed=0):
    """Each round's bucket of every query (hashes, ..., L), as lsh_attention hashes them."""
    return _mha.lsh_buckets(to_numpy(query, "mha.functional.lsh_buckets", "query")[0], buckets, hashes, chunk, seed)


def _run(fn, forward, tensors, outputs):
    """Calls forward(*arrays, bf16) on the arrays of `tensors`; returns its first `outputs` results.

    forward returns (results..., call). With torch tensors the call is kept for
    backward, which gives one gradient per tensor (None where it has none).
    """
    names = [name for name, _ in tensors]
    values = [value for _, value in tensors]
    if any(is_torch(v) for v in values):
        return _Variant.apply(fn, forward, names, outputs, *values)
    return _call(fn, forward, names, values)[:outputs]


def _call(fn, forward, names, values):
    """forward(*arrays, bf16) on the values as arrays; its results, and whether they are bfloat16."""
    arrays = [to_numpy(v, fn, name) for name, v in zip(names, values)]
    bf16 = any(flag for _, flag in arrays)
    return forward(*[a for a, _ in arrays], bf16) + (bf16,)


if torch is not None:
    class _Variant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, fn, forward, names, outputs, *tensors):
            drop_freed()
            *results, bf16 = _call(fn, forward, names, tensors)
            ctx.call, ctx.bf16, ctx.fn, ctx.inputs = results[-1], bf16, fn, len(tensors)
            out = tuple(to_torch(r, bf16) for r in results[:outputs])
            ctx.mark_non_differentiable(*out[1:])
            ctx.set_materialize_grads(False)
            return out

        @staticmethod
        def backward(ctx, dout, *_rest):
            drop_freed()
            if dout is None:  # only the non-differentiable outputs were used
                return (None,) * (4 + ctx.inputs)
            ctx.saved_tensors  # none saved, but torch refuses a second backward through a freed graph here
            grads = ctx.call.backward(to_numpy(dout.contiguous(), ctx.fn + ".backward", "grad_out")[0])
            ran_backward(ctx, "call")  # what the C++ call saved, once autograd frees the graph
            return (None, None, None, None) + tuple(to_torch(g, ctx.bf16) for g in grads)


def _scale(scale):
    return None if scale is None else float(scale)


def block_sparse_attention(query, key, value, layout, *, causal=False, scale=None, return_lse=False):
    """Softmax attention restricted to the layout's blocks (causal: also j <= i), exact within them.

    A query that sees no key gives 0 (lse -inf). Returns out, or (out, lse).
    """
    fn = "mha.functional.block_sparse_attention"
    out, lse = _run(fn, lambda q, k, v, bf16: _mha.block_sparse_forward(q, k, v, layout, causal, _scale(scale), bf16),
                    [("query", query), ("key", key), ("value", value)], 2)
    return (out, lse) if return_lse else out


def linear_attention(query, key, value, *, causal=False):
    """Katharopoulos et al.: out_i = phi(q_i)·sum_j phi(k_j) v_j^T / phi(q_i)·sum_j phi(k_j), phi = elu + 1."""
    fn = "mha.functional.linear_attention"
    return _run(fn, lambda q, k, v, bf16: _mha.linear_forward(q, k, v, causal, bf16),
                [("query", query), ("key", key), ("value", value)], 1)[0]


def performer_attention(query, key, value, features, *, causal=False, scale=None):
    """FAVOR+: linear attention with positive random features approximating exp(scale q·k).

    features (m, E) from performer_features (no gradient flows to it).
    """
    fn = "mha.functional.performer_attention"
    w = to_numpy(features, fn, "features")[0]
    return _run(fn, lambda q, k, v, bf16: _mha.performer_forward(q, k, v, w, causal, _scale(scale), bf16),
                [("query", query), ("key", key), ("value", value)], 1)[0]


def linformer_attention(query, key, value, key_projection, value_projection, *, scale=None, path="automatic"):
    """softmax(scale Q (P_K K)^T) (P_V V) with P_K, P_V (k, S): the projections get gradients too."""
    fn = "mha.functional.linformer_attention"
    return _run(fn, lambda q, k, v, pk, pv, bf16: _mha.linformer_forward(q, k, v, pk, pv, _scale(scale), path, bf16),
                [("query", query), ("key", key), ("value", value), ("key_projection", key_projection),
                 ("value_projection", value_projection)], 1)[0]


def lsh_attention(query, value, *, buckets=8, hashes=1, chunk=64, seed=0, causal=False, scale=None,
                  return_lse=False):
    """Reformer: keys are the normalised queries; each query attends within its sorted chunk and the one before,
    over `hashes` rounds of `buckets` buckets (seed draws the rotations). Returns out, or (out, lse)."""
    fn = "mha.functional.lsh_attention"
    out, lse = _run(fn, lambda q, v, bf16: _mha.lsh_forward(q, v, buckets, hashes, chunk, seed, causal,
                                                            _scale(scale), bf16),
                    [("query", query), ("value", value)], 2)
    return (out, lse) if return_lse else out


def axial_attention(query, key, value, *, scale=None, path="automatic"):
    """Attention along each row of (..., rows, cols, E), then along each column (reading the rows' output)."""
    fn = "mha.functional.axial_attention"
    return _run(fn, lambda q, k, v, bf16: _mha.axial_forward(q, k, v, _scale(scale), path, bf16),
                [("query", query), ("key", key), ("value", value)], 1)[0]
