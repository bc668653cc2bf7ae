#!/usr/bin/python3
"""The table of bench/train_pair.sh's JSON lines, as docs/benchmarks.md shows it.

    bash bench/train_pair.sh 3 | tee pair.jsonl | python3 bench/train_pair_table.py
    python3 bench/train_pair_table.py pair.jsonl [more.jsonl ...]

train_pair.sh runs, for each configuration and round, mha, PyTorch and PyTorch with
mha's layers one after another (then, with TORCH_CORETYPE set, the two PyTorch runs
again on that OpenBLAS core set). Round k of a configuration is the k-th line of each
kind, and each ratio is taken within a round, between runs that ran back to back; the
ratio shown is the median of the rounds' ratios, followed by each round's. Tokens/s are
the medians each program printed. "% of peak" is each kind's median GFLOP/s (the same
FLOP count in both programs) over the median FMA peak that mha's runs measured beside
them, mha's range in brackets; "copy GB/s" is the range of the memory bandwidth mha's
runs measured; memory is the range of the peak resident memory each kind's steps added.
"""
import collections
import json
import statistics
import sys


def tokens(x):
    return f"{x / 1000:.1f}k" if x >= 10000 else f"{x:.0f}"


def span(values, digits=0):
    lo, hi = min(values), max(values)
    fmt = f"{{:.{digits}f}}"
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def tokens_of(runs):
    return ", ".join(tokens(r["tokens_per_second"]) for r in runs) or "—"


def mib_of(runs):
    return span([r["peak_extra_mib"] for r in runs]) if runs else "—"


def percents(peak, *kinds):
    """Each kind's median GFLOP/s as a percentage of peak (None: not measured), joined by " / "."""
    def one(runs):
        flops = [r["gflops"] for r in runs if "gflops" in r]
        return f"{100 * statistics.median(flops) / peak:.0f}" if flops and peak else "—"
    return " / ".join(one(runs) for runs in kinds)


def ratio(numerators, denominators):
    rounds = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(numerators, denominators)]
    if not rounds:
        return "—"
    each = ", ".join(f"{r:.2f}" for r in rounds)
    return f"{statistics.median(rounds):.2f}×" + (f" ({each})" if len(rounds) > 1 else "")


def table(lines):
    """Markdown rows from the JSON lines (configurations in order of appearance)."""
    runs = collections.defaultdict(list)  # (config, system, coretype) -> runs in order
    configs, coretypes = [], []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        core = r.get("openblas_coretype", "detected")
        runs[(r["config"], r["system"], core)].append(r)
        if r["config"] not in configs:
            configs.append(r["config"])
        if r["system"] != "mha" and core not in coretypes:
            coretypes.append(core)
    out = ["| config | PyTorch's OpenBLAS | mha tokens/s | PyTorch | mha / PyTorch | PyTorch + mha layers | "
           "ratio to PyTorch | % of peak: mha (range) / PyTorch / + mha layers | copy GB/s | memory mha / torch / torch+mha layers, MiB |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for config in configs:
        mha = runs[(config, "mha", "detected")]
        for core in coretypes:
            torch = runs[(config, "torch", core)]
            layers = runs[(config, "torch+mha-layers", core)]
            if not mha or not torch:
                continue
            copy = [r["copy_gbs"] for r in mha if "copy_gbs" in r]
            peaks = [r["peak_gflops"] for r in mha if "peak_gflops" in r]
            peak = statistics.median(peaks) if peaks else None
            measured = [r["percent_of_peak"] for r in mha if "percent_of_peak" in r]
            share = (f"{percents(peak, mha)} ({span(measured) if measured else '—'}) / "
                     f"{percents(peak, torch, layers)}%")
            out.append(f"| {config} | {core} | {tokens_of(mha)} | {tokens_of(torch)} | {ratio(mha, torch)} | {tokens_of(layers)} | "
                       f"{ratio(layers, torch)} | {share} | "
                       f"{span(copy, 1) if copy else '—'} | {mib_of(mha)} / {mib_of(torch)} / {mib_of(layers)} |")
    return out


def main(paths):
    lines = []
    if paths:
        for path in paths:
            with open(path) as f:
                lines += f.readlines()
    else:
        lines = sys.stdin.readlines()
    print("\n".join(table(lines)))


if __name__ == "__main__":
    main(sys.argv[1:])
