#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cpp) with clang, ASan and UBSan in build-fuzz/ and runs
# each for SECONDS (default 60) on its seed corpus fuzz/corpus/<target>/ (new inputs go to a
# scratch copy, not the repository). Prints the inputs executed per target; fails on any crash,
# hang (-timeout), out-of-memory / over-large allocation or sanitizer report, leaving the
# reproducer in build-fuzz/artifacts/. Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-60}"
shift || true

. scripts/apt_missing.sh
apt_missing build-essential cmake ninja-build pkg-config libeigen3-dev libcli11-dev catch2 nlohmann-json3-dev libstb-dev \
  clang-14 libclang-rt-14-dev libomp-14-dev

B=build-fuzz
CC=clang-14 CXX=clang++-14 cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEDGETRAIN_FUZZ=ON \
  -DEDGETRAIN_TESTS=OFF ${CMAKE_ARGS:-} >/dev/null
cmake --build $B --target fuzz_targets -j "${FUZZ_JOBS:-$(nproc)}"

targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  for f in fuzz/fuzz_*.cpp; do t="$(basename "$f" .cpp)"; targets+=("${t#fuzz_}"); done
fi
mkdir -p $B/artifacts
failed=()
for t in "${targets[@]}"; do
  corpus="$B/corpus/$t"
  mkdir -p "$corpus"
  log="$B/fuzz_$t.log"
  # Single process, 1 s a input at most, no single allocation over 512 MB, 2 GB resident.
  set +e
  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    OMP_NUM_THREADS=1 "$B/fuzz/fuzz_$t" "$corpus" "fuzz/corpus/$t" -max_total_time="$SECONDS_EACH" -timeout=10 ${FUZZ_SEED:+-seed=$FUZZ_SEED} \
    -malloc_limit_mb=512 -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 \
    -artifact_prefix="$B/artifacts/${t}-" >"$log" 2>&1
  rc=$?
  set -e
  execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")"
  if [ $rc -eq 0 ]; then
    printf 'fuzz %-12s ok    %10s inputs in %ss\n' "$t" "$execs" "$SECONDS_EACH"
  else
    printf 'fuzz %-12s FAIL  (exit %d) after %s inputs; log %s\n' "$t" $rc "$execs" "$log"
    grep -E "ERROR|SUMMARY|runtime error|Test unit written|deadly signal|timeout|out-of-memory" "$log" | head -8 | sed 's/^/    /'
    failed+=("$t")
  fi
done
[ "${#failed[@]}" -eq 0 ] || { echo "fuzz: failures in ${failed[*]}"; exit 1; }
