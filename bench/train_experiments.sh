#!/usr/bin/env bash
# The training comparisons in docs/training.md, in one run on one machine:
#   1. Post-LN vs Pre-LN on the same task, seed and budget;
#   2. position encodings trained on lengths <= 16 and tested on length 24;
#   3. training throughput (tokens/s) of the default model.
# Usage: bench/train_experiments.sh [BUILD_DIR] [OUT_DIR]   (defaults: build, runs/experiments)
# Prints markdown tables; every run's folder (metrics.csv, summary.json) stays in OUT_DIR.
set -euo pipefail
build=${1:-build}
out=${2:-runs/experiments}
mha="$build/mha"
mkdir -p "$out"
field() { sed -n "s/.*\"$2\": \([0-9.e+-]*\).*/\1/p" "$1/summary.json"; }
heldout_at() { awk -F, -v s="$2" '$1 == s { print $4 }' "$1/metrics.csv"; }

echo "## Post-LN vs Pre-LN (reverse, lengths 10-20, 1000 steps, seed 1, never stopped early)"
echo
echo "| layer norm | held-out at 250 | 500 | 750 | 1000 | final loss | tokens/s |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for ln in pre post; do
  dir="$out/ln_$ln"
  flag=$([ "$ln" = post ] && echo --post-ln || echo --pre-ln)
  "$mha" train --task reverse --seed 1 --steps 1000 --eval-every 250 --stop-when-perfect false $flag --out "$dir" >/dev/null
  echo "| $ln-LN | $(heldout_at "$dir" 250) | $(heldout_at "$dir" 500) | $(heldout_at "$dir" 750) | $(heldout_at "$dir" 1000) | $(field "$dir" final_loss) | $(field "$dir" tokens_per_second) |"
done
echo

echo "## Positions: trained on copy of lengths 5-16, tested on length 24 (1000 steps, seed 1)"
echo
echo "| positions | held-out exact match, lengths 5-16 | length 24 |"
echo "|---|---:|---:|"
for p in sinusoidal learned relative rope alibi; do
  dir="$out/pos_$p"
  "$mha" train --task copy --min-length 5 --max-length 16 --position "$p" --seed 1 --steps 1000 --eval-every 250 \
    --stop-when-perfect false --out "$dir" >/dev/null
  inside=$("$mha" eval --checkpoint "$dir" | sed -n 's/.*exact match \([0-9.]*%\).*/\1/p')
  beyond=$("$mha" eval --checkpoint "$dir" --min-length 24 --max-length 24 | sed -n 's/.*exact match \([0-9.]*%\).*/\1/p')
  echo "| $p | $inside | $beyond |"
done
