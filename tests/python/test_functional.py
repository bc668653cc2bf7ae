"""mha.functional against the formula computed in float64 by torch operations.

PyTorch 1.13 (Debian's python3-torch) has no public scaled_dot_product_attention,
so the reference is softmax(Q Kᵀ · scale + mask) V written out in float64.
"""
import math
import zlib

import numpy as np
import pytest
import torch

import mha
from conftest import compare

F = mha.functional


def formula(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    """PyTorch 2.x's documented math for scaled_dot_product_attention, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    if gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = q @ k.transpose(-2, -1) * scale
    L, S = logits.shape[-2:]
    if causal:
        mask = torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.double()
    return torch.softmax(logits, -1) @ v


def rand(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


MASKS = ["none", "bool2d", "float2d", "bool4d", "float3d_broadcast", "causal"]


def make_mask(kind, B, H, L, S):
    if kind == "bool2d":
        m = torch.rand(L, S) > 0.3
        m[:, 0] = True  # every row keeps a key: PyTorch's formula gives NaN otherwise
        return m
    if kind == "float2d":
        return torch.randn(L, S)
    if kind == "bool4d":
        m = torch.rand(B, 1, L, S) > 0.5
        m[..., -1] = True
        return m
    if kind == "float3d_broadcast":
        return torch.randn(H, 1, S)
    return None


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", [(2, 3, 7, 5, 8, 8), (1, 2, 1, 9, 16, 4), (3, 1, 17, 17, 3, 5)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_formula_with_gradients(configuration, mask_kind, shape, scale):
    torch.manual_seed(zlib.crc32(repr((mask_kind, shape, scale)).encode()))
    B, H, L, S, E, Ev = shape
    q, k, v = rand(B, H, L, E), rand(B, H, S, E), rand(B, H, S, Ev)
    mask = make_mask(mask_kind, B, H, L, S)
    causal = mask_kind == "causal"
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = formula(q64, k64, v64, mask, causal, scale)
    what = f"sdpa {mask_kind} {shape} scale={scale}"
    compare(out, ref, what + " out")
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g.float())
    refs = torch.autograd.grad(ref, (q64, k64, v64), g)
    for name, a, b in zip("qkv", grads, refs):
        compare(a, b, f"{what} d{name}")


@pytest.mark.parametrize("hk", [1, 2])
def test_grouped_query_attention(configuration, hk):
    torch.manual_seed(hk)
    q, k, v = rand(2, 4, 6, 8), rand(2, hk, 9, 8), rand(2, hk, 9, 8)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = formula(q64, k64, v64, gqa=True)
    compare(out, ref, f"gqa hk={hk} out")
    out.sum().backward()
    ref.sum().backward()
    for a, b, n in ((q, q64, "dq"), (k, k64, "dk"), (v, v64, "dv")):
        compare(a.grad, b.grad, f"gqa hk={hk} {n}")


def test_gqa_needs_enable_gqa_as_in_pytorch():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        F.scaled_dot_product_attention(q, k, k)


def test_is_causal_with_a_mask_is_refused_as_in_pytorch():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)


def test_float_mask_gradient(configuration):
    torch.manual_seed(3)
    q, k, v = rand(2, 2, 5, 4), rand(2, 2, 6, 4), rand(2, 2, 6, 3)
    mask = torch.randn(2, 1, 5, 6, requires_grad=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    m64 = mask.detach().double().requires_grad_()
    ref = formula(q.detach(), k.detach(), v.detach(), m64)
    out.sum().backward()
    ref.sum().backward()
    compare(mask.grad, m64.grad, "float mask gradient")


def test_numpy_in_numpy_out(configuration):
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        q, k, v = (rng.standard_normal((2, 3, 5, 4)).astype(dtype) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert isinstance(out, np.ndarray) and out.dtype == dtype
        ref = formula(*(torch.from_numpy(a) for a in (q, k, v)), causal=True)
        compare(torch.from_numpy(out), ref, f"numpy {np.dtype(dtype).name}")


def test_numpy_views_are_read_without_copies_and_any_strides_work(configuration):
    rng = np.random.default_rng(1)
    base = rng.standard_normal((5, 2, 3, 4)).astype(np.float32)
    q = base.transpose(1, 2, 0, 3)  # (2, 3, 5, 4), not contiguous
    k = base[::-1].transpose(1, 2, 0, 3)  # negative strides: copied first
    out = F.scaled_dot_product_attention(q, k, q)
    ref = formula(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, q)))
    compare(torch.from_numpy(out), ref, "numpy strided")


def test_noncontiguous_torch_inputs(configuration):
    torch.manual_seed(4)
    q = torch.randn(2, 6, 3, 8).transpose(1, 2).requires_grad_()  # (2, 3, 6, 8)
    k = torch.randn(8, 5, 3, 2).permute(3, 2, 1, 0).requires_grad_()  # (2, 3, 5, 8)
    v = torch.randn(2, 3, 5, 8)[..., ::2].requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = formula(q64, k64, v64)
    compare(out, ref, "non-contiguous out")
    out.sum().backward()
    ref.sum().backward()
    compare(k.grad, k64.grad, "non-contiguous dk")


def test_fully_masked_rows_give_zero_not_nan():
    # PyTorch's math gives NaN for a row with no allowed key; mha documents 0 (docs/design.md).
    q = torch.randn(1, 1, 3, 4, requires_grad=True)
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    out = F.scaled_dot_product_attention(q, q[:, :, :2].detach(), q[:, :, :2].detach(), attn_mask=mask)
    assert torch.equal(out[0, 0, 1], torch.zeros(4))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_bfloat16_inputs(configuration):
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 2, 33, 64).bfloat16() for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    ref = formula(q, k, v)  # the same bf16-rounded inputs, in float64
    compare(out, ref, "bf16 out", tol=1e-2)


def test_bottom_right_causal_window_weights_and_lse(configuration):
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    out, w, lse = F.attention(q, k, v, causal="bottom_right", window=(2, 0), return_weights=True, return_lse=True)
    i, j = torch.arange(3)[:, None], torch.arange(7)[None, :]
    keep = (j <= i + 4) & (j >= i + 4 - 2)
    ref = formula(q, k, v, keep)
    compare(out, ref, "bottom-right window out")
    logits = (q.double() @ k.double().transpose(-1, -2) / 2).masked_fill(~keep, -math.inf)
    compare(w, torch.softmax(logits, -1), "weights")
    compare(lse, torch.logsumexp(logits, -1), "lse")


def test_dropout_is_seeded_scaled_and_differentiable():
    torch.manual_seed(7)
    q, k, v = rand(1, 1, 64, 16), rand(1, 1, 64, 16), rand(1, 1, 64, 16)
    a = F.attention(q, k, v, dropout_p=0.5, dropout_seed=11, return_weights=True)[1]
    b = F.attention(q, k, v, dropout_p=0.5, dropout_seed=11, return_weights=True)[1]
    c = F.attention(q, k, v, dropout_p=0.5, dropout_seed=12, return_weights=True)[1]
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = (a > 0).float().mean().item()
    assert 0.4 < kept < 0.6
    torch.manual_seed(8)
    x = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(8)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(x, y)  # the seed comes from torch's generator
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a_, b_, c_: F.attention(a_, b_, c_, dropout_p=0.3, dropout_seed=5), (q64[..., :5, :], k64, v64))


def test_errors_are_value_errors_with_the_cpp_message():
    q = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(mha.ShapeError, match=r"\[mha::attention_forward\] key"):
        F.scaled_dot_product_attention(q, np.zeros((2, 3, 5), np.float32), q)
    with pytest.raises(ValueError, match="dropout_p"):
        F.attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="float32"):
        F.attention(q.astype(np.int32), q, q)
    with pytest.raises(ValueError, match="causal"):
        F.attention(q, q, q, causal="diagonal")
    with pytest.raises(ValueError, match="mask gradient"):
        qt = torch.randn(1, 3, 4, requires_grad=True)
        mask = torch.zeros(3, 3, requires_grad=True)
        F.attention(qt, qt, qt, mask, path="fused").sum().backward()


def test_fused_backward_through_the_weights_matches_the_reference_path():
    torch.manual_seed(3)
    grads = {}
    for path in ("fused", "reference"):
        torch.manual_seed(3)
        q, k, v = (torch.randn(2, 3, 37, 16, requires_grad=True) for _ in range(3))
        out, w = F.attention(q, k, v, causal="bottom_right", window=(20, 0), return_weights=True, path=path)
        (out.square().sum() + (w * torch.randn(w.shape)).sum()).backward()
        grads[path] = (q.grad, k.grad, v.grad)
    for name, a, b in zip("qkv", grads["fused"], grads["reference"]):
        compare(a, b, f"fused vs reference d{name} with a loss on the weights", tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss_on", ["weights", "both", "entropy"])
def test_gradients_through_the_returned_weights(configuration, dtype, loss_on):
    """Attention supervision, attention transfer and entropy penalties: a loss on the weights."""
    torch.manual_seed(9)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.rand(6, 6) > 0.3
    mask[:, 0] = True
    target = torch.softmax(torch.randn(2, 3, 6, 6, dtype=dtype), -1)

    def loss(out, w):
        if loss_on == "entropy":
            return -(w * torch.log(w.clamp_min(1e-30))).sum()
        kl = (target * (torch.log(target) - torch.log(w.clamp_min(1e-30)))).sum()
        return kl + (out.square().sum() if loss_on == "both" else 0)

    out, w = F.attention(q, k, v, mask, return_weights=True)
    loss(out, w).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    logits = (q @ k.transpose(-1, -2) / 2).masked_fill(~mask, -math.inf)
    ref_w = torch.softmax(logits, -1)
    loss(ref_w @ v, ref_w).backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    compare(w, ref_w, f"weights ({loss_on})", tol=tol)
    for name, g, t in zip("qkv", got, (q, k, v)):
        want = t.grad if t.grad is not None else torch.zeros_like(t)  # torch: None for v unused
        compare(g, want, f"d{name} through the weights ({loss_on}, {dtype})", tol=tol)


def test_gradcheck_through_the_weights_with_dropout():
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def f(a, b, c):
        out, w = F.attention(a, b, c, causal="top_left", dropout_p=0.2, dropout_seed=4, return_weights=True)
        return out.sum() + (w * torch.arange(5.0, dtype=torch.float64)).sum()

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_nan_propagates_as_in_pytorch():
    # One NaN in a key reaches every output; one in a value, its column of every output.
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    k[0, 0, 2, 1] = float("nan")
    out = mha.functional.scaled_dot_product_attention(q, k, v)
    want = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v  # PyTorch's math path
    assert torch.equal(out.isnan(), want.isnan()) and out[0, 0].isnan().all() and not out[0, 1].isnan().any()
    # A causally excluded NaN key changes nothing: only the mask decides what is masked.
    k = torch.randn(1, 2, 5, 4)
    k[0, 0, 4, 0] = float("nan")
    out = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out[0, 0, :4].isfinite().all() and out[0, 0, 4].isnan().all()


def test_memory_limit_raises_memory_error_before_allocating():
    limit = mha.memory_limit()
    mha.set_memory_limit(mha.active_memory() + (1 << 20))  # 1 MiB past what earlier tests still hold
    try:
        q = np.zeros((1, 1, 600, 4), np.float32)
        with pytest.raises(MemoryError, match=r"shape \(1, 1, 600, 600\) of float32"):
            mha._mha.attention_forward(q, q, q, return_weights=True)
        assert issubclass(mha.MemoryError, MemoryError)
    finally:
        mha.set_memory_limit(0)
    assert mha.memory_limit() == limit
