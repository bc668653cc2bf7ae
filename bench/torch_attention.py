#!/usr/bin/python3
"""PyTorch's attention next to mha's fused attention, in one run on one machine.

PyTorch side: the unfused formula softmax(Q Kᵀ/√d) V (PyTorch 1.13 has no public
fused attention) and, where the installed PyTorch has it,
torch.nn.functional.scaled_dot_product_attention. mha side: bench_attention
--shape, run by this script right after. float32, B·H = 8, d = 64, forward and
forward+backward, median of the runs.

    bench/torch_attention.py BUILD_DIR [--threads N] [--lengths 1024 4096]
"""
import argparse
import math
import statistics
import subprocess
import time

import torch


def median_ms(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def torch_times(L, E, threads, reps, causal):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, L, E, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None

    def unfused():
        s = q @ k.transpose(-1, -2) / math.sqrt(E)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    # The same formula writing into buffers allocated once: no fresh L×S pages
    # per call (forward only; autograd cannot reuse them).
    s_buf = torch.empty(8, L, L)
    o_buf = torch.empty(8, L, E)

    def reused():
        torch.bmm(q.detach(), k.detach().transpose(-1, -2), out=s_buf)
        s_buf.mul_(1 / math.sqrt(E))
        if mask is not None:
            s_buf.masked_fill_(mask, float("-inf"))
        s_buf.sub_(s_buf.amax(-1, keepdim=True)).exp_()
        s_buf.div_(s_buf.sum(-1, keepdim=True))
        return torch.bmm(s_buf, v.detach(), out=o_buf)

    out = {"unfused": unfused}
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        out["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with torch.no_grad():
        result = {"reused": median_ms(reused, reps)}
    for name, f in out.items():
        with torch.no_grad():
            fwd = median_ms(f, reps)
        grad = torch.randn(8, L, E, generator=g)

        def fwd_bwd():
            f().backward(grad)

        result[name] = (fwd, median_ms(fwd_bwd, reps))
    return result


def mha_times(build, L, E, threads, reps, causal):
    cmd = [f"{build}/bench/bench_attention", "--shape", "8", str(L), str(E), str(int(causal)), str(threads), str(reps)]
    fwd, bwd = (float(x) for x in subprocess.check_output(cmd, text=True).split())
    return fwd, fwd + bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print(f"PyTorch {torch.__version__}, {a.threads} threads, float32, B·H = 8, d = 64; median ms of {a.reps}\n")
    print("| L=S | causal | PyTorch unfused fwd | fwd+bwd | unfused fwd, buffers reused | PyTorch SDPA fwd | fwd+bwd |"
          " mha fused fwd | fwd+bwd | mha speed-up fwd (vs reused) | fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for L in a.lengths:
        for causal in (False, True):
            t = torch_times(L, 64, a.threads, a.reps, causal)
            m = mha_times(a.build, L, 64, a.threads, a.reps, causal)
            u = t["unfused"]
            s = t.get("sdpa")
            sdpa = f"{s[0]:.1f} | {s[1]:.1f}" if s else "— | —"
            r = t["reused"]
            print(f"| {L} | {'yes' if causal else 'no'} | {u[0]:.1f} | {u[1]:.1f} | {r:.1f} | {sdpa} | {m[0]:.1f} |"
                  f" {m[1]:.1f} | {u[0] / m[0]:.1f}× ({r / m[0]:.1f}×) | {u[1] / m[1]:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
