"""Moving arrays between NumPy / PyTorch and the _mha extension without copies.

torch tensors become NumPy views of the same memory (tensor.numpy()); bfloat16,
which NumPy lacks, travels as its int16 bit pattern. Results come back as
NumPy arrays whose memory the C++ tensor owns; torch.from_numpy wraps them.
"""
import numpy as np

try:
    import torch
except ImportError:
    torch = None


def is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x, fn, name):
    """(array, is_bfloat16) viewing x, or (None, False) for None."""
    if x is None:
        return None, False
    if is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(f"[{fn}] {name}: expected a cpu tensor; got {x.device}")
        x = x.detach().resolve_conj().resolve_neg()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy(), True
        if x.dtype == torch.uint8:  # torch's old byte masks
            return x.numpy().astype(bool), False
        return x.numpy(), False
    a = np.asarray(x)
    if a.dtype == np.uint8:
        a = a.astype(bool)
    if any(s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    return a, False


def to_torch(a, bf16=False):
    """A torch tensor sharing a's memory (None for None)."""
    if a is None:
        return None
    if bf16 and a.dtype in (np.uint16, np.int16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def mask_to_numpy(mask, fn, name):
    """A mask as bool or float array (a bfloat16 mask is widened to float32)."""
    if is_torch(mask) and mask.dtype == torch.bfloat16:
        mask = mask.float()
    return to_numpy(mask, fn, name)[0]


def draw_seed(use_torch):
    """A dropout seed from torch's or NumPy's global generator (so manual_seed/seed reproduce)."""
    if use_torch:
        return int(torch.randint(0, 2**62, (1,)).item())
    return int(np.random.randint(0, 2**62, dtype=np.int64))
