#!/usr/bin/env bash
# The main job: install what is missing, build in Release, then train a small
# Transformer on the copy task, report its held-out exact match (about ten
# seconds on 2 cores) and draw its attention, layer by layer and head by head,
# to runs/copy/attention.png and an offline page to explore, runs/copy/attention.html. With arguments, runs `mha ARGS…` instead, e.g.
#   bash scripts/main.sh demo
#   bash scripts/main.sh train --task reverse --out runs/reverse
# MHA_RANKS=P runs it under mpirun -np P (data parallel; docs/distributed.md), e.g.
#   MHA_RANKS=2 bash scripts/main.sh train --task reverse
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mha_build build -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_BENCH=OFF >/dev/null
if [ "$#" -gt 0 ]; then
  if [ "${MHA_RANKS:-1}" -gt 1 ]; then
    mha_mpi_environment "$MHA_RANKS"
    exec mpirun -np "$MHA_RANKS" "$MHA_ROOT/build/mha" "$@"
  fi
  exec "$MHA_ROOT/build/mha" "$@"
fi
"$MHA_ROOT/build/mha" train --task copy --out "$MHA_ROOT/runs/copy"
for picture in attention.png attention.html; do
  "$MHA_ROOT/build/mha" viz --checkpoint "$MHA_ROOT/runs/copy" --input "3 1 4 1 5 9 2 6 5 3 5 8" \
    --out "$MHA_ROOT/runs/copy/$picture"
done
