#!/usr/bin/env python3
"""The cost model of docs/distributed.md: data-parallel and context-parallel
step time and efficiency projected to P ranks at a network bandwidth, from
figures measured on this machine by build/bench/bench_distributed (JSON lines,
one file per run, given on the command line).

  python3 bench/distributed_model.py runs/dist/*.jsonl

Data parallel (weak scaling: every rank keeps the wide model's batch of 8 x 509
tokens): compute T_c = the step's FLOPs per rank / F (F: one rank's measured
rate); the ring all-reduce of S gradient bytes takes
    T_ar = 2 (P - 1) alpha + 2 (P - 1) / P * S / B;
buckets start as backward finishes their layers, so the all-reduce overlaps
backward (2/3 of the step's FLOPs) except for the last bucket, which starts
when backward ends:
    exposed = max(T_ar - 2/3 T_c (1 - b / S), T_ar(b)),  efficiency = T_c / (T_c + exposed).

Context parallel (one sequence of L tokens over C ranks, n = L / C each, zigzag
causal ring): per layer and ring step a rank computes two (n/2 x n/2) blocks,
2 n^2 d FLOPs forward and 2.5x that backward, while K and V (2 n d floats)
travel forward and K, V, dK, dV (4 n d) backward. The ring is hidden while
compute >= communication: forward n >= s F / B for zigzag causal (s = 4 bytes
a float; s F / (2 B) for a full, non-causal block).
"""
import json
import sys

ALPHA_NETWORK = 5e-6           # seconds a message step across machines (assumed: MPI over a 25-400 Gb/s fabric)
BANDWIDTHS_GBIT = [25, 100, 400]
RANKS = [8, 64, 512]
BUCKET = 25 * 2**20            # bytes
SEQUENCE = 32768               # context parallel: tokens of one sequence


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    return rows


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def data_parallel(rows):
    wide = [r for r in rows if r["bench"] == "train" and r["config"] == "wide" and r["ranks"] == 1]
    if not wide:
        return None
    F = median([r["gflops_per_rank"] for r in wide]) * 1e9
    S = wide[0]["gradient_bytes"]
    T_c = median([r["compute_seconds_max"] for r in wide])
    out = {"F_gflops": F / 1e9, "gradient_mib": S / 2**20, "compute_seconds": T_c, "rows": []}
    for gbit in BANDWIDTHS_GBIT:
        B = gbit * 1e9 / 8
        for P in RANKS:
            ring = lambda size: 2 * (P - 1) * ALPHA_NETWORK + 2 * (P - 1) / P * size / B
            T_ar = ring(S)
            exposed = max(T_ar - 2 / 3 * T_c * (1 - BUCKET / S), ring(min(BUCKET, S)))
            # The same network with ranks 10x faster (compute T_c / 10): what a faster machine would see.
            fast = T_c / 10
            exposed_fast = max(T_ar - 2 / 3 * fast * (1 - BUCKET / S), ring(min(BUCKET, S)))
            out["rows"].append({"gbit": gbit, "ranks": P, "allreduce_ms": 1e3 * T_ar, "exposed_ms": 1e3 * exposed,
                                "efficiency": T_c / (T_c + exposed), "no_overlap": T_c / (T_c + T_ar),
                                "efficiency_10x": fast / (fast + exposed_fast)})
    return out


def context_parallel(rows, d=512, layers=6):
    one = [r for r in rows if r["bench"] == "ring" and r["ranks"] == 1 and r["layout"] == "zigzag"]
    if not one:
        return None
    L = one[0]["length"]
    # forward + backward of causal attention over L (B 1, 4 heads, E 64): 3.5 x 4 E H L (L+1)/2 FLOPs
    F = 3.5 * 4 * 64 * 4 * L * (L + 1) / 2 / median([r["seconds_max"] for r in one])
    out = {"F_gflops": F / 1e9, "rows": []}
    for gbit in BANDWIDTHS_GBIT:
        B = gbit * 1e9 / 8
        for C in RANKS:
            n = SEQUENCE / C
            compute = 3.5 * 2 * n * n * d / F               # one ring step, forward + backward, one layer
            comm = 2 * ALPHA_NETWORK + (2 + 4) * n * d * 4 / B  # K, V forward; K, V, dK, dV backward
            steps = C
            first = 3.5 * 4 * d * n * (n + 1) / 2 / F        # step 0: the rank's own causal blocks (no wait)
            attention = layers * (first + (steps - 1) * max(compute, comm))
            ideal = layers * (first + (steps - 1) * compute)
            out["rows"].append({"gbit": gbit, "ranks": C, "tokens_per_rank": n, "hidden_from": 4 * F / B,
                                "attention_seconds": attention, "efficiency": ideal / attention})
    return out


def table(columns, cells):
    """A markdown table: column titles, then one list of cell strings a row."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in cells:
        print("| " + " | ".join(row) + " |")


def main():
    rows = load(sys.argv[1:])
    dp, cp = data_parallel(rows), context_parallel(rows)
    pct = lambda x: f"{100 * x:.1f}%"
    if dp:
        print(f"Data parallel, wide model: F = {dp['F_gflops']:.0f} GFLOP/s a rank, S = {dp['gradient_mib']:.1f} MiB "
              f"of gradients, T_c = {dp['compute_seconds']:.2f} s a step, alpha = {ALPHA_NETWORK * 1e6:.0f} us\n")
        table(["network", "ranks", "all-reduce ms", "exposed ms", "efficiency", "without overlap", "ranks 10x faster"],
              [[f"{r['gbit']} Gb/s", str(r["ranks"]), f"{r['allreduce_ms']:.1f}", f"{r['exposed_ms']:.1f}",
                pct(r["efficiency"]), pct(r["no_overlap"]), pct(r["efficiency_10x"])] for r in dp["rows"]])
    if cp:
        print(f"\nContext parallel, {SEQUENCE} tokens, d 512, 6 layers: attention at F = {cp['F_gflops']:.0f} GFLOP/s "
              f"a rank\n")
        table(["network", "ranks", "tokens a rank", "hidden from (tokens a rank)", "attention s a step", "efficiency"],
              [[f"{r['gbit']} Gb/s", str(r["ranks"]), f"{r['tokens_per_rank']:.0f}", f"{r['hidden_from']:.0f}",
                f"{r['attention_seconds']:.3f}", pct(r["efficiency"])] for r in cp["rows"]])


if __name__ == "__main__":
    main()
