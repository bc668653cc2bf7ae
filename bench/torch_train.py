#!/usr/bin/python3
"""The model of bench/train_throughput (mha) in PyTorch: same shapes, optimizer and loss.

A decoder-only Pre-LN Transformer: token embedding + sinusoidal positions, causal
self-attention, GELU feed-forward, final LayerNorm, linear head; AdamW (lr 6e-3,
weight decay 0.01) with gradient-norm clipping at 1.0; cross-entropy over the
output positions of copy-task sequences BOS x SEP x EOS, padded to the batch's
longest. --layers mha builds the same model from mha.nn.TransformerEncoderLayer
(mha's C++ forward and backward inside a PyTorch model).

Prints one JSON line like train_throughput's: median tokens/s of the timed steps
(padded tokens), the step's GFLOP/s (same FLOP count) and the peak resident memory
the steps add.

    bench/torch_train.py --config mid [--steps 20] [--warmup 3] [--threads 2] [--layers torch|mha]

With --decode N it times greedy decoding instead, as build/bench/decode_throughput does:
a batch of copy prompts (BOS x SEP) in one forward (prefill), then N - 1 steps of one new
token each; nn.TransformerEncoder keeps no KV cache, so each step runs the whole sequence
(eval mode, no_grad). Medians of --steps repetitions.
"""
import argparse
import json
import os
import statistics
import time

import torch

CONFIGS = {  # d_model, heads, layers, ff, batch, min_length, max_length
    "small": (64, 4, 2, 256, 32, 10, 20),
    "mid": (256, 8, 4, 1024, 16, 64, 64),
    "wide": (512, 8, 6, 2048, 8, 253, 253),
    "long": (256, 4, 2, 1024, 2, 1018, 1018),
}
PAD, BOS, SEP, EOS, VOCAB = 10, 11, 12, 14, 21


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def sinusoidal(T, D):
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    i = torch.arange(D)[None, :]
    angle = pos / torch.pow(10000.0, (2 * (i // 2)).double() / D)
    return torch.where(i % 2 == 0, torch.sin(angle), torch.cos(angle)).float()


class Model(torch.nn.Module):
    def __init__(self, d, heads, layers, ff, layer_kind):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, d)
        if layer_kind == "mha":
            import mha
            make = lambda: mha.nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0,
                                                          activation="gelu", batch_first=True, norm_first=True)
        else:
            make = lambda: torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0,
                                                            activation="gelu", batch_first=True, norm_first=True)
        self.layers = torch.nn.ModuleList(make() for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB)
        self.layer_kind = layer_kind

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embedding(ids) + sinusoidal(T, self.embedding.embedding_dim)
        if self.layer_kind == "mha":  # is_causal: no T × T mask (at long, 2 × 16.6 MB to build it)
            for layer in self.layers:
                x = layer(x, is_causal=True)
        else:
            mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
            for layer in self.layers:
                x = layer(x, src_mask=mask)
        return self.head(self.norm(x))


def copy_batch(gen, batch, lo, hi):
    seqs = []
    for _ in range(batch):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        x = torch.randint(0, 10, (n,), generator=gen).tolist()
        seqs.append(([BOS] + x + [SEP] + x + [EOS], n + 2))
    T = max(len(s) for s, _ in seqs)
    ids = torch.full((batch, T), PAD, dtype=torch.long)
    targets = torch.full((batch, T), -100, dtype=torch.long)
    for r, (s, first_output) in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        targets[r, first_output - 1 : len(s) - 1] = torch.tensor(s[first_output:])
    return ids, targets


def decode(model, batch, lo, new, reps):
    gen = torch.Generator().manual_seed(0)
    prompts = torch.cat([torch.full((batch, 1), BOS), torch.randint(0, 10, (batch, lo), generator=gen),
                         torch.full((batch, 1), SEP)], dim=1)
    model.eval()
    prefills, decodes = [], []
    with torch.no_grad():
        for rep in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            ids = prompts
            logits = model(ids)
            t1 = time.perf_counter()
            for step in range(new - 1):
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
                logits = model(ids)
            t2 = time.perf_counter()
            if rep:
                prefills.append(t1 - t0)
                decodes.append(t2 - t1)
    return prompts.numel() / statistics.median(prefills), batch * (new - 1) / statistics.median(decodes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="mid", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="torch", choices=["torch", "mha"])
    ap.add_argument("--decode", type=int, default=0, help="time greedy decoding of this many tokens instead")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    d, heads, layers, ff, batch, lo, hi = CONFIGS[a.config]
    model = Model(d, heads, layers, ff, a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3, weight_decay=0.01)
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n)
    if a.decode:
        prefill, per_token = decode(model, batch, hi, a.decode, a.steps)
        print(json.dumps({"system": "torch" if a.layers == "torch" else "torch+mha-layers", "config": a.config,
                          "threads": a.threads, "torch": torch.__version__,
                          "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "detected"), "batch": batch,
                          "prompt": hi + 2, "new": a.decode, "prefill_tokens_per_second": round(prefill, 1),
                          "decode_tokens_per_second": round(per_token, 1)}))
        return
    gen = torch.Generator().manual_seed(0)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS:")
    rates, flops = [], []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        ids, targets = copy_batch(gen, batch, lo, hi)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seconds = time.perf_counter() - t0
        if step >= a.warmup:
            tokens, T = ids.numel(), ids.shape[1]
            attention = 3.5 * 4.0 * d * (T + 1) / 2 * layers
            rates.append(tokens / seconds)
            flops.append(tokens * (6.0 * dense + attention) / seconds)
    extra_mib = (status_kib("VmHWM:") - before) / 1024.0
    print(json.dumps({"system": "torch" if a.layers == "torch" else "torch+mha-layers", "config": a.config,
                      "threads": a.threads, "torch": torch.__version__,
                      "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "detected"),
                      "tokens_per_second": round(statistics.median(rates), 1),
                      "gflops": round(statistics.median(flops) / 1e9, 2), "peak_extra_mib": round(extra_mib, 1),
                      "dense_parameters": dense}))


if __name__ == "__main__":
    main()
