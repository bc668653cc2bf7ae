"""Threads calling mha at once, each on its own inputs, get the serial results bit for bit:
the functional attention (NumPy and torch, forward and backward) and the nn modules."""
import threading

import numpy as np
import torch

import mha


def functional_job(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g, requires_grad=True) for _ in range(3))
    out = mha.functional.scaled_dot_product_attention(q, k, v, is_causal=seed % 2 == 0)
    out.backward(torch.randn(out.shape, generator=g))
    arrays = np.random.default_rng(seed).standard_normal((3, 1, 2, 29, 8)).astype(np.float32)
    out_np = mha.functional.scaled_dot_product_attention(*arrays)
    return [out.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy(), out_np]


class ModuleJob:
    """Its own modules, built up front (torch's default generator is global), run in any thread."""

    def __init__(self, seed):
        torch.manual_seed(seed)
        self.layer = mha.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.attn = mha.nn.MultiheadAttention(32, 4, batch_first=True)
        self.x = torch.randn(2, 23, 32, generator=torch.Generator().manual_seed(seed))
        self.__name__ = "modules"

    def __call__(self, seed):
        for p in list(self.layer.parameters()) + list(self.attn.parameters()):
            p.grad = None
        x = self.x.clone().requires_grad_()
        y = self.layer(x)
        z, _ = self.attn(y, y, y, need_weights=False)
        z.sum().backward()
        return [y.detach().numpy(), z.detach().numpy(), x.grad.numpy()] + [p.grad.numpy() for p in self.layer.parameters()]


def test_threads_give_the_serial_results_bit_for_bit():
    with torch.random.fork_rng():
        jobs = [functional_job if i % 2 == 0 else ModuleJob(100 + i) for i in range(8)]
    serial = [job(100 + i) for i, job in enumerate(jobs)]
    results = [None] * len(jobs)
    failures = []

    def run(i):
        try:
            results[i] = [jobs[i](100 + i) for _ in range(2)]
        except Exception as e:  # reported below, not lost in the thread
            failures.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for i, rounds in enumerate(results):
        for got in rounds:
            assert all(np.array_equal(a, b) for a, b in zip(got, serial[i])), f"job {i} ({jobs[i].__name__}) differs"
