#!/usr/bin/env bash
# ThreadSanitizer over the concurrency tests: a clang build with
# -fsanitize=thread, OpenMP's synchronisation made known to TSan through
# LLVM's Archer tool, and mha's own matrix products (OpenBLAS is not built for
# TSan). Prints what TSan reports; exits non-zero on any report.
#   bash scripts/tsan.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mha_install "${MHA_SANITIZE_PACKAGES[@]}"
# Also for the test listing that the build runs (gtest_discover_tests).
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 ignore_noninstrumented_modules=1"
CC=clang-14 CXX=clang++-14 cmake -S "$MHA_ROOT" -B "$MHA_ROOT/build-tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMHA_BUILD_TESTS=ON -DMHA_BUILD_PYTHON=OFF -DMHA_BUILD_BENCH=OFF \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build "$MHA_ROOT/build-tsan" -j"$(nproc)" --target test_concurrency test_non_finite >/dev/null
archer=$(ls /usr/lib/llvm-14/lib/libarcher.so)
for t in test_concurrency test_non_finite; do
  echo "== $t under ThreadSanitizer"
  MHA_GEMM=mha OMP_TOOL_LIBRARIES="$archer" "$MHA_ROOT/build-tsan/tests/$t" --gtest_brief=1
done
echo "== ThreadSanitizer reported nothing"
