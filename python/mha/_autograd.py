"""What mha's autograd Functions keep on their ctx beside saved tensors, dropped when autograd frees those.

Autograd frees a Function's saved tensors after its backward (unless retain_graph), not the other
attributes set on its ctx, which live as long as the graph does. A training loop's
`logits = model(ids)` holds the last step's graph until the next forward has run, so that forward's
peak held two steps of the C++ state on the ctx (every activation a layer saved: PyTorch with mha's
layers at mid, 342 against 239 MiB). A Function registers its ctx once its backward has run; every
mha Function call first drops the named attributes of the registered contexts whose saved tensors
autograd has freed: reading ctx._raw_saved_tensors (without unpacking them, so no saved-tensor hook
runs) raises then. Within one backward those are the Functions already done; the last one's go at
the next call. With retain_graph=True nothing is freed and a second backward works as in torch.
"""
import threading
import weakref

_ran = []
_lock = threading.Lock()


def ran_backward(ctx, *names):
    """Registers ctx, whose backward has run, and the attributes to drop once its graph is freed."""
    with _lock:
        _ran.append((weakref.ref(ctx), names))


def drop_freed():
    """Drops the registered attributes of every registered ctx whose saved tensors are freed."""
    with _lock:
        entries = _ran[:]
        _ran.clear()
    for ref, names in entries:
        ctx = ref()
        if ctx is None:
            continue
        try:
            ctx._raw_saved_tensors
        except RuntimeError:  # freed: no second backward can come
            for name in names:
                setattr(ctx, name, None)
        except AttributeError:  # a torch without it: the attributes live as long as the graph
            pass
