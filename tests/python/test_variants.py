"""The efficient variants from Python, against their definitions written in float64 NumPy.

Each variant: float32 arrays within 1e-5 of the float64 formula (max abs error over
outputs of unit scale), float64 within 1e-10; torch tensors in give the NumPy results
and torch tensors out; torch.autograd.gradcheck in float64 checks the C++ backward
(every input that has a gradient, the Linformer projections included).
"""
import numpy as np
import pytest
import torch

import mha

F = mha.functional


def rand(*shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def softmax_rows(s, allowed):
    """Row softmax of s over the allowed entries; 0 for a row with none."""
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    return np.divide(p, den, out=np.zeros_like(p), where=den > 0)


def dense(q, k, v, allowed, scale=None):
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    return softmax_rows(np.einsum("...le,...se->...ls", q, k) * scale, allowed) @ v


def linear_formula(pq, pk, v, causal):
    """out_i = Σ_j (pq_i·pk_j) v_j / Σ_j pq_i·pk_j over j (<= i when causal)."""
    a = np.einsum("...lf,...sf->...ls", pq, pk)
    if causal:
        a = np.tril(a)
    return (a @ v) / a.sum(-1, keepdims=True)


def check(run, formula, inputs, tol32=1e-5, tol64=1e-10):
    """run(*arrays) on float32 and float64 copies of `inputs` against formula(*float64 arrays);
    then the torch path gives the same as the NumPy path."""
    want = formula(*inputs)
    for dtype, tol in ((np.float32, tol32), (np.float64, tol64)):
        got = run(*[x.astype(dtype) for x in inputs])
        assert isinstance(got, np.ndarray) and got.dtype == dtype
        err = np.abs(got.astype(np.float64) - want).max()
        assert err <= tol, f"{dtype.__name__}: max error {err:.3g} > {tol}"
    tensors = [torch.from_numpy(x) for x in inputs]
    got = run(*tensors)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), run(*inputs))


def gradcheck(run, inputs):
    tensors = [torch.from_numpy(x.copy()).requires_grad_(True) for x in inputs]
    assert torch.autograd.gradcheck(run, tensors, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse(causal):
    L, E, Ev = 22, 5, 3
    layout = F.strided_layout(L, block=4, local_blocks=1, stride_blocks=2, causal=causal)
    allowed = F.block_sparse_mask(layout, L, L, causal)
    assert allowed.shape == (L, L) and allowed.dtype == bool and 0 < allowed.sum() < L * L
    inputs = [rand(2, L, E, seed=1), rand(2, L, E, seed=2), rand(2, L, Ev, seed=3)]
    run = lambda q, k, v: F.block_sparse_attention(q, k, v, layout, causal=causal)  # noqa: E731
    check(run, lambda q, k, v: dense(q, k, v, allowed), inputs)
    gradcheck(run, inputs)
    big = F.bigbird_layout(L, block=4, global_blocks=1, window_blocks=1, random_blocks=1, seed=3)
    allowed = F.block_sparse_mask(big, L, L)
    check(lambda q, k, v: F.block_sparse_attention(q, k, v, big), lambda q, k, v: dense(q, k, v, allowed), inputs)
    out, lse = F.block_sparse_attention(*inputs, layout, causal=causal, return_lse=True)
    assert lse.shape == (2, L)


def elu1(x):
    return np.where(x > 0, x + 1, np.exp(x))


@pytest.mark.parametrize("causal", [False, True])
def test_linear(causal):
    inputs = [rand(2, 17, 4, seed=4), rand(2, 17, 4, seed=5), rand(2, 17, 3, seed=6)]
    run = lambda q, k, v: F.linear_attention(q, k, v, causal=causal)  # noqa: E731
    check(run, lambda q, k, v: linear_formula(elu1(q), elu1(k), v, causal), inputs)
    gradcheck(run, inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_performer(causal):
    L, E, m = 15, 4, 12
    w = F.performer_features(m, E, seed=7, dtype="float64")
    assert w.shape == (m, E)
    inputs = [rand(2, L, E, seed=8) * 0.5, rand(2, L, E, seed=9) * 0.5, rand(2, L, 3, seed=10)]
    scale = 1 / np.sqrt(E)

    def formula(q, k, v):
        def phi(x):
            x = x * np.sqrt(scale)
            return np.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdims=True)) / np.sqrt(m)
        return linear_formula(phi(q), phi(k), v, causal)

    def run(q, k, v):
        feats = w.astype(np.float32) if getattr(q, "dtype", None) == np.float32 else w
        if isinstance(q, torch.Tensor):
            feats = torch.from_numpy(w).to(q.dtype)
        return F.performer_attention(q, k, v, feats, causal=causal)

    check(run, formula, inputs)
    gradcheck(run, inputs)


def test_linformer():
    L, S, E, Ev, k = 9, 13, 4, 3, 5
    pk, pv = F.linformer_projection(k, S, seed=1, dtype="float64"), F.linformer_projection(k, S, seed=2, dtype="float64")
    assert pk.shape == (k, S)
    inputs = [rand(2, L, E, seed=11), rand(2, S, E, seed=12), rand(2, S, Ev, seed=13), pk, pv]
    formula = lambda q, kk, v, a, b: dense(q, a @ kk, b @ v, np.ones((L, k), bool))  # noqa: E731
    check(lambda *x: F.linformer_attention(*x), formula, inputs)
    check(lambda *x: F.linformer_attention(*x, path="reference"), formula, inputs)
    gradcheck(lambda *x: F.linformer_attention(*x), inputs)  # the projections' gradients too


def lsh_formula(q, v, buckets, hashes, chunk, seed, causal):
    """Each round sorts positions by (bucket, position); a query sees the keys of its chunk and of the
    chunk before (the first sees the last), not itself, j <= i when causal; rounds add up as a multiset;
    a query no round gives a key returns its own value."""
    rounds = F.lsh_buckets(q, buckets=buckets, hashes=hashes, chunk=chunk, seed=seed)
    L = q.shape[-2]
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for b in range(q.shape[0]):
        keys = q[b] / np.linalg.norm(q[b], axis=-1, keepdims=True)
        s = q[b] @ keys.T / np.sqrt(q.shape[-1])
        count = np.zeros((L, L))
        for r in range(hashes):
            order = np.argsort(rounds[r, b], kind="stable")
            chunks = (L + chunk - 1) // chunk
            for p in range(L):
                c = p // chunk
                for cc in (c, (c - 1) % chunks):
                    for x in range(cc * chunk, min(L, (cc + 1) * chunk)):
                        i, j = order[p], order[x]
                        if j != i and (not causal or j < i):
                            count[i, j] += 1
        for i in range(L):
            if count[i].sum() == 0:
                out[b, i] = v[b, i]
                continue
            e = count[i] * np.exp(s[i] - s[i][count[i] > 0].max())
            out[b, i] = e @ v[b] / e.sum()
    return out


@pytest.mark.parametrize("hashes,causal", [(1, False), (2, False), (2, True)])
def test_lsh(hashes, causal):
    L, E = 24, 4
    opts = dict(buckets=4, hashes=hashes, chunk=4, seed=5, causal=causal)
    inputs = [rand(2, L, E, seed=14), rand(2, L, 3, seed=15)]
    run = lambda q, v: F.lsh_attention(q, v, **opts)  # noqa: E731
    check(run, lambda q, v: lsh_formula(q, v, **opts), inputs)
    gradcheck(run, inputs)


def test_axial():
    rows, cols, E, Ev = 3, 5, 4, 2
    inputs = [rand(2, rows, cols, E, seed=16), rand(2, rows, cols, E, seed=17), rand(2, rows, cols, Ev, seed=18)]

    def formula(q, k, v):
        y = dense(q, k, v, np.ones((cols, cols), bool))  # along each row
        t = lambda x: np.swapaxes(x, -2, -3)  # noqa: E731  (rows, cols) -> (cols, rows)
        return t(dense(t(q), t(k), t(y), np.ones((rows, rows), bool)))  # along each column, reading y

    check(lambda q, k, v: F.axial_attention(q, k, v), formula, inputs)
    check(lambda q, k, v: F.axial_attention(q, k, v, path="reference"), formula, inputs)
    gradcheck(lambda q, k, v: F.axial_attention(q, k, v), inputs)


def test_bad_input_names_the_function_and_argument():
    q = np.zeros((2, 5, 4), np.float32)
    with pytest.raises(mha.ShapeError, match=r"mha::linear_attention_forward.*key"):
        F.linear_attention(q, np.zeros((2, 6, 4), np.float32), np.zeros((2, 5, 3), np.float32), causal=True)
    with pytest.raises(ValueError, match="dtype: expected 'float32' or 'float64'"):
        F.performer_features(4, 4, dtype="int8")
    with pytest.raises(ValueError, match="path"):
        F.axial_attention(np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)), path="fast")


# mha.nn.MultiheadAttention(attention=...): the variant chosen per head.

KINDS = ["full", "window", "strided", "bigbird", "linear", "performer", "linformer", "lsh",
         {"kind": "axial", "axial_width": 4}]


def projected_heads(m, x):
    n, L, d = x.shape
    q, k, v = torch.nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, -1)
    return [t.reshape(n, L, m.num_heads, d // m.num_heads).transpose(1, 2) for t in (q, k, v)]


def merged(m, o):
    n, h, L, hd = o.shape
    return m.out_proj(o.transpose(1, 2).reshape(n, L, h * hd))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k if isinstance(k, str) else k["kind"])
def test_module_every_kind_forward_and_backward(kind):
    torch.manual_seed(0)
    m = mha.nn.MultiheadAttention(16, 2, batch_first=True, attention=kind)
    x = torch.randn(3, 16, 16, requires_grad=True)
    out, weights = m(x, x, x)
    assert out.shape == (3, 16, 16)
    assert (weights is None) == (m.attention["kind"] not in ("full", "window"))
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    if m.attention["kind"] == "linformer":
        assert [n for n, _ in m.named_parameters()][-2:] == ["linformer.key_projection", "linformer.value_projection"]


def test_module_equals_the_functional_variant_between_its_projections():
    torch.manual_seed(1)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    m = mha.nn.MultiheadAttention(16, 4, batch_first=True, attention="linear", dtype=torch.float64)
    q, k, v = projected_heads(m, x)
    torch.testing.assert_close(m(x, x, x, is_causal=True)[0], merged(m, F.linear_attention(q, k, v, causal=True)))
    m = mha.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64,
                                  attention={"kind": "linformer", "projected": 5, "max_length": 20})
    q, k, v = projected_heads(m, x)
    pk, pv = m.linformer.key_projection[:, :12], m.linformer.value_projection[:, :12]
    torch.testing.assert_close(m(x, x, x)[0], merged(m, F.linformer_attention(q, k, v, pk, pv)))
    m = mha.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64,
                                  attention={"kind": "strided", "block": 4, "local_blocks": 1, "stride_blocks": 2})
    q, k, v = projected_heads(m, x)
    layout = F.strided_layout(12, block=4, local_blocks=1, stride_blocks=2, causal=True)
    torch.testing.assert_close(m(x, x, x, is_causal=True)[0],
                               merged(m, F.block_sparse_attention(q, k, v, layout, causal=True)))


@pytest.mark.parametrize("kind", ["linear", "lsh", "performer", "linformer"])
def test_module_gradcheck(kind):
    torch.manual_seed(2)
    m = mha.nn.MultiheadAttention(8, 2, batch_first=True, attention=kind, dtype=torch.float64)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    m.eval()  # performer: the same features in every call
    assert torch.autograd.gradcheck(lambda t: m(t, t, t)[0], (x,), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_module_bad_attention_names_the_field():
    with pytest.raises(ValueError, match="attention"):
        mha.nn.MultiheadAttention(8, 2, attention={"kind": "lsh", "hashs": 2})
    with pytest.raises(ValueError):
        mha.nn.MultiheadAttention(8, 2, attention="sparse")
    with pytest.raises(ValueError):
        mha.nn.MultiheadAttention(8, 2, dropout=0.1, attention="linear")


@pytest.mark.parametrize("call", [lambda q, k, v: F.linear_attention(q, k, v, causal=True),
                                  lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)])
def test_backward_twice_with_a_retained_graph_and_once_without(call):
    # The C++ state kept on the autograd ctx is dropped once autograd frees the graph's saved tensors
    # (mha/_autograd.py): a retained graph keeps it for a second backward; a freed one refuses as torch does.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8, requires_grad=True) for _ in range(3))
    y = call(q, k, v)
    y.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in (q, k, v)]
    call(q, k, v).sum().backward()  # another call and backward between the two
    for t in (q, k, v):
        t.grad = None
    y.sum().backward()
    for a, t in zip(first, (q, k, v)):
        assert torch.allclose(t.grad, a), "the retained graph's second backward"
    call(q, k, v)  # drops y's state: its saved tensors are freed now
    with pytest.raises(RuntimeError):
        y.sum().backward()
