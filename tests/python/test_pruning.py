"""mha.nn.MultiheadAttention.prune_heads, in the manner of Hugging Face's.

A module with heads pruned computes what the unpruned module computes when those heads'
value rows are zero (their outputs are 0 before out_proj): the same output and the same
gradients of what remains, against torch.nn.MultiheadAttention itself; heads keep the
indices they were built with; the backward passes gradcheck in float64.
"""
import pytest
import torch

import mha


def modules(seed=0, **kwargs):
    torch.manual_seed(seed)
    ours = mha.nn.MultiheadAttention(12, 4, **kwargs)
    theirs = torch.nn.MultiheadAttention(12, 4, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def silence(theirs, heads, hd=3):
    """Zero the value rows (weights, bias, bias_v) of `heads` in torch's module: their outputs become 0."""
    with torch.no_grad():
        for h in heads:
            rows = slice(2 * 12 + h * hd, 2 * 12 + (h + 1) * hd)
            theirs.in_proj_weight[rows] = 0
            if theirs.in_proj_bias is not None:
                theirs.in_proj_bias[rows] = 0
            if theirs.bias_v is not None:  # the extra key's value too
                theirs.bias_v[..., h * hd:(h + 1) * hd] = 0


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"batch_first": True}, {"add_bias_kv": True}])
def test_pruned_equals_torch_with_those_heads_silenced(kwargs):
    ours, theirs = modules(**kwargs)
    silence(theirs, [1, 3])
    ours.prune_heads([3, 1])
    assert ours.num_heads == 2 and ours.head_dim == 3 and ours.pruned_heads == {1, 3}
    assert ours.in_proj_weight.shape == (18, 12) and ours.out_proj.weight.shape == (12, 6)
    x = torch.randn(5, 2, 12, requires_grad=True)
    y, w = ours(x, x, x, average_attn_weights=False)
    want, want_w = theirs(x, x, x, average_attn_weights=False)
    assert torch.allclose(y, want, atol=1e-6)
    assert torch.allclose(w, want_w[:, [0, 2]], atol=1e-6)  # the heads that remain
    g = torch.randn_like(y)
    dx, = torch.autograd.grad(y, x, g, retain_graph=True)
    dx_want, = torch.autograd.grad(want, x, g, retain_graph=True)
    assert torch.allclose(dx, dx_want, atol=1e-5)
    (y * g).sum().backward()
    (want * g).sum().backward()
    keep = torch.tensor([0, 1, 2, 6, 7, 8])  # heads 0 and 2
    rows = torch.cat([keep + b * 12 for b in range(3)])
    assert torch.allclose(ours.in_proj_weight.grad, theirs.in_proj_weight.grad[rows], atol=1e-5)
    assert torch.allclose(ours.out_proj.weight.grad, theirs.out_proj.weight.grad[:, keep], atol=1e-5)


def test_ids_stay_and_every_head_can_go():
    ours, theirs = modules(seed=1)
    ours.prune_heads([2])
    ours.prune_heads([2, 0])  # 2 is gone already: only 0 more
    assert ours.pruned_heads == {0, 2} and ours.num_heads == 2
    silence(theirs, [0, 2])
    x = torch.randn(4, 3, 12)
    assert torch.allclose(ours(x, x, x)[0], theirs(x, x, x)[0], atol=1e-6)
    ours.prune_heads(range(4))
    assert ours.num_heads == 0 and ours.in_proj_weight.shape == (0, 12)
    y, w = ours(x, x, x)
    assert torch.allclose(y, ours.out_proj.bias.expand_as(y))  # no heads: out_proj's bias
    assert w.shape == (3, 4, 4) and not w.any()
    with pytest.raises(ValueError, match=r"prune_heads\] heads: expected indices in \[0, 4\).*got 4"):
        ours.prune_heads([4])


def test_pruned_backward_passes_gradcheck():
    torch.manual_seed(2)
    m = mha.nn.MultiheadAttention(8, 4, kdim=5, vdim=6, dtype=torch.float64)
    m.prune_heads([0, 3])
    q = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: m(q, k, v)[0], (q, k, v))
    assert m.k_proj_weight.shape == (4, 5) and m.v_proj_weight.shape == (4, 6)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layers_with_pruned_heads(kind):
    """A layer whose attention lost heads equals torch's layer with those heads silenced."""
    torch.manual_seed(3)
    if kind == "encoder":
        ours = mha.nn.TransformerEncoderLayer(12, 4, dim_feedforward=16, dropout=0.0)
        theirs = torch.nn.TransformerEncoderLayer(12, 4, dim_feedforward=16, dropout=0.0)
    else:
        ours = mha.nn.TransformerDecoderLayer(12, 4, dim_feedforward=16, dropout=0.0)
        theirs = torch.nn.TransformerDecoderLayer(12, 4, dim_feedforward=16, dropout=0.0)
    theirs.load_state_dict(ours.state_dict())
    ours.self_attn.prune_heads([0])
    silence(theirs.self_attn, [0])
    if kind == "decoder":
        ours.multihead_attn.prune_heads([1, 2, 3])
        silence(theirs.multihead_attn, [1, 2, 3])
    x, memory = torch.randn(5, 2, 12, requires_grad=True), torch.randn(4, 2, 12)
    y = ours(x) if kind == "encoder" else ours(x, memory)
    want = theirs(x) if kind == "encoder" else theirs(x, memory)
    assert torch.allclose(y, want, atol=1e-5)
    g = torch.randn_like(y)
    assert torch.allclose(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(want, x, g)[0], atol=1e-5)
