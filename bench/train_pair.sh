#!/usr/bin/env bash
# mha train against the same model in PyTorch (and PyTorch with mha's layers),
# side by side: for each configuration the three runs alternate, ROUNDS times,
# each printing one JSON line (bench/train_throughput.cpp, bench/torch_train.py).
# With TORCH_CORETYPE=NAME set, PyTorch and PyTorch with mha's layers run
# again with OPENBLAS_CORETYPE=NAME (for a CPU that Debian's OpenBLAS does not
# detect; mha's layers then use OpenBLAS too, see src/cpu/gemm.cpp).
#   bash bench/train_pair.sh [ROUNDS] [CONFIGS...]     (after scripts/main.sh or test.sh built build/)
# MHA_BUILD_DIR=DIR takes the programs and the Python package from DIR (default
# build/), PYTHON=EXE the interpreter that has torch (default /usr/bin/python3).
# The table of docs/benchmarks.md from its lines (ratios taken within each round):
#   bash bench/train_pair.sh 3 | tee pair.jsonl | python3 bench/train_pair_table.py
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MHA_BUILD_DIR:-$root/build}
python=${PYTHON:-/usr/bin/python3}
rounds=${1:-1}
shift || true
configs=("${@:-small mid wide long}")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
steps_of() { case $1 in small) echo 200;; mid) echo 12;; wide) echo 4;; long) echo 6;; esac; }
for config in ${configs[@]}; do
  steps=$(steps_of "$config")
  for _ in $(seq "$rounds"); do
    "$build/bench/train_throughput" --config "$config" --steps "$steps" --warmup 2
    "$python" "$root/bench/torch_train.py" --config "$config" --steps "$steps" --warmup 2 --threads "$OMP_NUM_THREADS"
    PYTHONPATH="$build/python" "$python" "$root/bench/torch_train.py" --config "$config" --steps "$steps" \
      --warmup 2 --threads "$OMP_NUM_THREADS" --layers mha
    if [ -n "${TORCH_CORETYPE:-}" ]; then
      OPENBLAS_CORETYPE=$TORCH_CORETYPE "$python" "$root/bench/torch_train.py" --config "$config" \
        --steps "$steps" --warmup 2 --threads "$OMP_NUM_THREADS"
      OPENBLAS_CORETYPE=$TORCH_CORETYPE PYTHONPATH="$build/python" "$python" "$root/bench/torch_train.py" \
        --config "$config" --steps "$steps" --warmup 2 --threads "$OMP_NUM_THREADS" --layers mha
    fi
  done
done
