"""mha: multi-head attention computed in C++, with PyTorch's signatures.

    import mha
    out = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    layer = mha.nn.MultiheadAttention(512, 8)      # a torch.nn.Module (needs torch)
    model = mha.load("runs/copy")                  # a checkpoint of `mha train --out`
    mha.viz.heatmaps(model.attention("3 1 4")["self"])   # matplotlib (imported on use)

NumPy arrays in give NumPy arrays out; torch CPU tensors in give torch tensors
out that support autograd, their backward computed by mha's C++ backward.
Errors from C++ arrive as ValueError (bad arguments: ShapeError, DtypeError,
ArgumentError are its subclasses), RuntimeError (FormatError, ...), ArithmeticError
(NumericalError: a diverged training step) or MemoryError, with the C++ message.
"""
from . import _mha
from ._mha import __version__
from ._mha import (ArgumentError, DeviceError, DtypeError, FormatError, MemoryError, NumericalError, ShapeError,
                   StateError)
from ._mha import active_memory, memory_limit, peak_memory, reset_peak_memory, set_memory_limit
from ._mha import score_memory_limit, set_score_memory_limit
from . import functional
from ._checkpoint import Attention, TokenModel, VisionModel, load

try:
    import torch as _torch  # noqa: F401
except ImportError:  # the nn modules subclass torch.nn.Module
    nn = None
else:
    from . import nn

__all__ = ["__version__", "functional", "nn", "ShapeError", "DtypeError", "ArgumentError", "DeviceError",
           "StateError", "FormatError", "NumericalError", "MemoryError",
           "memory_limit", "set_memory_limit", "active_memory", "peak_memory",
           "score_memory_limit", "set_score_memory_limit",
           "reset_peak_memory", "load", "TokenModel", "VisionModel", "Attention", "viz"]


def __getattr__(name):
    # mha.viz imports matplotlib only when first used.
    if name == "viz":
        import importlib
        return importlib.import_module(".viz", __name__)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")
