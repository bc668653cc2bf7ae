#!/usr/bin/env bash
# Installs the built library into a temporary prefix and builds a consumer
# with find_package(mha) and with pkg-config.
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
mkdir -p "$tmp/consumer"
cat >"$tmp/consumer/main.cpp" <<'CPP'
#include <mha/mha.h>
#include <iostream>
int main() {
  mha::Generator gen(1);
  mha::Tensor q = mha::randn({1, 2, 3, 4}, gen);
  auto r = mha::attention_forward(q, q, q);
  std::cout << "consumer ok " << mha::shape_string(r.out.shape()) << "\n";
}
CPP
cat >"$tmp/consumer/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.22)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(mha REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer PRIVATE mha::mha)
CMAKE
cmake -S "$tmp/consumer" -B "$tmp/consumer/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer/build" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib:${LD_LIBRARY_PATH:-}" "$tmp/consumer/build/consumer"
libdir=$(ls -d "$tmp"/prefix/lib*/pkgconfig | head -n 1)
flags=$(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs mha)
# shellcheck disable=SC2086
g++ -std=c++20 "$tmp/consumer/main.cpp" -o "$tmp/pc_consumer" $flags
LD_LIBRARY_PATH="$(dirname "$libdir"):${LD_LIBRARY_PATH:-}" "$tmp/pc_consumer"
