#!/usr/bin/python3
"""A PyTorch model whose attention is mha's: learn to reverse digit strings, then look at a head.

The model is ordinary PyTorch (embedding, learned positions, a linear head)
around two mha.nn.TransformerEncoderLayer; their forward and backward run in
mha's C++ library. After training, matplotlib draws, for one input, the head
whose weights lie most on the anti-diagonal: output position i reads input
position L-1-i.

    PYTHONPATH=build/python python3 examples/python/reverse_with_mha.py [--steps 300] [--out reverse_head.png]
"""
import argparse
import math

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import mha  # noqa: E402

L, VOCAB, D, HEADS = 8, 10, 64, 4


class Reverser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Parameter(torch.randn(L, D) * 0.1)
        self.layers = torch.nn.ModuleList(
            mha.nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=128, dropout=0.0, batch_first=True,
                                           norm_first=True) for _ in range(2))
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def attention_maps(self, ids):
        """[(heads, L, L) per layer]: each layer's self-attention weights for one sequence."""
        x, maps = self.embed(ids) + self.pos, []
        for layer in self.layers:
            h = layer.norm1(x)  # Pre-LN: the attention reads the normed input
            maps.append(layer.self_attn(h, h, h, need_weights=True, average_attn_weights=False)[1][0])
            x = layer(x)
        return maps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="reverse_head.png")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Reverser()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, VOCAB, (64, L))
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), ids.flip(1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps:
            with torch.no_grad():
                test = torch.randint(0, VOCAB, (256, L))
                acc = (model(test).argmax(-1) == test.flip(1)).all(1).float().mean().item()
            # Rounded down: a score short of perfect never reads 100.0%.
            print(f"step {step:4d}  loss {loss.item():.4f}  held-out exact match {math.floor(acc * 1000) / 10:.1f}%")

    sample = torch.randint(0, VOCAB, (1, L))
    with torch.no_grad():
        maps = model.attention_maps(sample)
    # The (layer, head) whose weights sit most on the anti-diagonal.
    rows, anti = torch.arange(L), torch.arange(L).flip(0)
    score = {(li, h): m[h, rows, anti].mean().item() for li, m in enumerate(maps) for h in range(HEADS)}
    layer, best = max(score, key=score.get)
    weights = maps[layer]
    labels = [str(t) for t in sample[0].tolist()]
    fig, ax = plt.subplots(figsize=(4.5, 4))
    im = ax.imshow(weights[best].numpy(), cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(L), labels)
    ax.set_yticks(range(L), labels)
    ax.set_xlabel("key (input position)")
    ax.set_ylabel("query (output position)")
    ax.set_title(f"layer {layer}, head {best}: reversing")
    fig.colorbar(im, ax=ax, label="attention weight")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"layer {layer} head {best}: mean weight on the anti-diagonal {score[layer, best]:.2f}; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
