#!/usr/bin/env bash
# Installs the Debian packages mha needs to build and test, where missing.
# Sourced by main.sh and test.sh; safe to run again.
set -euo pipefail

# To build the library, the mha command and the Python package; Open MPI for
# distributed training (mpirun -np P build/mha train ...; docs/distributed.md).
MHA_PACKAGES=(g++ cmake make pkg-config libopenblas-openmp-dev libgtest-dev libgmock-dev libcli11-dev
  nlohmann-json3-dev libpng-dev pybind11-dev python3-dev python3-numpy libopenmpi-dev openmpi-bin)
# Only to run the tests: PyTorch (Debian's is 1.13) to compare against, pytest, matplotlib,
# a headless browser that opens the attention page (VizBrowser.* in tests/test_viz.cpp),
# scikit-learn for its 8×8 digits (`mha train --task digits`, tests/test_vision.cpp), and
# what `pip install .` and `python3 -m build` need offline (tests/python_wheel.sh).
MHA_TEST_PACKAGES=(python3-torch python3-pytest python3-matplotlib chromium python3-sklearn
  python3-pip python3-venv python3-setuptools python3-wheel python3-build)
# The sanitizer and fuzzing build: clang with libFuzzer, its OpenMP runtime.
MHA_SANITIZE_PACKAGES=(clang-14 libclang-rt-14-dev libomp-14-dev)

# Prints those of the given packages that are not installed.
mha_missing_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

# Installs those of the given packages that are missing: mha_install PACKAGES...
mha_install() {
  local missing
  missing=$(mha_missing_packages "$@")
  [ -z "$missing" ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "mha: installing Debian packages: $missing" >&2
  $sudo apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

# Configures and builds one build folder: mha_build DIR [cmake options...]
mha_build() {
  local dir=$1
  shift
  cmake -S "$MHA_ROOT" -B "$MHA_ROOT/$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
  cmake --build "$MHA_ROOT/$dir" -j"$(nproc)"
}

# build-sanitize: clang, AddressSanitizer + UndefinedBehaviorSanitizer, and the
# libFuzzer targets (fuzz/) with the coverage that guides them; without MPI
# (Open MPI's own allocations would flood LeakSanitizer), which also checks
# that everything builds and passes without it.
mha_build_sanitize() {
  CC=clang-14 CXX=clang++-14 mha_build build-sanitize -DMHA_BUILD_TESTS=ON -DMHA_BUILD_PYTHON=OFF -DMHA_BUILD_BENCH=OFF \
    -DMHA_SANITIZE=ON -DMHA_FUZZ=ON -DMHA_WITH_MPI=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
}

# Open MPI's settings for mpirun -np RANKS on this one machine: as root too
# (its allow-run-as-root pair), more ranks than cores allowed, the
# shared-memory transport without the single-copy mechanism that containers
# forbid, and the cores shared out among the ranks' OpenMP threads.
mha_mpi_environment() {
  local ranks=$1
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / ranks > 0 ? $(nproc) / ranks : 1 ))}
  # Open MPI binds each rank to one core (2 ranks or fewer): right for one
  # thread a rank, wrong for more (measured: the wide model's step took 2x).
  if [ "$OMP_NUM_THREADS" -gt 1 ]; then export OMPI_MCA_hwloc_base_binding_policy=none; fi
}

MHA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mha_install "${MHA_PACKAGES[@]}"
