#!/usr/bin/env bash
# The libFuzzer targets, longer than the test command runs them:
#   bash scripts/fuzz.sh [SECONDS_EACH] [TARGET...]     (default: 600 s, every target)
# Builds build-sanitize as scripts/test.sh does (clang, ASan + UBSan, coverage);
# inputs found go to build-sanitize/fuzz/corpus/TARGET, crashes to
# build-sanitize/fuzz/TARGET-crash-*: copy a crash into fuzz/corpus/TARGET/ (and
# write the test it calls for) once fixed, so that every run replays it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
seconds=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors checkpoint_config digits tokens attention)
mha_install "${MHA_SANITIZE_PACKAGES[@]}"
mha_build_sanitize
for t in "${targets[@]}"; do
  echo "== fuzz_$t for $seconds s"
  OMP_NUM_THREADS=1 "$MHA_ROOT/build-sanitize/fuzz/fuzz_$t" -max_total_time="$seconds" -print_final_stats=1 -timeout=20 \
    -rss_limit_mb=3072 -artifact_prefix="$MHA_ROOT/build-sanitize/fuzz/$t-" \
    "$MHA_ROOT/build-sanitize/fuzz/corpus/$t" "$MHA_ROOT/fuzz/corpus/$t" 2>&1 | grep -E "^stat::|ERROR|finding|SUMMARY" || true
done
