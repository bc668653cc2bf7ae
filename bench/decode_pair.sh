#!/usr/bin/env bash
# Greedy decoding, mha with its KV cache (build/bench/decode_throughput) against
# PyTorch's greedy loop on the same model (bench/torch_train.py --decode), side by
# side, one JSON line each; TORCH_CORETYPE=NAME adds PyTorch with OPENBLAS_CORETYPE=NAME.
#   bash bench/decode_pair.sh [NEW_TOKENS] [CONFIGS...]
# MHA_BUILD_DIR and PYTHON as in train_pair.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MHA_BUILD_DIR:-$root/build}
python=${PYTHON:-/usr/bin/python3}
new=${1:-32}
shift || true
configs=("${@:-small mid wide long}")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for config in ${configs[@]}; do
  "$build/bench/decode_throughput" --config "$config" --new "$new"
  "$python" "$root/bench/torch_train.py" --config "$config" --decode "$new" --steps 3 --threads "$OMP_NUM_THREADS"
  if [ -n "${TORCH_CORETYPE:-}" ]; then
    OPENBLAS_CORETYPE=$TORCH_CORETYPE "$python" "$root/bench/torch_train.py" --config "$config" --decode "$new" \
      --steps 3 --threads "$OMP_NUM_THREADS"
  fi
done
