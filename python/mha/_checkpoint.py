"""Trained checkpoints from Python: mha.load(path).

    model = mha.load("runs/copy")          # a folder written by `mha train --out`
    model.generate("3 1 4 1 5")            # '3 1 4 1 5'
    maps = model.attention("3 1 4 1 5")    # {'self': Attention}, weights (layers, heads, queries, keys)
    mha.viz.heatmaps(maps["self"])         # a matplotlib Figure, one panel a layer and head

The C++ loader reads and verifies the folder (every tensor's checksum, the
config against the weights, an interrupted save) and raises FormatError for
anything that is not whole.
"""
import json
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from . import _mha


@dataclass
class Attention:
    """One kind of attention of one input, every layer and head.

    weights: (layers, nhead, queries, keys), each row summing to 1; a pruned head's plane is NaN.
    queries, keys: the label of each row and column (tokens, or patches).
    """
    name: str
    weights: np.ndarray
    queries: List[str]
    keys: List[str]

    def plot(self, **options):
        """mha.viz.heatmaps(self, **options)."""
        from . import viz
        return viz.heatmaps(self, **options)


def _labels(ids):
    return [_mha.format_tokens([int(t)]) for t in ids]


def _ids(tokens, name):
    """A list, 1-D or 2-D array of token ids as an int64 (B, L) array."""
    a = np.asarray(tokens)
    if a.dtype.kind not in "iu":
        raise _mha.DtypeError(f"[mha.load(...).forward] {name}: expected integer token ids; got {a.dtype}")
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise _mha.ShapeError(f"[mha.load(...).forward] {name}: expected (length,) or (batch, length); "
                              f"got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.int64)


class TokenModel:
    """A model trained on a toy sequence task: decoder, encoder-decoder or encoder."""

    def __init__(self, model, path):
        self._model = model
        self.path = path
        self.config = json.loads(model.config)
        self.architecture = self.config["model"]["architecture"]
        self.task = self.config["task"]["task"]
        self.checksummed = model.checksummed

    def __repr__(self):
        m = self.config["model"]
        return (f"mha.TokenModel({self.path!r}: {self.architecture}, task {self.task}, d_model {m['d_model']}, "
                f"{m['nhead']} heads, {m['num_layers']} layers, {m['attention']['kind']} attention, "
                f"{m['position']} positions, {self.config['steps']} steps)")

    def tokens(self, text: str) -> List[int]:
        """Token ids of a text: digits, '+', and ListOps' [MAX [MIN [MED [SM ]."""
        return _mha.parse_tokens(text)

    def text(self, tokens) -> str:
        """The text of token ids."""
        return _mha.format_tokens([int(t) for t in tokens])

    def forward(self, tokens, target=None) -> np.ndarray:
        """Logits (batch, length, vocab) of token ids (length,) or (batch, length); an
        encoder-decoder reads tokens as its source and target as its decoder's input."""
        ids = _ids(tokens, "tokens")
        tgt = None if target is None else _ids(target, "target")
        return self._model.forward(ids, tgt)

    def answer(self, input: str, max_new: int = 0) -> List[int]:
        """The model's output token ids for an input text (greedy decoding; an encoder
        fills as many slots as the task's output has)."""
        return self._model.answer(self.tokens(input), max_new)

    def generate(self, input: str, max_new: int = 0) -> str:
        """The model's output for an input text, as text (max_new 0: twice the input's length, plus 2)."""
        return self.text(self.answer(input, max_new))

    def attention(self, input: str, output: Optional[str] = None) -> Dict[str, Attention]:
        """Every attention of the model over input -> output (default: the model's own
        answer), by kind: 'self'; or 'encoder', 'decoder' and 'cross'."""
        ids = self.tokens(input)
        out = self.answer(input) if output is None else self.tokens(output)
        views = self._model.attention(ids, out)
        if not views:
            raise _mha.ArgumentError(
                "[mha.load(...).attention] model: expected one whose attention forms weights (full or window); "
                f"got {self.config['model']['attention']['kind']} attention")
        return {v["short_name"]: Attention(v["name"], np.stack(v["weights"]), _labels(v["queries"]),
                                           _labels(v["keys"])) for v in views}

    def heads(self, examples: int = 256, batch: int = 32) -> Dict[str, dict]:
        """Each head's importance (|dL/dgate| over held-out batches, normalised per layer, as
        Michel et al. 2019), entropy, confidence and favourite offset, as `mha heads` prints
        them: by attention kind ('self'; or 'encoder', 'decoder', 'cross'), a dict of
        (layers, nhead) arrays by head id: importance, entropy, confidence, offset, offset_share,
        positional (a pruned head's: NaN, 0, False), 'pattern' (what a positional head attends to, as
        `mha heads` labels it: "previous token", "offset n", "mirror: i + j = 2n + 2", ...; "" for the
        others) and 'heads': the ids each layer has."""
        return {site.pop("name"): site for site in self._model.heads(examples, batch)}

    def evaluate(self, min_length: int = 0, max_length: int = 0) -> dict:
        """Held-out exact match and token accuracy (as `mha eval`), at other input lengths when given."""
        return self._model.evaluate(min_length, max_length)


class VisionModel:
    """A Vision Transformer trained on the 8x8 digits (`mha train --task digits --out`)."""

    def __init__(self, model, path):
        self._model = model
        self.path = path
        self.config = json.loads(model.config)
        self.architecture = "vision"
        self.checksummed = model.checksummed
        m = self.config["model"]
        self.side, self.patch = m["image_side"], m["patch"]

    def __repr__(self):
        m = self.config["model"]
        return (f"mha.VisionModel({self.path!r}: {m['image_side']}x{m['image_side']} images, patch {m['patch']}, "
                f"d_model {m['d_model']}, {m['nhead']} heads, {m['num_layers']} layers, "
                f"{m['attention']['kind']} attention, held-out accuracy {self.config['heldout_accuracy']:.3f})")

    def _images(self, images):
        a = np.asarray(images, dtype=np.float32)
        n = self.side * self.side
        if a.shape in ((self.side, self.side), (n,)):
            a = a.reshape(1, n)
        elif a.ndim == 3 and a.shape[1:] == (self.side, self.side):
            a = a.reshape(a.shape[0], n)
        if a.ndim != 2 or a.shape[1] != n:
            raise _mha.ShapeError(f"[mha.load(...).forward] images: expected (batch, {self.side}, {self.side}) or "
                                  f"(batch, {n}); got shape {a.shape}")
        return np.ascontiguousarray(a)

    def forward(self, images) -> np.ndarray:
        """Logits (batch, classes) of images (batch, side, side), (batch, side*side) or one image,
        pixels in [0, 1] as in training (the 8x8 digits' values / 16)."""
        return self._model.forward(self._images(images))

    def predict(self, images) -> np.ndarray:
        """The class of each image."""
        return self.forward(images).argmax(axis=1)

    def attention(self, image) -> Dict[str, Attention]:
        """Every layer's and head's attention over one image's tokens: the class token
        (unless the model pools) and the patches by (row, column)."""
        images = self._images(image)
        if images.shape[0] != 1:
            raise _mha.ShapeError(f"[mha.load(...).attention] image: expected one image; got {images.shape[0]}")
        weights = np.stack([w[0] for w in self._model.attention(images)])
        grid = self.side // self.patch
        labels = [f"{r},{c}" for r in range(grid) for c in range(grid)]
        if weights.shape[-1] == len(labels) + 1:
            labels = ["cls"] + labels
        return {"self": Attention("self-attention", weights, labels, labels)}


def load(path: str, allow_non_finite: bool = False):
    """Opens the mha checkpoint in folder `path`: a TokenModel (decoder, encoder-decoder or
    encoder on a toy task) or a VisionModel. allow_non_finite loads NaN or infinite weights
    (to inspect a diverged run) instead of refusing them."""
    path = str(path)
    if _mha.checkpoint_architecture(path) == "vision":
        return VisionModel(_mha.load_vision_model(path, allow_non_finite), path)
    return TokenModel(_mha.load_token_model(path, allow_non_finite), path)
