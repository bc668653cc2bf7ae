#!/usr/bin/env bash
# The long-range comparison (docs/variants.md): every attention kind trained
# with the same model, data and number of steps on ListOps (nested
# expressions of 512-2048 tokens) and on copy and sort of 512 digits, all on
# the bidirectional encoder (`mha train --arch encoder`), which every kind
# supports. Each run writes runs/long_range/TASK-KIND/summary.json (accuracy,
# training time, peak tensor memory); bench/long_range_table.py makes the
# table from them.
#
#   bash bench/long_range.sh [KIND …]      # default: all nine kinds
#   /usr/bin/python3 bench/long_range_table.py runs/long_range
#
# Environment: MHA (default build/mha), OUT (default runs/long_range),
# TASKS (default "copy sort listops"), STEPS_SCALE (multiplies the steps), STEPS
# (replaces them: a quick trial).
set -euo pipefail
cd "$(dirname "$0")/.."
mha=${MHA:-build/mha}
out=${OUT:-runs/long_range}
tasks=${TASKS:-copy sort listops}
scale=${STEPS_SCALE:-1}
kinds=${*:-full window strided bigbird linear performer linformer lsh axial}
mkdir -p "$out"

# One model and optimiser for every run; each kind's own settings sized for
# sequences of 1-2k: a ±64 window, 32-position blocks, 64 random features,
# k = 64 projected keys, 2 hash rounds in chunks of 32, rows of 32. RoPE
# positions (every kind takes them): with sinusoidal ones not even full
# attention learns copy at this length within the budget; with RoPE it
# does, by step 100. OMP_WAIT_POLICY is left unset: one process owns the
# machine (PASSIVE, which the tests need, made these runs 1.45× slower).
common=(--arch encoder --position rope --d-model 64 --heads 4 --layers 2 --ff 128 --batch 8 --lr 3e-3 --min-lr 3e-4 --warmup 20
        --heldout 64 --stop-when-perfect false --window 64 --block 32 --features 64 --projected 64 --hashes 2
        --chunk 32 --axial-width 32)

for task in $tasks; do
  case $task in
    listops) args=(--task listops --min-length 512 --max-length 2048); steps=300 ;;
    copy) args=(--task copy --min-length 512 --max-length 512); steps=150 ;;
    sort) args=(--task sort --min-length 512 --max-length 512); steps=150 ;;
    *) echo "unknown task $task" >&2; exit 2 ;;
  esac
  steps=${STEPS:-$((steps * scale))}
  for kind in $kinds; do
    echo "== $task, $kind attention, $steps steps"
    "$mha" train "${common[@]}" "${args[@]}" --attention "$kind" --steps "$steps" --eval-every "$steps" \
      --out "$out/$task-$kind" | tail -n 3
  done
done
