"""Pictures of attention with matplotlib, for notebooks and scripts.

    fig = mha.viz.heatmaps(model.attention("3 1 4 1 5")["self"])
    fig.savefig("heads.png")                 # or show it: a notebook displays a Figure

heatmaps draws a grid like `mha viz`: one row a layer, one column a head, each
panel the (queries x keys) weights, rows the queries. It returns a
matplotlib.figure.Figure made without pyplot (no global state, no display
needed).
"""
import numpy as np


def heatmaps(attention, queries=None, keys=None, layers=None, heads=None, title=None, titles=None, cmap="viridis",
             panel_inches=1.8, annotate=False):
    """A Figure of every layer's and head's weights.

    attention: an mha Attention (from mha.load(...).attention), or an array
      (layers, heads, queries, keys), (heads, queries, keys) or (queries, keys).
    queries, keys: tick labels (default: the Attention's, else none).
    layers, heads: which to draw (lists of indices; default all).
    titles: one title a panel, row by row (default "layer L head H").
    annotate: write each weight in its cell (for short sequences).
    """
    from matplotlib.figure import Figure

    name = None
    if hasattr(attention, "weights"):
        name = attention.name
        queries = attention.queries if queries is None else queries
        keys = attention.keys if keys is None else keys
        attention = attention.weights
    w = np.asarray(attention, dtype=np.float64)
    if w.ndim < 2 or w.ndim > 4:
        raise ValueError(f"[mha.viz.heatmaps] attention: expected (layers, heads, queries, keys), (heads, queries, "
                         f"keys) or (queries, keys); got shape {w.shape}")
    w = w.reshape((1,) * (4 - w.ndim) + w.shape)
    layers = list(range(w.shape[0])) if layers is None else list(layers)
    heads = list(range(w.shape[1])) if heads is None else list(heads)
    for what, chosen, count in (("layers", layers, w.shape[0]), ("heads", heads, w.shape[1])):
        bad = [i for i in chosen if not 0 <= i < count]
        if not chosen or bad:
            raise ValueError(f"[mha.viz.heatmaps] {what}: expected indices in [0, {count}); got {chosen}")
    for what, labels, count in (("queries", queries, w.shape[2]), ("keys", keys, w.shape[3])):
        if labels is not None and len(labels) != count:
            raise ValueError(f"[mha.viz.heatmaps] {what}: expected {count} labels; got {len(labels)}")

    rows, cols = len(layers), len(heads)
    if titles is not None and len(titles) != rows * cols:
        raise ValueError(f"[mha.viz.heatmaps] titles: expected {rows * cols} (one a panel); got {len(titles)}")
    fig = Figure(figsize=(panel_inches * cols + 1.0, panel_inches * rows + (0.6 if title or name else 0.2)),
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r][c]
            panel = w[layer, head]
            image = ax.imshow(panel, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"layer {layer} head {head}" if titles is None else titles[r * cols + c], fontsize=8)
            for axis, labels in ((ax.set_yticks, queries), (ax.set_xticks, keys)):
                if labels is None:
                    axis([])
                else:
                    axis(range(len(labels)), labels, fontsize=6)
            if annotate:
                for i in range(panel.shape[0]):
                    for j in range(panel.shape[1]):
                        ax.text(j, i, f"{panel[i, j]:.2f}", ha="center", va="center", fontsize=5,
                                color="white" if panel[i, j] < 0.5 else "black")
    fig.colorbar(image, ax=axes, shrink=0.8, label="weight")
    if title or name:
        fig.suptitle(title or name)
    return fig
