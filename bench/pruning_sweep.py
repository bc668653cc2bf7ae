#!/usr/bin/env python3
"""Head pruning against the share of heads pruned, by importance and at random (docs/compression.md).

For each task and seed: `mha train` a 2-layer decoder with 8 heads per layer (16 heads), then
for each number of heads pruned `mha prune` it by importance (Michel et al.'s iterative pruning,
two heads a round) and at random, each followed by --finetune steps; held-out exact match
before and after fine-tuning comes from each run's prune.json. Then the forward time of the
unpruned and the half-pruned models, measured alternately in one quiet pass (`mha prune --heads
0` times a checkpoint's forward over its held-out set). Writes results.json, a markdown table
and a plot into --out.

    python3 bench/pruning_sweep.py --mha build/mha --work /tmp/pruning --out docs/compression
"""
import argparse
import json
import os
import statistics
import subprocess


def run(mha, *args):
    return subprocess.run([mha, *args], check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mha", default="build/mha")
    ap.add_argument("--work", default="/tmp/mha-pruning", help="checkpoints go here")
    ap.add_argument("--out", default="docs/compression")
    ap.add_argument("--tasks", default="reverse,sort")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--pruned", default="0,2,4,6,8,10,12,14", help="heads pruned (of 16)")
    ap.add_argument("--finetune", type=int, default=200)
    ap.add_argument("--timing-runs", type=int, default=5)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    tasks, seeds = a.tasks.split(","), [int(s) for s in a.seeds.split(",")]
    counts = [int(n) for n in a.pruned.split(",")]
    results = {"tasks": {}, "finetune_steps": a.finetune, "heads": 16}
    for task in tasks:
        per_task = results["tasks"][task] = {"trained": {}, "runs": []}
        for seed in seeds:
            model = os.path.join(a.work, f"{task}-{seed}")
            if not os.path.exists(os.path.join(model, "config.json")):
                run(a.mha, "train", "--task", task, "--heads", "8", "--layers", "2", "--seed", str(seed),
                    "--eval-every", "500", "--out", model)
            summary = json.load(open(os.path.join(model, "summary.json")))
            per_task["trained"][seed] = summary
            for n in counts:
                for by in ("importance", "random"):
                    out = os.path.join(a.work, f"{task}-{seed}-{by}-{n}")
                    run(a.mha, "prune", "--checkpoint", model, "--heads", str(n), "--by", by,
                        "--iterations", str(max(1, n // 2)), "--finetune-steps", str(a.finetune),
                        "--seed", str(seed), "--out", out)
                    p = json.load(open(os.path.join(out, "prune.json")))
                    per_task["runs"].append({"seed": seed, "pruned": n, "by": by,
                                             "before": p["exact_match"]["before"],
                                             "pruned_only": p["exact_match"]["pruned"],
                                             "after": p["exact_match"]["after"],
                                             "parameters": p["parameters"]})
                    print(f"{task} seed {seed} {by:10s} {n:2d} heads: {100 * p['exact_match']['pruned']:5.1f}% "
                          f"-> {100 * p['exact_match']['after']:5.1f}% after fine-tuning", flush=True)
    # Forward time: the unpruned and the half-pruned (by importance) model of each seed, alternately.
    timing = results["forward_ms"] = {}
    for task in tasks:
        ratios = []
        for seed in seeds:
            full = os.path.join(a.work, f"{task}-{seed}")
            half = os.path.join(a.work, f"{task}-{seed}-importance-8")
            ms = {"full": [], "half": []}
            for _ in range(a.timing_runs):
                for name, path in (("full", full), ("half", half)):
                    p = os.path.join(a.work, "timing")
                    run(a.mha, "prune", "--checkpoint", path, "--heads", "0", "--out", p)
                    ms[name].append(json.load(open(os.path.join(p, "prune.json")))["forward_ms"]["before"])
            med = {k: statistics.median(v) for k, v in ms.items()}
            ratios.append(med["half"] / med["full"])
            timing[f"{task}-{seed}"] = med
        timing[task] = statistics.median(ratios)
    json.dump(results, open(os.path.join(a.out, "pruning.json"), "w"), indent=1)
    write_table(results, tasks, seeds, counts, a.out)
    plot(results, tasks, counts, a.out)


def cell(runs, n, by, key):
    values = sorted(100 * r[key] for r in runs if r["pruned"] == n and r["by"] == by)
    return f"{statistics.median(values):.1f} ({values[0]:.1f}–{values[-1]:.1f})"


def write_table(results, tasks, seeds, counts, out):
    lines = []
    for task in tasks:
        runs = results["tasks"][task]["runs"]
        lines += [f"**{task}** (held-out exact match %, median of seeds {', '.join(map(str, seeds))} and their range; "
                  f"after {results['finetune_steps']} fine-tuning steps, and before them)", "",
                  "| heads pruned | by importance | at random | by importance, no fine-tuning | at random, no fine-tuning |",
                  "|---|---|---|---|---|"]
        for n in counts:
            lines.append(f"| {n} of 16 ({100 * n / 16:.0f}%) | {cell(runs, n, 'importance', 'after')} | "
                         f"{cell(runs, n, 'random', 'after')} | {cell(runs, n, 'importance', 'pruned_only')} | "
                         f"{cell(runs, n, 'random', 'pruned_only')} |")
        t = results["forward_ms"]
        lines += ["", f"Forward time of the half-pruned model (by importance) over the held-out set: "
                  f"{t[task]:.2f}× the unpruned model's (median over seeds; " +
                  ", ".join(f"seed {s}: {t[f'{task}-{s}']['half']:.1f} ms against {t[f'{task}-{s}']['full']:.1f} ms"
                            for s in seeds) + ").", ""]
    open(os.path.join(out, "pruning_table.md"), "w").write("\n".join(lines) + "\n")


def plot(results, tasks, counts, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        runs = results["tasks"][task]["runs"]
        for by, colour in (("importance", "tab:blue"), ("random", "tab:orange")):
            for key, style in (("after", "-"), ("pruned_only", ":")):
                med = [statistics.median(100 * r[key] for r in runs if r["pruned"] == n and r["by"] == by)
                       for n in counts]
                label = f"{by}" + (f", {results['finetune_steps']} fine-tuning steps" if key == "after" else ", no fine-tuning")
                ax.plot([100 * n / 16 for n in counts], med, style, color=colour, marker="o", ms=3, label=label)
        ax.set_title(f"{task}: 2 layers x 8 heads")
        ax.set_xlabel("heads pruned (%)")
        ax.set_ylabel("held-out exact match (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pruning.png"), dpi=110)


if __name__ == "__main__":
    main()
