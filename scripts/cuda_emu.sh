#!/usr/bin/env bash
# The CUDA backend's tests on the CUDA emulator (tests/cuda_emu; docs/cuda-log.md, "The CUDA
# emulator"): builds build-emu/ (-DEDGETRAIN_CUDA_EMU=ON: backends/cuda/*.cu compiled for the host)
# and runs tests/cuda there, one process per test case, JOBS at once, with EDGETRAIN_REQUIRE_GPU=1
# (BUILD_TYPE=RelWithDebInfo: a fault's backtrace names the kernel's lines). No GPU and no CUDA
# toolkit needed.
# It checks the kernels' logic, bounds and barriers and the backend's use of the runtime; not races
# (but a missing barrier shows in one of the two thread orders: EDGETRAIN_CUDA_EMU_REVERSE=1 runs
# the other), the GPU's rounding or speed (a GPU run does those).
#   scripts/cuda_emu.sh [--build-only] [CATCH FILTER]
# Env: BUILD_DIR (default build-emu, build-emu-races with RACES=1), BUILD_TYPE (default Release,
# RelWithDebInfo with RACES=1),
# JOBS (default nproc), CASE_S (each case's limit, default 900),
# RACES=1 (the race checker, tests/cuda_emu/emu_races.cpp: reports two threads' accesses to one
# address that no barrier orders; the per-op cases take about 3x as long, training cases more),
# SANITIZE (a -fsanitize= list for the whole build, e.g. undefined: EDGETRAIN_SANITIZE),
# CONTRACT=1 (the device code contracted into FMAs where GCC would, as nvcc's default may: a case
# whose bits against the CPU's hold only without contraction fails; give it its own BUILD_DIR),
# SKIP (an extended regular expression: the cases whose names match it are not run),
# EDGETRAIN_CUDA_CONV (default im2col, below),
# CROSS=aarch64 (Jetson Orin's CPU: cross-built with cmake/aarch64-linux-gnu.cmake, default
# BUILD_DIR build-aarch64-emu, and run under qemu-user, as scripts/test_aarch64.sh runs the CPU
# suite: a Jetson's tests/cuda hold its GPU against the CPU backend's ARM code, NEON paths and
# FMA contraction included, and run the backend's host code as built for ARM).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_missing.sh
apt_missing build-essential cmake ninja-build pkg-config libeigen3-dev libcli11-dev catch2 nlohmann-json3-dev libstb-dev

races="${RACES:-0}" cross="${CROSS:-}"
# run: the command line that runs a test binary (through qemu in a cross build).
cross_options=() run=()
case "$cross" in
  "") ;;
  aarch64)
    apt_missing g++-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user
    cross_options=(-DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DEDGETRAIN_PORTABLE=ON)
    run=(qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max) ;;
  *) echo "cuda_emu: CROSS=$cross: only aarch64 is known"; exit 2 ;;
esac
default_dir="build${cross:+-$cross}-emu"
if [ "$races" = 1 ]; then default_dir+=-races; fi
dir="${BUILD_DIR:-$default_dir}" jobs="${JOBS:-$(nproc)}"
build_only=0
[ "${1:-}" = --build-only ] && { build_only=1; shift; }
# A race's report names the kernel's line where the build has debug information.
build_type="${BUILD_TYPE:-$([ "$races" = 1 ] && echo RelWithDebInfo || echo Release)}"
cmake -S . -B "$dir" -G Ninja "${cross_options[@]}" -DCMAKE_BUILD_TYPE="$build_type" -DEDGETRAIN_CUDA_EMU=ON -DEDGETRAIN_ONNX=OFF \
  -DEDGETRAIN_CUDA_EMU_RACES="$([ "$races" = 1 ] && echo ON || echo OFF)" -DEDGETRAIN_SANITIZE="${SANITIZE:-}" \
  -DEDGETRAIN_CUDA_EMU_CONTRACT="$([ "${CONTRACT:-0}" = 1 ] && echo ON || echo OFF)" >/dev/null
cmake --build "$dir" -j "$jobs" --target edgetrain_cuda_tests emu_selftest
[ $build_only -eq 1 ] && exit 0
# The emulator's own checks first: what passes, and each fault it must report. Their kernels are
# not the backend's: left out of the launches scripts/cuda_resources.py checks.
env -u EDGETRAIN_CUDA_EMU_LAUNCHES ctest --test-dir "$dir" --output-on-failure -R '^cuda_emu_'

# The backend's own conv kernels unless asked otherwise: the emulated cuDNN (emu_cudnn.cpp) runs on
# the host, so it would win every measured choice (`auto`), leaving the own kernels untested in the
# training cases, and each first step would measure them again. The cases that test cuDNN's path
# set EDGETRAIN_CUDA_CONV themselves (test::ScopedEnv).
export EDGETRAIN_CUDA_CONV="${EDGETRAIN_CUDA_CONV:-im2col}"

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# Catch's filter syntax: a comma or bracket in a name is escaped. (A listing exits with the number
# of cases listed.)
{ "${run[@]}" "$dir/tests/edgetrain_cuda_tests" --list-test-names-only ${1:+"$1"} || true; } | grep -v '^$' |
  { if [ -n "${SKIP:-}" ]; then grep -v -E -- "$SKIP" || true; else cat; fi; } | sed 's/[],[]/\\&/g' >"$logs/cases"
[ -s "$logs/cases" ] || { echo "cuda_emu: no test case to run"; exit 1; }
: >"$logs/summary"
echo "cuda_emu: $(wc -l <"$logs/cases") test cases, $jobs at once"
start=$(date +%s)
# Each case: its exit status, seconds and name on one line of $logs/summary, its report in a file.
run_case() {
  local name="$1" log s rc
  log="$logs/$(printf '%s' "$name" | md5sum | cut -c1-12).log"
  s=$(date +%s)
  rc=0
  OMP_NUM_THREADS=1 EDGETRAIN_REQUIRE_GPU=1 timeout "${CASE_S:-900}" $run_line "$dir/tests/edgetrain_cuda_tests" "$name" >"$log" 2>&1 || rc=$?
  printf '%s %ss %s\n' "$rc" "$(( $(date +%s) - s ))" "$name" >>"$logs/summary"
  if [ "$rc" -ne 0 ]; then
    echo "cuda_emu: FAILED ($rc): $name"
    tail -n 40 "$log" | sed 's/^/    /'
  fi
}
export -f run_case
run_line="${run[*]}"  # a line, not an array: the cases run in subshells, which get no arrays
export logs dir run_line
xargs -d '\n' -P "$jobs" -I{} bash -c 'run_case "$1"' _ {} <"$logs/cases"
sort -t' ' -k2 -n -r "$logs/summary" | sed 's/^/cuda_emu: /'
failed=$(awk '$1 != 0' "$logs/summary" | wc -l)
echo "cuda_emu: $(wc -l <"$logs/summary") cases, $failed failed, in $(( $(date +%s) - start )) s"
[ "$failed" -eq 0 ]
