#!/usr/bin/env bash
# Installs edgetrain's build dependencies from Debian 12's archive, configures and builds
# (Release, optimised for this CPU; pass -DEDGETRAIN_PORTABLE=ON in CMAKE_ARGS for a portable build).
# Idempotent: re-running only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/apt_missing.sh
# libonnx-dev, libprotobuf-dev: ONNX export (edgetrain export --format onnx); python3-opencv runs
# the exported files in the `onnx` test (tests/onnx_test.sh, bench/onnx_check.py).
apt_missing build-essential cmake ninja-build pkg-config libeigen3-dev libcli11-dev catch2 nlohmann-json3-dev libstb-dev \
  libonnx-dev libprotobuf-dev python3-opencv

BUILD_DIR="${BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$(nproc)"
