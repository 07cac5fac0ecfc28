#!/usr/bin/env bash
# Builds the test suite with sanitizers and runs it. Nothing recovers: the first report aborts the
# test that produced it, so a green run is a clean one.
#   scripts/sanitize.sh [address] [CTEST ARGS...]  AddressSanitizer + UndefinedBehaviorSanitizer (and
#                                                   LeakSanitizer) in build-asan/, every test by default
#   scripts/sanitize.sh thread [CTEST ARGS...]      ThreadSanitizer in build-tsan/, on the code that runs
#                                                   its own std::threads (see below)
#   scripts/sanitize.sh [address|thread] --build-only   the build alone
# Env: BUILD_DIR (default build-asan / build-tsan), JOBS (default nproc).
# -O1 -g with assertions on (Eigen's included); -march=native as the normal build, so the vector
# kernels this CPU runs are the ones checked. Not built here: edgetrain_alloc_tests (it wraps malloc and
# replaces operator new, which the sanitizers' own allocators must own). docs/sanitizers_aarch64.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_missing.sh
apt_missing build-essential cmake ninja-build pkg-config libeigen3-dev libcli11-dev catch2 nlohmann-json3-dev libstb-dev

mode=address
case "${1:-}" in address|thread) mode="$1"; shift ;; esac
build_only=0
[ "${1:-}" = --build-only ] && { build_only=1; shift; }

if [ "$mode" = address ]; then
  dir="${BUILD_DIR:-build-asan}" sanitizers=address,undefined
  # Not detect_stack_use_after_return: GCC 12 keeps the 64-byte alignment it gives AVX-512 locals
  # (an aligned vmovapd) while ASan's fake stack frames are only 32-byte aligned, so every AVX-512
  # kernel with a local array faults there (docs/sanitizers_aarch64.md).
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:check_initialization_order=1:strict_init_order=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
  args=("$@")
else
  # ThreadSanitizer does not see libgomp's synchronisation, so OpenMP is capped at one thread in
  # this build (tests/CMakeLists.txt: OMP_THREAD_LIMIT=1) and TSan checks the engine's own threads:
  # the BatchLoader's prefetch thread and the image-folder decode pool, alone and in training runs.
  dir="${BUILD_DIR:-build-tsan}" sanitizers=thread
  export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
  args=("$@")
fi

cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" \
  -DEDGETRAIN_SANITIZE="$sanitizers"
cmake --build "$dir" -j "${JOBS:-$(nproc)}"
[ $build_only -eq 1 ] && exit 0
start=$(date +%s)
ctest --test-dir "$dir" --output-on-failure -j "${JOBS:-$(nproc)}" "${args[@]}"
echo "sanitize ($sanitizers): passed in $(( $(date +%s) - start )) s"
