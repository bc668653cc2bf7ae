#!/usr/bin/env python3
"""Distillation against training alone (docs/compression.md).

For each task and seed: a teacher (`mha train`, d_model 64, 2 layers, ff 256), then a student
of about a quarter of its parameters (d_model 32, 2 heads, 2 layers, ff 128) trained for the
same steps three ways from the same seed: alone (`mha train`), distilled (`mha distill`: soft
targets), and distilled with attention transfer as well. Held-out exact match every steps/10
(metrics.csv) gives the learning curves. Writes distill.json, a markdown table and a plot into --out.

    python3 bench/distill_sweep.py --mha build/mha --work /tmp/distill --out docs/compression
"""
import argparse
import csv
import json
import os
import statistics
import subprocess

# Per task: the teacher's flags and the students' steps and flags (measured to converge, or not, here).
TASKS = {
    "add": {"task": ["--task", "add", "--digits", "3"],
            "teacher": ["--heads", "4", "--steps", "4000", "--lr", "2e-3", "--min-lr", "2e-4", "--batch", "64"],
            "steps": 3000, "student": ["--lr", "2e-3", "--min-lr", "2e-4", "--batch", "64"]},
    "sort": {"task": ["--task", "sort"], "teacher": ["--heads", "4", "--steps", "1500"],
             "steps": 600, "student": []},
}
STUDENT = ["--d-model", "32", "--heads", "2", "--layers", "2", "--ff", "128"]
KINDS = {"alone": None, "distilled": [], "distilled + attention": ["--attention-transfer"]}


def run(mha, *args):
    return subprocess.run([mha, *args], check=True, capture_output=True, text=True).stdout


def curve(path):
    with open(os.path.join(path, "metrics.csv")) as f:
        return [(int(r["step"]), float(r["heldout_exact_match"])) for r in csv.DictReader(f) if r["heldout_exact_match"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mha", default="build/mha")
    ap.add_argument("--work", default="/tmp/mha-distill")
    ap.add_argument("--out", default="docs/compression")
    ap.add_argument("--tasks", default="add,sort")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--temperature", default="1")
    ap.add_argument("--alpha", default="0.5")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    tasks, seeds = a.tasks.split(","), [int(s) for s in a.seeds.split(",")]
    results = {"temperature": float(a.temperature), "alpha": float(a.alpha), "tasks": {}}
    for task in tasks:
        t = TASKS[task]
        per = results["tasks"][task] = {"steps": t["steps"], "runs": []}
        for seed in seeds:
            teacher = os.path.join(a.work, f"{task}-teacher-{seed}")
            if not os.path.exists(os.path.join(teacher, "config.json")):
                run(a.mha, "train", *t["task"], *t["teacher"], "--seed", str(seed), "--eval-every", "500",
                    "--out", teacher)
            tsum = json.load(open(os.path.join(teacher, "summary.json")))
            common = [*STUDENT, *t["student"], "--steps", str(t["steps"]), "--eval-every", str(t["steps"] // 10),
                      "--stop-when-perfect", "false", "--seed", str(seed)]
            row = {"seed": seed, "teacher": tsum["heldout_exact_match"], "teacher_parameters": tsum["parameters"]}
            for kind, extra in KINDS.items():
                out = os.path.join(a.work, f"{task}-{kind.replace(' + ', '-')}-{seed}")
                if extra is None:
                    run(a.mha, "train", *t["task"], *common, "--out", out)
                else:
                    run(a.mha, "distill", "--teacher", teacher, "--temperature", a.temperature, "--alpha", a.alpha,
                        *extra, *common, "--out", out)
                s = json.load(open(os.path.join(out, "summary.json")))
                row[kind] = {"exact_match": s["heldout_exact_match"], "parameters": s["parameters"],
                             "seconds": s["train_seconds"], "curve": curve(out)}
                print(f"{task} seed {seed} {kind:22s} {100 * s['heldout_exact_match']:5.1f}% "
                      f"(teacher {100 * row['teacher']:.1f}%)", flush=True)
            per["runs"].append(row)
    json.dump(results, open(os.path.join(a.out, "distill.json"), "w"), indent=1)
    write_table(results, tasks, seeds, a.out)
    plot(results, tasks, a.out)


def write_table(results, tasks, seeds, out):
    lines = [f"Temperature {results['temperature']:g}, alpha {results['alpha']:g}; held-out exact match %, "
             f"median of seeds {', '.join(map(str, seeds))} and their range.", "",
             "| task | teacher (parameters) | student alone | distilled | distilled + attention transfer | student parameters |",
             "|---|---|---|---|---|---|"]
    for task in tasks:
        runs = results["tasks"][task]["runs"]

        def cell(values):
            values = sorted(100 * v for v in values)
            return f"{statistics.median(values):.1f} ({values[0]:.1f}–{values[-1]:.1f})"

        p_t, p_s = runs[0]["teacher_parameters"], runs[0]["alone"]["parameters"]
        lines.append(f"| {task}, {results['tasks'][task]['steps']} steps | {cell(r['teacher'] for r in runs)} "
                     f"({p_t}) | {cell(r['alone']['exact_match'] for r in runs)} | "
                     f"{cell(r['distilled']['exact_match'] for r in runs)} | "
                     f"{cell(r['distilled + attention']['exact_match'] for r in runs)} | {p_s} ({p_s / p_t:.2f}×) |")
    open(os.path.join(out, "distill_table.md"), "w").write("\n".join(lines) + "\n")


def plot(results, tasks, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    colours = {"alone": "tab:orange", "distilled": "tab:blue", "distilled + attention": "tab:green"}
    for ax, task in zip(axes[0], tasks):
        runs = results["tasks"][task]["runs"]
        for kind, colour in colours.items():
            for i, r in enumerate(runs):
                steps, em = zip(*r[kind]["curve"])
                ax.plot(steps, [100 * e for e in em], color=colour, alpha=0.8, lw=1,
                        label=kind if i == 0 else None)
        ax.set_title(f"{task}: student (~1/4 of the teacher)")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out exact match (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "distill.png"), dpi=110)


if __name__ == "__main__":
    main()
