#!/usr/bin/env python3
"""The long-range table (docs/variants.md) from the runs bench/long_range.sh wrote.

    /usr/bin/python3 bench/long_range_table.py runs/long_range

Reads each TASK-KIND/summary.json and config.json; prints one Markdown table:
held-out accuracy (ListOps: the answer; copy and sort: exact match and the
share of output tokens right), training time, time per step and the peak
tensor memory mha allocated (mha::peak_memory(), training and evaluation).
"""
import json
import pathlib
import sys

KINDS = ["full", "window", "strided", "bigbird", "linear", "performer", "linformer", "lsh", "axial"]
TASKS = ["copy", "sort", "listops"]


def main(root):
    root = pathlib.Path(root)
    rows = []
    header = ("| task | attention | held-out accuracy | token accuracy | training s | s / step | peak MiB |\n"
              "|---|---|---:|---:|---:|---:|---:|")
    for task in TASKS:
        for kind in KINDS:
            run = root / f"{task}-{kind}"
            if not (run / "summary.json").exists():
                continue
            s = json.loads((run / "summary.json").read_text())
            c = json.loads((run / "config.json").read_text())
            steps = max(s["steps"], 1)
            token = "" if task == "listops" else f"{100 * s['heldout_token_accuracy']:.1f}%"
            rows.append(f"| {task} ({c['task']['min_length']}-{c['task']['max_length']}) | {kind} | "
                        f"{100 * s['heldout_exact_match']:.1f}% | {token} | {s['train_seconds']:.0f} | "
                        f"{s['train_seconds'] / steps:.2f} | {s['peak_tensor_bytes'] / 2**20:.0f} |")
    print(header)
    print("\n".join(rows))
    baselines = {json.loads(p.read_text()).get("heldout_majority_answer") for p in root.glob("listops-*/summary.json")}
    baselines.discard(None)
    if baselines:
        print(f"\nListOps: always giving the most common held-out answer scores "
              f"{', '.join(f'{100 * b:.1f}%' for b in sorted(baselines))}.")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/long_range")
