#!/usr/bin/python3
"""Log–log plot of the variants' scaling from the tables bench_variants printed.

Reads the markdown tables under "## Efficient attention variants" in
docs/benchmarks.md (forward+backward process CPU ms, and peak extra memory) and
draws time and memory against L, with the fitted slope of each line (L >= 8k) in
the legend:

    python3 bench/plot_variants.py [docs/benchmarks.md] [docs/variants_scaling.png]
"""
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def tables(path):
    """{caption line: [(variant, [values])]} for the tables after the variants heading."""
    lines = open(path, encoding="utf-8").read().split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("## Efficient attention variants"))
    out, caption, rows, prev_blank = {}, None, None, True
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if rows is None:
                rows = []
                out[caption] = rows
            elif not set(cells[0]) <= set("-: "):
                values = [float(c) for c in cells if _is_number(c)]
                rows.append((cells[0], values))
        else:  # a caption may span lines; a blank line or a table ends it
            if line.strip():
                caption = (caption + " " if rows is None and caption and not prev_blank else "") + line.strip()
            prev_blank = not line.strip()
            rows = None
    return out


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def slope(xs, ys):
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x >= 8192]
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks.md"
    dst = sys.argv[2] if len(sys.argv) > 2 else "docs/variants_scaling.png"
    found = tables(src)
    time = next(v for k, v in found.items() if k and "CPU ms" in k)
    memory = next(v for k, v in found.items() if k and k.startswith("Peak extra resident memory"))
    lengths = [1024 * 2**i for i in range(7)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, rows, label in ((axes[0], time, "forward+backward, CPU ms"), (axes[1], memory, "peak extra memory, MiB")):
        for name, values in rows:
            values = values[:len(lengths)]
            style = {"linewidth": 2.5, "color": "black"} if name == "exact" else {}
            ax.loglog(lengths[:len(values)], values, marker="o", markersize=3,
                      label=f"{name} (slope {slope(lengths, values):.2f})", **style)
        ax.set_xlabel("sequence length L (E = 64, one head)")
        ax.set_ylabel(label)
        ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5)
    axes[0].set_title("time: exact attention grows as L², the variants about as L")
    axes[1].set_title("memory: every path is O(L) here (fused exact included)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
