#!/usr/bin/env bash
# Every test: install what is missing (PyTorch to compare against, a headless
# browser for the attention page), build in Release and run the suite, then
# build with AddressSanitizer + UndefinedBehaviorSanitizer and run it again.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mha_install "${MHA_TEST_PACKAGES[@]}"
start=$(date +%s)
# ctest runs tests side by side, each with an OpenMP team as wide as the
# machine: idle threads that spin steal the cores the others need (the suite
# took 5x longer); passive waiting lets them sleep.
export OMP_WAIT_POLICY=PASSIVE

echo "== Release build and tests"
mha_build build -DMHA_BUILD_TESTS=ON >/dev/null
ctest --test-dir "$MHA_ROOT/build" --output-on-failure -j"$(nproc)"

echo "== ASan + UBSan build and tests"
# Not run again here: the installed package, the Python package (an extension
# loaded into python3 would need the sanitizer runtime preloaded) and the
# browser tests (Chromium is not ours to sanitize; VizHtml.* check the page's
# writer under the sanitizers).
mha_build build-sanitize -DMHA_BUILD_TESTS=ON -DMHA_BUILD_PYTHON=OFF -DMHA_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "$MHA_ROOT/build-sanitize" --output-on-failure -j"$(nproc)" -E 'install_consumer|VizBrowser'

echo "== all tests passed in $(( $(date +%s) - start )) s"
