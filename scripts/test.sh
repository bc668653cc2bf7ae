#!/usr/bin/env bash
# Every test: install what is missing (PyTorch to compare against, a headless
# browser for the attention page, clang for the sanitizers and libFuzzer),
# build in Release and run the suite, then build with clang's
# AddressSanitizer + UndefinedBehaviorSanitizer and libFuzzer's coverage, run
# the suite again there and each fuzz target for 30 s; last, the concurrency
# tests under ThreadSanitizer.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mha_install "${MHA_TEST_PACKAGES[@]}" "${MHA_SANITIZE_PACKAGES[@]}"
start=$(date +%s)
# ctest runs tests side by side, each with an OpenMP team as wide as the
# machine: idle threads that spin steal the cores the others need (the suite
# took 5x longer); passive waiting lets them sleep.
export OMP_WAIT_POLICY=PASSIVE

echo "== Release build and tests"
mha_build build -DMHA_BUILD_TESTS=ON >/dev/null
ctest --test-dir "$MHA_ROOT/build" --output-on-failure -j"$(nproc)"

echo "== ASan + UBSan build (clang) and tests"
# Not run again here: the installed package, the Python package (an extension
# loaded into python3 would need the sanitizer runtime preloaded), the browser
# tests (Chromium is not ours to sanitize; VizHtml.* check the page's writer
# under the sanitizers) and the kill test (it kills the Release build's runs).
mha_build_sanitize
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
# The differential sweep's 10,000 cases ran in Release; 1,000 of them here (4.5 minutes for all under ASan).
export MHA_DIFFERENTIAL_CASES=1000
# Nor the three longest learning-quality runs (what they assert is how well a
# model learns, checked in Release; their forward and backward code runs here in
# VariantAttention.GradientsOfTheInputAndEveryParameter, the Trainer tests and
# Digits.AShortTrainingRunLearns): 2 minutes of the sanitizer run.
learning='VariantAttention.EveryKindTrainsOnTheEncoder|Trainer.CopyModelHasAHeadThatLooksAtTheSource|Digits.AShortAxialTrainingRunLearns'
ctest --test-dir "$MHA_ROOT/build-sanitize" --output-on-failure -j"$(nproc)" -E "install_consumer|VizBrowser|kill_resume|^fuzz_|$learning"


echo "== each fuzz target for 30 s, under the sanitizers"
log="$MHA_ROOT/build-sanitize/fuzz/fuzz.log"
if ! ctest --test-dir "$MHA_ROOT/build-sanitize" -j"$(nproc)" -R '^fuzz_' -V >"$log" 2>&1; then
  grep -E "fuzz finding|ERROR|SUMMARY|Test +#|Failed" "$log" | head -60
  echo "fuzzing found a problem: the whole log is $log, the input build-sanitize/fuzz/*-crash-*"
  exit 1
fi
grep -E "Test +#|stat::number_of_executed_units" "$log"

echo "== ThreadSanitizer over the concurrency tests"
bash "$MHA_ROOT/scripts/tsan.sh"

echo "== all tests passed in $(( $(date +%s) - start )) s"
