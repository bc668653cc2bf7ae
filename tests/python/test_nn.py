"""mha.nn against torch.nn (PyTorch 1.13): same weights and inputs, same outputs and gradients
(through the returned attention weights too, where a module returns them).

Each configuration builds the torch module, loads its state_dict into mha's,
runs both on the same inputs and compares the outputs, the returned weights,
the gradients of every input and of every parameter (float32, relative error
<= 1e-5). Dropout is 0 so that both compute the same function.
"""
import copy
import itertools

import pytest
import torch

import mha
from conftest import compare

N, L, S, E, H = 3, 5, 6, 16, 4


def compare_modules(ours, theirs, inputs, call, what):
    """Runs call(module, *inputs) on both; compares every output and gradient."""
    xs_a = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    xs_b = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out_a, out_b = call(ours, *xs_a), call(theirs, *xs_b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    for i, (a, b) in enumerate(zip(out_a, out_b)):
        if b is None:
            assert a is None, f"{what}: output {i} should be None"
        else:
            compare(a, b, f"{what} output {i}")
    g = torch.randn_like(out_b[0])
    loss_a, loss_b = (out_a[0] * g).sum(), (out_b[0] * g).sum()
    if len(out_b) > 1 and out_b[1] is not None:  # a loss on the attention weights too (averaged or per head)
        gw = torch.randn_like(out_b[1])
        loss_a, loss_b = loss_a + (out_a[1] * gw).sum(), loss_b + (out_b[1] * gw).sum()
    loss_a.backward()
    loss_b.backward()
    for i, (a, b) in enumerate(zip(xs_a, xs_b)):
        if b.grad is not None:
            compare(a.grad, b.grad, f"{what} d(input {i})")
    pa, pb = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert pa.keys() == pb.keys(), f"{what}: parameter names differ"
    for name in pb:
        compare(pa[name].grad, pb[name].grad, f"{what} d({name})")


def twin(torch_cls, mha_cls, *args, **kwargs):
    theirs = torch_cls(*args, **kwargs)
    ours = mha_cls(*args, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def bool_mask(*shape, p=0.3):
    m = torch.rand(*shape) < p  # True = not allowed (torch.nn's convention)
    m[..., 0] = False  # every query keeps a key: torch gives NaN otherwise
    return m


MHA_MASKS = {
    "none": lambda: (None, None),
    "bool2d": lambda: (None, bool_mask(L, S)),
    "float2d": lambda: (None, torch.randn(L, S)),
    "bool3d": lambda: (None, bool_mask(N * H, L, S)),
    "float3d": lambda: (None, torch.randn(N * H, L, S)),
    "kpm_bool": lambda: (bool_mask(N, S), None),
    "kpm_float": lambda: (torch.randn(N, S), None),
    "kpm_and_bool2d": lambda: (bool_mask(N, S, p=0.2), bool_mask(L, S, p=0.2)),
}


@pytest.mark.parametrize("mask", list(MHA_MASKS))
@pytest.mark.parametrize("batch_first,kvdim,bias,bias_kv,zero_attn",
                         [(False, False, True, False, False), (True, False, True, False, False),
                          (False, True, True, False, False), (True, True, False, False, False),
                          (False, False, True, True, False), (False, False, True, False, True),
                          (True, True, True, True, True)])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_multihead_attention(configuration, mask, batch_first, kvdim, bias, bias_kv, zero_attn, need_weights,
                             average):
    torch.manual_seed(0)
    kdim, vdim = (12, 10) if kvdim else (None, None)
    ours, theirs = twin(torch.nn.MultiheadAttention, mha.nn.MultiheadAttention, E, H, bias=bias,
                        add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=vdim,
                        batch_first=batch_first)
    kpm, am = MHA_MASKS[mask]()
    seq = (lambda n, l, d: (n, l, d)) if batch_first else (lambda n, l, d: (l, n, d))
    q = torch.randn(*seq(N, L, E))
    k = torch.randn(*seq(N, S, kdim or E))
    v = torch.randn(*seq(N, S, vdim or E))

    def call(m, q_, k_, v_):
        return m(q_, k_, v_, key_padding_mask=kpm, need_weights=need_weights, attn_mask=am,
                 average_attn_weights=average)

    what = f"MHA mask={mask} bf={batch_first} kvdim={kvdim} bias={bias} bias_kv={bias_kv} " \
           f"zero_attn={zero_attn} weights={need_weights}/{average}"
    compare_modules(ours, theirs, [q, k, v], call, what)


@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_self_attention_and_unbatched(configuration, batch_first):
    torch.manual_seed(1)
    ours, theirs = twin(torch.nn.MultiheadAttention, mha.nn.MultiheadAttention, E, H, batch_first=batch_first)
    x = torch.randn(N, L, E) if batch_first else torch.randn(L, N, E)
    compare_modules(ours, theirs, [x], lambda m, x_: m(x_, x_, x_), f"MHA self bf={batch_first}")
    u, mask = torch.randn(L, E), bool_mask(L, L)
    compare_modules(ours, theirs, [u], lambda m, u_: m(u_, u_, u_, attn_mask=mask),
                    f"MHA unbatched bf={batch_first}")


def test_is_causal_equals_an_explicit_causal_mask(configuration):
    torch.manual_seed(2)
    ours, theirs = twin(torch.nn.MultiheadAttention, mha.nn.MultiheadAttention, E, H)
    x = torch.randn(L, N, E)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    compare_modules(ours, theirs, [x], lambda m, x_: m(x_, x_, x_, is_causal=True) if m is ours
                    else m(x_, x_, x_, attn_mask=causal), "MHA is_causal")


LAYER_MASKS = ["none", "bool", "float", "causal", "kpm"]


@pytest.mark.parametrize("norm_first,activation,batch_first", list(itertools.product(
    [False, True], ["relu", "gelu"], [False, True])))
@pytest.mark.parametrize("mask", LAYER_MASKS)
def test_transformer_encoder_layer(configuration, norm_first, activation, batch_first, mask):
    torch.manual_seed(3)
    ours, theirs = twin(torch.nn.TransformerEncoderLayer, mha.nn.TransformerEncoderLayer, E, H,
                        dim_feedforward=24, dropout=0.0, activation=activation, batch_first=batch_first,
                        norm_first=norm_first)
    x = torch.randn(N, S, E) if batch_first else torch.randn(S, N, E)
    src_mask = {"bool": bool_mask(S, S), "float": torch.randn(S, S),
                "causal": torch.ones(S, S, dtype=torch.bool).triu(1)}.get(mask)
    kpm = bool_mask(N, S) if mask == "kpm" else None
    compare_modules(ours, theirs, [x], lambda m, x_: m(x_, src_mask=src_mask, src_key_padding_mask=kpm),
                    f"encoder norm_first={norm_first} {activation} bf={batch_first} mask={mask}")


@pytest.mark.parametrize("norm_first,activation,batch_first", list(itertools.product(
    [False, True], ["relu", "gelu"], [False, True])))
@pytest.mark.parametrize("mask", LAYER_MASKS)
def test_transformer_decoder_layer(configuration, norm_first, activation, batch_first, mask):
    torch.manual_seed(4)
    ours, theirs = twin(torch.nn.TransformerDecoderLayer, mha.nn.TransformerDecoderLayer, E, H,
                        dim_feedforward=24, dropout=0.0, activation=activation, batch_first=batch_first,
                        norm_first=norm_first)
    T = L
    tgt = torch.randn(N, T, E) if batch_first else torch.randn(T, N, E)
    memory = torch.randn(N, S, E) if batch_first else torch.randn(S, N, E)
    kwargs = {}
    if mask == "bool":
        kwargs = {"tgt_mask": bool_mask(T, T), "memory_mask": bool_mask(T, S)}
    elif mask == "float":
        kwargs = {"tgt_mask": torch.randn(T, T), "memory_mask": torch.randn(T, S)}
    elif mask == "causal":
        kwargs = {"tgt_mask": torch.ones(T, T, dtype=torch.bool).triu(1)}
    elif mask == "kpm":
        kwargs = {"tgt_key_padding_mask": bool_mask(N, T), "memory_key_padding_mask": bool_mask(N, S)}
    compare_modules(ours, theirs, [tgt, memory], lambda m, t_, m_: m(t_, m_, **kwargs),
                    f"decoder norm_first={norm_first} {activation} bf={batch_first} mask={mask}")


def test_initialised_as_torch_and_state_dicts_load_both_ways():
    for make in (lambda ns: ns.MultiheadAttention(E, H, kdim=12, vdim=10, add_bias_kv=True),
                 lambda ns: ns.TransformerEncoderLayer(E, H, 24),
                 lambda ns: ns.TransformerDecoderLayer(E, H, 24, norm_first=True)):
        torch.manual_seed(5)
        theirs = make(torch.nn)
        torch.manual_seed(5)
        ours = make(mha.nn)
        a, b = ours.state_dict(), theirs.state_dict()
        assert list(a) == list(b)
        assert all(torch.equal(a[k], b[k]) for k in a)
        theirs.load_state_dict(ours.state_dict())


def test_a_layer_called_twice_before_backward(configuration):
    torch.manual_seed(6)
    ours, theirs = twin(torch.nn.TransformerEncoderLayer, mha.nn.TransformerEncoderLayer, E, H, 24, dropout=0.0)
    x = torch.randn(S, N, E)
    compare_modules(ours, theirs, [x], lambda m, x_: m(m(x_)), "encoder applied twice")


def test_inside_torch_transformer_encoder_and_float64(configuration):
    torch.manual_seed(7)
    layer = mha.nn.TransformerEncoderLayer(E, H, 24, dropout=0.0, batch_first=True)
    ours = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)  # deep-copies the layer
    theirs = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(E, H, 24, dropout=0.0, batch_first=True),
                                         num_layers=2, enable_nested_tensor=False)
    theirs.load_state_dict(ours.state_dict())
    compare_modules(ours, theirs, [torch.randn(N, S, E)], lambda m, x_: m(x_), "TransformerEncoder stack")
    ours64, theirs64 = copy.deepcopy(ours).double(), copy.deepcopy(theirs).double()
    x = torch.randn(N, S, E, dtype=torch.float64)
    compare(ours64(x), theirs64(x), "TransformerEncoder stack float64", tol=1e-12)


def test_fully_masked_key_padding_gives_bias_not_nan():
    # torch.nn.MultiheadAttention gives NaN when every key of a sequence is padding; mha gives
    # attention 0, so the output is the out_proj bias (docs/design.md).
    torch.manual_seed(8)
    m = mha.nn.MultiheadAttention(E, H)
    torch.nn.init.normal_(m.out_proj.bias)
    x = torch.randn(L, N, E, requires_grad=True)
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[1] = True
    out, w = m(x, x, x, key_padding_mask=kpm)
    assert torch.allclose(out[:, 1], m.out_proj.bias.expand(L, E))
    assert torch.equal(w[1], torch.zeros(L, L))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_training_dropout_is_reproducible_from_torch_seed():
    layer = mha.nn.TransformerEncoderLayer(E, H, 24, dropout=0.3)
    x = torch.randn(S, N, E)
    torch.manual_seed(9)
    a = layer(x)
    torch.manual_seed(9)
    b = layer(x)
    c = layer(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    layer.eval()
    assert torch.equal(layer(x), layer(x))


def test_errors():
    with pytest.raises(ValueError, match="embed_dim"):
        mha.nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="activation"):
        mha.nn.TransformerEncoderLayer(E, H, activation=torch.tanh)
    m = mha.nn.MultiheadAttention(E, H)
    with pytest.raises(ValueError, match=r"\[mha::nn::MultiheadAttention::forward\]"):
        m(torch.randn(L, N, E + 1), torch.randn(L, N, E), torch.randn(L, N, E))
    x = torch.randn(L, N, E, requires_grad=True)
    m(x, x, x)[1].square().sum().backward()  # a loss on the weights alone reaches the input
    assert x.grad is not None and x.grad.abs().sum() > 0


def _layer_and_input():
    torch.manual_seed(0)
    layer = mha.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=True)
    return layer, torch.randn(4, 48, 32, requires_grad=True)


def test_state_freed_after_backward_while_the_output_lives():
    # A training loop keeps the last step's output (logits = model(ids)) until the next forward has run;
    # the saved activations must go with the backward, as torch's own layers' saved tensors do, not with
    # the graph: held, the next forward's peak held them twice.
    layer, x = _layer_and_input()
    base = mha.active_memory()
    y = layer(x, is_causal=True)
    saved = mha.active_memory() - base  # the output and the activations kept for backward
    y.sum().backward()
    y2 = layer(x, is_causal=True)
    held = mha.active_memory() - base  # y2's output and activations, y's output, the gradients (mha's memory)
    kept = 4 * (y.numel() + x.numel() + sum(p.numel() for p in layer.parameters()))
    assert saved > kept, f"the forward saved {saved} bytes"
    assert held <= saved + kept, f"after the next forward {held} bytes held (one step: {saved}, kept: {kept})"
    with pytest.raises(RuntimeError):  # as torch: the graph's buffers are gone
        y.sum().backward()
    del y2


def test_retained_graph_backward_twice():
    layer, x = _layer_and_input()
    y = layer(x, is_causal=True)
    y.sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer(x, is_causal=True)  # another forward between the two backwards keeps y's state
    y.sum().backward()
    second = [p.grad for p in layer.parameters()] + [x.grad]
    for a, b in zip(first, second):
        compare(b, 2 * a, "gradient after two backwards of a retained graph")


def test_kept_scores_leave_training_gradients_unchanged():
    # In training, mha's layers keep each attention call's scores for the backward when they fit
    # under mha.score_memory_limit() (C++ nn::set_score_memory_limit): the gradients are those of
    # a run that computes them again, bit for bit.
    torch.manual_seed(4)
    m = mha.nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(N, 70, E)
    limit = mha.score_memory_limit()
    assert limit > 0
    grads = []
    try:
        for bytes_ in (0, limit):
            mha.set_score_memory_limit(bytes_)
            assert mha.score_memory_limit() == bytes_
            m.zero_grad()
            xi = x.clone().requires_grad_()
            out, _ = m(xi, xi, xi, need_weights=False, is_causal=True)
            out.square().sum().backward()
            grads.append([xi.grad] + [p.grad.clone() for p in m.parameters()])
        with pytest.raises(ValueError):
            mha.set_score_memory_limit(-1)
    finally:
        mha.set_score_memory_limit(limit)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
