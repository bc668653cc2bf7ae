#!/usr/bin/env python3
"""The positional heads of trained copy and reverse models (docs/compression.md).

For each task and seed: `mha train` a 2-layer decoder with 8 heads per layer (the pruning
sweep's models when --work is shared with it), `mha heads` over 256 held-out examples, and the
heads it labels positional; one model per task drawn with `mha viz`. Writes heads_table.md and
the pictures into --out.

    python3 bench/positional_heads.py --mha build/mha --work /tmp/mha-pruning --out docs/compression
"""
import argparse
import os
import re
import subprocess

INPUT = "3 1 4 1 5 9 2 6 5 3 5 8"


def run(mha, *args):
    return subprocess.run([mha, *args], check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mha", default="build/mha")
    ap.add_argument("--work", default="/tmp/mha-pruning")
    ap.add_argument("--out", default="docs/compression")
    ap.add_argument("--seeds", default="1,2,3")
    a = ap.parse_args()
    lines = ["| model | positional heads (layer.head: what it attends to, mean share) | other heads |", "|---|---|---|"]
    for task in ("copy", "reverse"):
        for seed in a.seeds.split(","):
            model = os.path.join(a.work, f"{task}-{seed}")
            if not os.path.exists(os.path.join(model, "config.json")):
                run(a.mha, "train", "--task", task, "--heads", "8", "--layers", "2", "--seed", seed,
                    "--eval-every", "500", "--out", model)
            table = run(a.mha, "heads", "--checkpoint", model, "--examples", "256")
            found, others = [], 0
            for row in table.splitlines():
                m = re.match(r"^self +(\d+) +(\d+) .*positional: (.*)$", row)
                if m:
                    found.append(f"{m.group(1)}.{m.group(2)}: {m.group(3)}")
                elif row.startswith("self"):
                    others += 1
            lines.append(f"| {task}, seed {seed} | {'; '.join(found) or 'none'} | {others} |")
            if seed == a.seeds.split(",")[0]:
                run(a.mha, "viz", "--checkpoint", model, "--input", INPUT,
                    "--out", os.path.join(a.out, f"{task}_attention.png"))
    open(os.path.join(a.out, "heads_table.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
