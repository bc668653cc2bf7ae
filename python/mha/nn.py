"""torch.nn modules whose forward and backward run in mha's C++ library.

MultiheadAttention, TransformerEncoderLayer and TransformerDecoderLayer take
PyTorch's constructor arguments, hold parameters of the same names and shapes
(so state_dicts load both ways), are initialised exactly as PyTorch
initialises them (the same torch.manual_seed gives the same weights), and
have PyTorch's forward signatures and return values.

Differences, also in docs/design.md: a query whose keys are all masked gets 0
from attention (PyTorch: NaN); is_causal adds the causal mask itself (PyTorch
2.x also wants attn_mask as a hint); gradients flow to the inputs and the
parameters, not to the masks or through the returned weights; dropout draws
its own pattern (seeded from torch's generator), so it matches PyTorch in
distribution, not element by element.
"""
import math

import torch
import torch.nn.functional as F
from torch.nn import Dropout, LayerNorm, Linear, Parameter
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from . import _mha
from ._autograd import drop_freed, ran_backward
from ._convert import draw_seed, mask_to_numpy, to_numpy, to_torch

__all__ = ["MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer"]

_prototypes = {}


def _prototype(cls, *args):
    """The C++ layer for a configuration (kept, since it only holds the configuration)."""
    key = (cls,) + args
    if key not in _prototypes:
        _prototypes[key] = cls(*[dict(a) if isinstance(a, _AttentionKey) else a for a in args])
    return _prototypes[key]


def _attention_key(spec):
    """The attention argument as a hashable key for _prototype (dicts become sorted tuples)."""
    if isinstance(spec, dict):
        return _AttentionKey(sorted(spec.items()))
    return spec


class _AttentionKey(tuple):
    """A dict's items, hashable; passed to C++ as the dict again."""


def _is_float64(module):
    return next(module.parameters()).dtype == torch.float64


def _check_mask(mask, fn, name):
    if mask is not None and mask.requires_grad:
        raise ValueError(f"[{fn}] {name}: expected a mask that does not require grad (mha does not "
                         f"differentiate masks in the nn layers); got requires_grad=True")


class _Layer(torch.autograd.Function):
    """Runs a C++ layer: run(inputs, params) -> (outputs, state); state.backward(dy) -> grads."""

    @staticmethod
    def forward(ctx, run, n_inputs, *tensors):
        drop_freed()
        fn = "mha.nn"
        inputs = [to_numpy(t, fn, "input")[0] for t in tensors[:n_inputs]]
        params = [to_numpy(p, fn, "parameter")[0] for p in tensors[n_inputs:]]
        outputs, state = run(inputs, params)
        ctx.state, ctx.n_inputs = state, n_inputs
        ctx.save_for_backward(*tensors[n_inputs:])  # lets autograd catch in-place changes to parameters
        ctx.set_materialize_grads(False)
        outs = tuple(to_torch(o) for o in outputs)
        ctx.output = outs[0].detach()  # a zero gradient for it when only the weights are used
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, dy, *dextra):
        # dextra: MultiheadAttention's attn_output_weights, whose gradient joins the output's.
        drop_freed()
        params = ctx.saved_tensors
        dweights = dextra[0] if dextra else None
        if dy is None and dweights is None:
            return (None, None) + (None,) * (ctx.n_inputs + len(params))
        if dy is None:
            dy = torch.zeros_like(ctx.output)
        extra = {} if dweights is None else {"grad_weights": to_numpy(dweights.contiguous(), "mha.nn", "grad")[0]}
        *input_grads, param_grads = ctx.state.backward(to_numpy(dy.contiguous(), "mha.nn", "grad")[0], **extra)
        grads = [to_torch(g) for g in input_grads] + [to_torch(g) for g in param_grads]
        ran_backward(ctx, "state", "output")  # the saved activations, once autograd frees the graph
        return (None, None) + tuple(grads)


def _apply(module, proto, inputs, forward):
    """Runs proto.forward on `inputs` with the module's parameters, differentiably."""
    named = dict(module.named_parameters())
    params = [named[n] for n in proto.parameter_names()]
    training = module.training
    seed = draw_seed(True) if training and _has_dropout(module) else 0

    def run(xs, ps):
        *outs, state = forward(ps, xs, training, seed)
        return outs, state

    return _Layer.apply(run, len(inputs), *inputs, *params)


def _has_dropout(module):
    return any(getattr(m, "p", 0) > 0 for m in module.modules() if isinstance(m, Dropout)) or \
        any(getattr(m, "dropout", 0) > 0 for m in module.modules() if isinstance(m, MultiheadAttention))


class MultiheadAttention(torch.nn.Module):
    """torch.nn.MultiheadAttention, computed by mha."""

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, attention=None):
        """PyTorch's arguments, and `attention`: which attention each head computes.

        None or "full" (exact softmax attention), a kind's name ("window", "strided", "bigbird", "linear",
        "performer", "linformer", "lsh", "axial"), or a dict {"kind": name, option: value, ...} with the
        options of mha::nn::AttentionVariant (window, block, local_blocks, stride_blocks, global_blocks,
        window_blocks, random_blocks, features, redraw_every, projected, max_length, buckets, hashes, chunk,
        axial_width, seed); `self.attention` holds them all. Variants other than full and window compute no
        weight matrix (forward returns None for the weights) and take no masks, no attention dropout.
        Linformer's projections are parameters (linformer.key_projection, linformer.value_projection);
        Performer redraws its features every redraw_every training forwards, from a seed drawn from
        torch's generator here.
        """
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self._attention_spec = attention
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"[mha.nn.MultiheadAttention] embed_dim and num_heads: expected > 0; got "
                             f"{embed_dim} and {num_heads}")
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError(f"[mha.nn.MultiheadAttention] embed_dim: expected a multiple of num_heads = "
                             f"{num_heads}; got {embed_dim}")
        # Created and initialised in PyTorch's order, so that one seed gives the same weights.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.pruned_heads = set()
        self.attention = self._proto_for(dtype or torch.get_default_dtype()).attention()
        kind = self.attention["kind"]
        if kind == "linformer":
            self.linformer = torch.nn.Module()
            shape = (self.attention["projected"], self.attention["max_length"])
            self.linformer.key_projection = Parameter(torch.empty(shape, **factory))
            self.linformer.value_projection = Parameter(torch.empty(shape, **factory))
        self._feature_seed = int(torch.randint(0, 2**62, (1,)).item()) if kind == "performer" else 0
        self._feature_step = 0
        self._reset_parameters()

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            torch.nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            torch.nn.init.xavier_uniform_(self.q_proj_weight)
            torch.nn.init.xavier_uniform_(self.k_proj_weight)
            torch.nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            torch.nn.init.constant_(self.in_proj_bias, 0.0)
            torch.nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            torch.nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            torch.nn.init.xavier_normal_(self.bias_v)
        if self.attention["kind"] == "linformer":  # Linformer's N(0, 1/k) projections, seeded from torch
            k, n = self.linformer.key_projection.shape
            for p in (self.linformer.key_projection, self.linformer.value_projection):
                seed = int(torch.randint(0, 2**62, (1,)).item())
                with torch.no_grad():
                    p.copy_(torch.from_numpy(_mha.linformer_projection(k, n, seed=seed, dtype="float64")))

    def _proto(self):
        return self._proto_for(next(self.parameters()).dtype)

    def _proto_for(self, dtype):
        return _prototype(_mha.MultiheadAttention, self.embed_dim, self.num_heads, float(self.dropout),
                          self.in_proj_bias is not None, self.bias_k is not None, self.add_zero_attn,
                          self.kdim, self.vdim, self.batch_first, dtype == torch.float64,
                          _attention_key(self._attention_spec), self.head_dim)

    def prune_heads(self, heads):
        """Removes heads, as Hugging Face's prune_heads does: `heads` are head indices of the module as built
        (0 … num_heads − 1 before any pruning); those pruned already are skipped, and `pruned_heads` keeps
        them all. Their rows of the q, k and v projections (and biases, bias_k, bias_v) and their columns of
        out_proj.weight go; num_heads shrinks, head_dim stays, and the module computes what it computed with
        those heads' outputs multiplied by 0. The parameters are new tensors: make the optimizer afterwards.
        """
        fn = "mha.nn.MultiheadAttention.prune_heads"
        original = self.num_heads + len(self.pruned_heads)
        heads = set(int(h) for h in heads)
        bad = sorted(h for h in heads if not 0 <= h < original)
        if bad:
            raise ValueError(f"[{fn}] heads: expected indices in [0, {original}) (the heads as built); got {bad[0]}")
        heads -= self.pruned_heads
        if not heads:
            return
        kept = [h for h in range(original) if h not in self.pruned_heads]  # ids of today's heads, in order
        keep = [i for i, h in enumerate(kept) if h not in heads]
        hd, H = self.head_dim, self.num_heads
        device = next(self.parameters()).device

        def index(blocks):  # the kept heads' rows in each of `blocks` blocks of H·hd
            rows = [b * H * hd + i * hd + d for b in range(blocks) for i in keep for d in range(hd)]
            return torch.tensor(rows, dtype=torch.long, device=device)

        def cut(p, dim, blocks):
            return None if p is None else Parameter(p.detach().index_select(dim, index(blocks)).clone(),
                                                    requires_grad=p.requires_grad)

        with torch.no_grad():
            if self._qkv_same_embed_dim:
                self.in_proj_weight = cut(self.in_proj_weight, 0, 3)
            else:
                for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                    setattr(self, name, cut(getattr(self, name), 0, 1))
            if self.in_proj_bias is not None:
                self.in_proj_bias = cut(self.in_proj_bias, 0, 3)
            if self.bias_k is not None:
                self.bias_k, self.bias_v = cut(self.bias_k, 2, 1), cut(self.bias_v, 2, 1)
            self.out_proj.weight = cut(self.out_proj.weight, 1, 1)
            self.out_proj.in_features = len(keep) * hd
        self.num_heads = len(keep)
        self.pruned_heads |= heads

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        fn = "mha.nn.MultiheadAttention.forward"
        _check_mask(attn_mask, fn, "attn_mask")
        _check_mask(key_padding_mask, fn, "key_padding_mask")
        kpm = mask_to_numpy(key_padding_mask, fn, "key_padding_mask")
        am = mask_to_numpy(attn_mask, fn, "attn_mask")
        proto = self._proto()

        weights_wanted = need_weights and self.attention["kind"] in ("full", "window")
        step = self._feature_step

        # One tensor as query, key and value (self-attention): passed once, so that the
        # C++ module projects it in one product and returns its one gradient.
        inputs = [query] if key is query and value is query else [query, key, value]

        def forward(ps, xs, training, seed):
            out, weights, state = proto.forward(ps, *xs, key_padding_mask=kpm, need_weights=weights_wanted,
                                                attn_mask=am, average_attn_weights=average_attn_weights,
                                                is_causal=is_causal, training=training, seed=seed,
                                                feature_seed=self._feature_seed, feature_step=step)
            return (out, weights, state) if weights_wanted else (out, state)

        result = _apply(self, proto, inputs, forward)
        if self.training:
            self._feature_step += 1
        return result if weights_wanted else (result, None)


def _activation_name(activation, fn):
    if isinstance(activation, str) and activation in ("relu", "gelu"):
        return activation
    if activation is F.relu or isinstance(activation, torch.nn.ReLU):
        return "relu"
    if activation is F.gelu or (isinstance(activation, torch.nn.GELU) and activation.approximate == "none"):
        return "gelu"
    raise ValueError(f"[{fn}] activation: expected 'relu', 'gelu', F.relu or F.gelu; got {activation!r}")


class _TransformerLayer(torch.nn.Module):
    def _init_feedforward_and_norms(self, blocks, d_model, dim_feedforward, dropout, eps, norm_first, factory):
        """linear1, dropout, linear2, norm1..N, dropout1..N: PyTorch's names and creation order."""
        self.linear1 = Linear(d_model, dim_feedforward, **factory)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, **factory)
        self.norm_first = norm_first
        for i in range(1, blocks + 1):
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=eps, **factory))
        for i in range(1, blocks + 1):
            setattr(self, f"dropout{i}", Dropout(dropout))

    def _proto(self, cls):
        # nhead as built (the head dim); the counts left where heads were pruned (-1: all of them).
        attn = self.self_attn
        cross = getattr(self, "multihead_attn", None)
        left = lambda m: m.num_heads if m is not None and m.pruned_heads else -1
        return _prototype(cls, self.linear1.in_features, attn.num_heads + len(attn.pruned_heads),
                          self.linear1.out_features, float(self.dropout.p), self._activation, float(self.norm1.eps),
                          attn.batch_first, self.norm_first, _is_float64(self), left(attn), left(cross))


class TransformerEncoderLayer(_TransformerLayer):
    """torch.nn.TransformerEncoderLayer, computed by mha."""

    __constants__ = ["norm_first"]

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", layer_norm_eps=1e-5,
                 batch_first=False, norm_first=False, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self._activation = _activation_name(activation, "mha.nn.TransformerEncoderLayer")
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first, **factory)
        self._init_feedforward_and_norms(2, d_model, dim_feedforward, dropout, layer_norm_eps, norm_first, factory)
        self.activation_relu_or_gelu = 1 if self._activation == "relu" else 2
        self.activation = F.relu if self._activation == "relu" else F.gelu

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        fn = "mha.nn.TransformerEncoderLayer.forward"
        _check_mask(src_mask, fn, "src_mask")
        _check_mask(src_key_padding_mask, fn, "src_key_padding_mask")
        sm = mask_to_numpy(src_mask, fn, "src_mask")
        kpm = mask_to_numpy(src_key_padding_mask, fn, "src_key_padding_mask")
        proto = self._proto(_mha.TransformerEncoderLayer)

        def forward(ps, xs, training, seed):
            return proto.forward(ps, xs[0], src_mask=sm, src_key_padding_mask=kpm, is_causal=is_causal,
                                 training=training, seed=seed)

        return _apply(self, proto, [src], forward)


class TransformerDecoderLayer(_TransformerLayer):
    """torch.nn.TransformerDecoderLayer, computed by mha."""

    __constants__ = ["norm_first"]

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", layer_norm_eps=1e-5,
                 batch_first=False, norm_first=False, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self._activation = _activation_name(activation, "mha.nn.TransformerDecoderLayer")
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first, **factory)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=batch_first,
                                                 **factory)
        self._init_feedforward_and_norms(3, d_model, dim_feedforward, dropout, layer_norm_eps, norm_first, factory)
        self.activation = F.relu if self._activation == "relu" else F.gelu

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        fn = "mha.nn.TransformerDecoderLayer.forward"
        masks = {}
        for name, m in (("tgt_mask", tgt_mask), ("memory_mask", memory_mask),
                        ("tgt_key_padding_mask", tgt_key_padding_mask),
                        ("memory_key_padding_mask", memory_key_padding_mask)):
            _check_mask(m, fn, name)
            masks[name] = mask_to_numpy(m, fn, name)
        proto = self._proto(_mha.TransformerDecoderLayer)

        def forward(ps, xs, training, seed):
            return proto.forward(ps, xs[0], xs[1], tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal,
                                 training=training, seed=seed, **masks)

        return _apply(self, proto, [tgt, memory], forward)
