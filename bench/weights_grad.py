#!/usr/bin/python3
"""The fused backward with and without a loss on the returned weights (dweights), side by side.

    OMP_NUM_THREADS=2 PYTHONPATH=build/python python3 bench/weights_grad.py [--reference]

B·H = 64 heads of 64, float32; for each length, 7 calls of each kind alternate and the
medians of wall and CPU time are printed (CPU time shows how many threads ran: importing
torch, which `import mha` does when it is installed, sets OpenMP to the physical cores).
--reference also times the reference path with dweights at L = 512.
"""
import argparse
import time

import numpy as np

from mha import _mha


def median_ms(xs):
    return 1e3 * sorted(xs)[len(xs) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", action="store_true")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    for L, causal in ((512, "none"), (1024, "none"), (1024, "top_left")):
        q, k, v, do = (rng.standard_normal((8, 8, L, 64)).astype(np.float32) for _ in range(4))
        out, lse, w, _ = _mha.attention_forward(q, k, v, causal=causal, return_weights=True)
        dw = rng.standard_normal(w.shape).astype(np.float32)
        kinds = {"plain": None, "dweights": dw}
        wall = {name: [] for name in kinds}
        cpu = {name: [] for name in kinds}
        for _ in range(7):
            for name, g in kinds.items():
                t, c = time.perf_counter(), time.process_time()
                _mha.attention_backward(do, q, k, v, out, lse, causal=causal, grad_weights=g)
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
        print(f"L={L} causal={causal:9} plain {median_ms(wall['plain']):7.1f} ms (cpu {median_ms(cpu['plain']):7.1f})"
              f"  dweights {median_ms(wall['dweights']):7.1f} ms (cpu {median_ms(cpu['dweights']):7.1f})"
              f"  ratio {median_ms(wall['dweights']) / median_ms(wall['plain']):.2f}")
        if args.reference and L == 512:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                _mha.attention_backward(do, q, k, v, out, lse, causal=causal, grad_weights=dw, path="reference")
                times.append(time.perf_counter() - t)
            print(f"L={L} causal={causal:9} reference path with dweights {median_ms(times):7.1f} ms")


if __name__ == "__main__":
    main()
