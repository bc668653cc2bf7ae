#!/usr/bin/python3
"""mha's Python modules next to PyTorch's, in one process, alternating, on one machine.

Cases (float32, training mode with dropout 0, gradients of inputs and parameters):
  * nn.MultiheadAttention self-attention, forward and forward+backward, at
    (B=8, L=512, E=512, 8 heads) and (B=1, L=4096, E=512, 8 heads): torch.nn vs mha.nn;
  * the functional call at (B=1, H=8, L=4096, E=64): PyTorch 1.13's unfused formula
    softmax(Q Kᵀ/√E) V (it has no public scaled_dot_product_attention; the installed
    PyTorch's own function is timed too where it exists) vs
    mha.functional.scaled_dot_product_attention.
Each timing is the median of --reps runs after a warm-up; the two sides alternate
so that both see the same machine load.

    PYTHONPATH=build/python bench/torch_mha.py [--threads 2] [--reps 7]
"""
import argparse
import math
import statistics
import time

import torch

import mha


def time_pair(fa, fb, reps):
    fa(), fb()  # warm-up
    ta, tb = [], []
    for _ in range(reps):
        for f, t in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def mha_case(B, L, E, heads, reps):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, heads, batch_first=True)
    ours = mha.nn.MultiheadAttention(E, heads, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(B, L, E, requires_grad=True)

    def fwd(m):
        with torch.no_grad():
            m(x, x, x, need_weights=False)

    def fwd_bwd(m):
        out, _ = m(x, x, x, need_weights=False)
        out.sum().backward()

    rows = []
    for name, f in (("forward", fwd), ("forward+backward", fwd_bwd)):
        t_torch, t_mha = time_pair(lambda: f(theirs), lambda: f(ours), reps)
        rows.append((f"MultiheadAttention B={B} L={L} E={E} H={heads}", name, t_torch, t_mha))
    return rows


def functional_case(L, E, heads, reps):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, L, E, requires_grad=True) for _ in range(3))

    def unfused():
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E), -1) @ v

    def ours():
        return mha.functional.scaled_dot_product_attention(q, k, v)

    sides = [("PyTorch unfused", unfused)]
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        sides.append(("PyTorch sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)))
    rows = []
    for label, theirs in sides:
        def fwd(f):
            with torch.no_grad():
                f()

        def fwd_bwd(f):
            f().sum().backward()

        for name, run in (("forward", fwd), ("forward+backward", fwd_bwd)):
            t_torch, t_mha = time_pair(lambda: run(theirs), lambda: run(ours), reps)
            rows.append((f"functional B=1 H={heads} L={L} E={E} vs {label}", name, t_torch, t_mha))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.reps}")
    rows = mha_case(8, 512, 512, 8, args.reps) + mha_case(1, 4096, 512, 8, args.reps) + \
        functional_case(4096, 64, 8, args.reps)
    print(f"| case | pass | PyTorch ms | mha ms | speed-up |\n|---|---|---:|---:|---:|")
    for case, name, a, b in rows:
        print(f"| {case} | {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
