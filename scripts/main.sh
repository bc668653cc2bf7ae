#!/usr/bin/env bash
# The main job: install what is missing, build in Release, then train a small
# Transformer on the copy task and report its held-out exact match (about
# half a minute on 2 cores). With arguments, runs `mha ARGS…` instead, e.g.
#   bash scripts/main.sh demo
#   bash scripts/main.sh train --task reverse --out runs/reverse
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mha_build build -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_BENCH=OFF >/dev/null
if [ "$#" -eq 0 ]; then
  set -- train --task copy --out "$MHA_ROOT/runs/copy"
fi
"$MHA_ROOT/build/mha" "$@"
