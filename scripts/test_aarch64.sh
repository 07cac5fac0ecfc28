#!/usr/bin/env bash
# Cross-builds edgetrain for aarch64 (the Jetson's CPU) with Debian's cross toolchain and runs the
# test suite under qemu-user: the NEON paths (conv_simd.h, gemm, the bitmap codec, the sdot integer
# conv tiles) run against their scalar references. qemu emulates `-cpu max`, which has asimddp, so
# the dot-product tiles are selected as on a Jetson Orin / Xavier.
#   scripts/test_aarch64.sh [CTEST ARGS...]   e.g. -R 'bitmap|conv' for a subset; default: everything
# Env: BUILD_DIR (default build-aarch64), BUILD_TYPE (default Release).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_missing.sh

# The cross compiler and the target's C/C++ runtime (libgomp for OpenMP), qemu's user-mode
# emulator, and the header-only dependencies (architecture-free: the host's copies serve).
apt_missing cmake ninja-build g++-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user \
  libeigen3-dev libcli11-dev catch2 nlohmann-json3-dev libstb-dev

BUILD_DIR="${BUILD_DIR:-build-aarch64}"
# Portable: no -march=native of the x86 host; the baseline armv8-a has NEON, and the sdot tiles
# (conv_int_neon.cpp) get +dotprod on their own and are chosen at run time.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" -DEDGETRAIN_PORTABLE=ON
cmake --build "$BUILD_DIR" -j "$(nproc)"
start=$(date +%s)
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" "$@"
echo "test_aarch64: tests passed under qemu in $(( $(date +%s) - start )) s"
