#!/usr/bin/env bash
# Cross-builds edgetrain for aarch64 (the Jetson's CPU) with Debian's cross toolchain and runs the
# test suite under qemu-user: the NEON paths (conv_simd.h, gemm, the bitmap codec, the sdot integer
# conv tiles) run against their scalar references. qemu emulates `-cpu max`, which has asimddp, so
# the dot-product tiles are selected as on a Jetson Orin / Xavier.
#   scripts/test_aarch64.sh [CTEST ARGS...]   e.g. -R 'bitmap|conv' for a subset; default: everything
#   scripts/test_aarch64.sh --build-only      the cross build alone
#   scripts/test_aarch64.sh --resume [CTEST ARGS...]
#       the selected tests one at a time, fastest first (by the times recorded so far, else by a
#       native build's, COST_FILE), each result appended to $BUILD_DIR/qemu_results.tsv; a test that
#       already passed with the same build (the SHA-256 of the binaries and test scripts) is not run
#       again, so the whole suite can be completed over several sittings. Exit 1 if a test failed.
# Env: BUILD_DIR (default build-aarch64), BUILD_TYPE (default Release), JOBS (default nproc),
#      TARGETS (the targets to build, default all),
#      TEST_TIMEOUT (--resume: seconds per test, default 14400),
#      COST_FILE (--resume: default build/Testing/Temporary/CTestCostData.txt, a native run's times).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt_missing.sh

action=test
case "${1:-}" in --build-only) action=build; shift ;; --resume) action=resume; shift ;; esac

# The cross compiler and the target's C/C++ runtime (libgomp for OpenMP), qemu's user-mode
# emulator, and the header-only dependencies (architecture-free: the host's copies serve).
apt_missing cmake ninja-build g++-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user \
  libeigen3-dev libcli11-dev catch2 nlohmann-json3-dev libstb-dev

BUILD_DIR="${BUILD_DIR:-build-aarch64}"
# Portable: no -march=native of the x86 host; the baseline armv8-a has NEON, and the sdot tiles
# (conv_int_neon.cpp) get +dotprod on their own and are chosen at run time.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" -DEDGETRAIN_PORTABLE=ON
# TARGETS: build only these (CI runs tests of edgetrain_tests alone: the app, benchmarks and the
# allocator tests would add a minute of cross-compiling there for nothing it runs).
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" ${TARGETS:+--target $TARGETS}
[ "$action" = build ] && exit 0

start=$(date +%s)
if [ "$action" = test ]; then
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${JOBS:-$(nproc)}" "$@"
  echo "test_aarch64: tests passed under qemu in $(( $(date +%s) - start )) s"
  exit 0
fi

# --resume. The build's key: what a test runs (binaries, the ONNX module, the shell tests).
results="$BUILD_DIR/qemu_results.tsv" logs="$BUILD_DIR/qemu_logs"
mkdir -p "$logs"
keyed=()
for f in "$BUILD_DIR"/edgetrain "$BUILD_DIR"/tests/edgetrain*_tests "$BUILD_DIR"/libedgetrain_onnx.so tests/*.sh \
         tests/headers_cxx14.cpp; do
  [ -f "$f" ] && keyed+=("$f")
done
key=$(cat "${keyed[@]}" | sha256sum | cut -c1-16)
[ -f "$results" ] || printf 'build\tresult\twall_s\tcpu_s\tdate\ttest\n' >"$results"

# The selected tests: "number<TAB>name" from ctest's listing (numbers are this build's).
mapfile -t listed < <(ctest --test-dir "$BUILD_DIR" -N "$@" | sed -nE 's/^ *Test +#([0-9]+): (.*)$/\1\t\2/p')
# Order: a time per test, this build folder's qemu results first (the latest), else the native
# cost file (times 30, about qemu's slowdown), else 0; fastest first.
cost_file="${COST_FILE:-build/Testing/Temporary/CTestCostData.txt}"
order=$(printf '%s\n' "${listed[@]}" | awk -F'\t' -v results="$results" -v costs="$cost_file" '
  BEGIN {
    while ((getline line < costs) > 0) {
      if (line == "---") break
      n = split(line, f, " "); if (n < 3 || f[n-1] == 0) continue
      name = line; sub(/ [0-9]+ [0-9.e+-]+$/, "", name); native[name] = f[n] * 30
    }
    while ((getline line < results) > 0) { split(line, f, "\t"); if (f[3] ~ /^[0-9.]+$/) qemu[f[6]] = f[3] }
  }
  { split($0, f, "\t"); t = (f[2] in qemu) ? qemu[f[2]] : ((f[2] in native) ? native[f[2]] : 0)
    printf "%012.1f\t%s\n", t, $0 }' | sort -s -t$'\t' -k1,1 | cut -f2-)

passed=0 failed=0 skipped=0
while IFS=$'\t' read -r num name; do
  [ -n "$num" ] || continue
  if awk -F'\t' -v k="$key" -v n="$name" '$1 == k && $2 == "pass" && $6 == n { found = 1 } END { exit !found }' "$results"; then
    skipped=$((skipped + 1)); continue
  fi
  log="$logs/$num.log"
  # The wall time, and the CPU time of ctest and everything it ran (qemu included): bash's `time`.
  set +e
  TIMEFORMAT='%R %U %S'
  { time ctest --test-dir "$BUILD_DIR" -I "$num,$num" --output-on-failure --timeout "${TEST_TIMEOUT:-14400}" \
      </dev/null >"$log" 2>&1; } 2>"$log.time"
  rc=$?
  set -e
  read -r wall user sys < <(tail -n 1 "$log.time")
  cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.1f", u + s }')
  # ctest exits 0 for a skipped test (SKIP_RETURN_CODE) too: record it as a skip, not a pass.
  result=pass
  if [ $rc -ne 0 ]; then result=fail; failed=$((failed + 1))
  elif grep -q '\*\*\*Skipped' "$log"; then result=skip
  else passed=$((passed + 1)); fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$key" "$result" "$wall" "$cpu" "$(date -Is)" "$name" >>"$results"
  echo "$result $(printf '%8s' "$wall") s  $name"
done <<<"$order"
echo "test_aarch64 --resume (build $key): $passed passed, $failed failed, $skipped passed before;" \
  "$(( $(date +%s) - start )) s; results in $results, logs in $logs"
[ $failed -eq 0 ]
