#!/usr/bin/env bash
# The main job: install what is missing, build in Release, run the demo.
# Extra arguments go to `mha demo` (try --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mha_build build -DMHA_BUILD_TESTS=OFF >/dev/null
"$MHA_ROOT/build/mha" demo "$@"
