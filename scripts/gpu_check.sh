#!/usr/bin/env bash
# Issue 13's checks on a GPU machine, as one prepared run (the `device` tool lends one for minutes,
# so nothing is built there). Prepare here with scripts/gpu_prepare.sh (builds build-cuda: portable
# x86, sm_90; copies the binaries and a 20 MB .tgz of the JPEG CIFAR-10 into gpu/, which
# .gitignore leaves out), then run there, carrying gpu/:
#   STEPS="tests train bench conv fused" bash scripts/gpu_check.sh gpu
# The steps (each a function step_<name> below) run in the order STEPS names them: tests, train,
# bench, conv, fused, luq, budget, memory, profile, badinput, torch, suite.
# A session has 15 minutes of device time (a start takes about 40 s): docs/cuda.md, "How it is
# checked on a GPU", gives the two runs that fit, in the order to spend them.
# Each step has its own time limit and writes its log to $OUT; a step that fails does not stop the
# next. The CPU suite runs there sharded by test case (the machine has 16 cores).
# The device tool's limits shape this script: a command runs at most 600 s (DEADLINE, 480 by
# default, cuts every step's limit to the time left, so the last steps still print their
# summaries), at most 8 files come back from $OUT (each step writes one or two; per-case logs stay
# in /tmp and the failures' are appended to one file; more than 8 go back as one .tgz), and the
# carried tree is at most 64 MiB
# (gpu_prepare.sh packs the binaries into gpu/bin.tgz).
set -u
G="$(cd "${1:-gpu}" && pwd)"
OUT="${OUT:-/tmp/gpu_out}"
STEPS="${STEPS:-tests train bench conv fused}"
EPOCHS="${EPOCHS:-5}"
DEADLINE="${DEADLINE:-480}"
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
known_steps=$(sed -n 's/^step_\([a-z]*\)() {$/\1/p' "$0" | tr '\n' ' ')
for step in $STEPS; do
  [[ " $known_steps" == *" $step "* ]] || { echo "unknown step '$step' in STEPS; the steps: $known_steps" >&2; exit 2; }
done
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
# lim N: N seconds, or what is left before DEADLINE if less (at least 5).
lim() { local left=$(( DEADLINE - ($(date +%s) - t0) )); [ "$left" -lt 5 ] && left=5; echo $(( $1 < left ? $1 : left )); }
# A run that failed or was cut says so (its output is filtered by the caller).
status() { [ "$1" -ne 0 ] && echo "  (exit $1$([ "$1" -eq 124 ] && echo ': cut by its time limit'))"; return 0; }

# The binaries: packed (gpu_prepare.sh), unpacked here; or lying in the folder.
B="$G"
if [ -f "$G/bin.tgz" ]; then
  B=/tmp/gpubin
  rm -rf "$B" && mkdir -p "$B" && tar xzf "$G/bin.tgz" -C "$B"
fi

stamp "machine"
cat "$G/BUILD_INFO" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc
# The CUDA libraries the binaries link (cuBLAS, the runtime): the toolkit's, else PyTorch's wheels.
libdirs=$(find /usr/local/cuda* /usr/lib /opt -name 'libcublas.so.*' -o -name 'libcudart.so.*' -o -name 'libcudnn.so.*' 2>/dev/null |
          xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
ldd "$B/edgetrain_cuda_tests" | grep -E 'cublas|cudart|cudnn|gomp|not found'

# The binaries name the data as <source dir>/../shared/data/cifar10 (tests) and the source dir's
# test files by absolute path: make both exist here (SRC: the checkout the binaries were built in).
src="${SRC:-/work/main}"
if [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
data="$src/../shared/data/cifar10"
if [ -f "$G/cifar.tgz" ] && [ ! -d "$data/train" ]; then mkdir -p "$data" && tar xzf "$G/cifar.tgz" -C "$data"; fi
stamp "data at $data: $(find "$data" -name '*.jpg' 2>/dev/null | wc -l) images"

step_tests() {
  # One process per test case, TESTS_PARALLEL at once on the one GPU: a case that faults (an
  # illegal address poisons the whole CUDA context, a crash ends the process) costs only itself.
  # The training cases (the slowest) start first. One line per case in cuda_tests.log, and the
  # reports of the failed ones after them; a case the time limit cut says so.
  stamp "CUDA tests, one process per case, ${TESTS_PARALLEL:-4} at once (EDGETRAIN_REQUIRE_GPU=1)"
  cases=/tmp/gpu_cases && rm -rf "$cases" && mkdir -p "$cases"
  "$B/edgetrain_cuda_tests" --list-test-names-only | grep -v '^$' | sed 's/[],[]/\\&/g' >"$cases/all.txt"
  { grep -E 'train|fit' "$cases/all.txt"; grep -vE 'train|fit' "$cases/all.txt"; } | nl -ba -w1 -s' ' >"$cases/order.txt"
  export B cases
  # The cases that train on the CPU beside the GPU share the cores (passive waits: ctest's setting).
  # shellcheck disable=SC2016
  OMP_NUM_THREADS=$(( $(nproc) / ${TESTS_PARALLEL:-4} > 0 ? $(nproc) / ${TESTS_PARALLEL:-4} : 1 )) OMP_WAIT_POLICY=PASSIVE \
  EDGETRAIN_REQUIRE_GPU=1 timeout "$(lim "${TESTS_S:-240}")" xargs -d '\n' -P "${TESTS_PARALLEL:-4}" -I{} sh -c \
    'n=${1%% *}; name=${1#* }; s=$(date +%s)
     if "$B/edgetrain_cuda_tests" -d yes "$name" >"$cases/$n.log" 2>&1; then r=passed; else r=FAILED; fi
     echo "$r ($(( $(date +%s) - s )) s, case $n): $name"' _ {} \
    <"$cases/order.txt" >"$cases/results.txt" 2>&1
  rc=$?
  {
    cat "$cases/results.txt"
    while read -r n name; do
      grep -q "(.*case $n): " "$cases/results.txt" || echo "CUT (no result within the time limit, case $n): $name"
    done <"$cases/order.txt"
    echo "$(grep -c '^passed' "$cases/results.txt") passed, $(grep -c '^FAILED' "$cases/results.txt") failed, $(grep -c . "$cases/order.txt") CUDA test cases (exit $rc)"
    for n in $(grep '^FAILED' "$cases/results.txt" | sed -E 's/.*case ([0-9]+)\).*/\1/'); do
      echo "=== case $n: $(grep -E " case $n\)" "$cases/results.txt")"
      cat "$cases/$n.log"
    done
  } >"$OUT/cuda_tests.log"
  grep -E '^(FAILED|CUT)|CUDA test cases' "$OUT/cuda_tests.log" | head -24
  # The failures' first lines, each with its message (which names the model, format, ...).
  for n in $(grep '^FAILED' "$cases/results.txt" | sed -E 's/.*case ([0-9]+)\).*/\1/' | head -6); do
    echo "--- case $n"
    grep -qE 'FAILED:' "$cases/$n.log" && grep -E 'FAILED:|with message|with expansion' -A2 "$cases/$n.log" | head -12 ||
      tail -6 "$cases/$n.log"  # a crash, a sticky CUDA error: how it ended
  done
  tests_summary=$(grep 'CUDA test cases' "$OUT/cuda_tests.log")
}

step_bench() {
  stamp "bench step on CUDA (batch 128); every format also with train.cuda_graph (bitmaps: the fixed layout)"
  for model in ${BENCH_MODELS:-resnet20 resnet18 vgg16_bn mobilenetv2}; do
    for run in ${BENCH_RUNS:-dense_fp32 dense_fp32+graph bitmap_fp32 bitmap_fp32+graph bitmap_fp16 bitmap_fp16+graph \
               dense_bf16 dense_bf16+graph auto auto+graph}; do
      stash=${run%+graph}
      graph=false; [ "$run" != "$stash" ] && graph=true
      timeout "$(lim 90)" "$B/edgetrain" bench step --config "configs/${model}_cifar10.json" --steps "${BENCH_STEPS:-20}" \
        --warmup 3 --set train.device=cuda --set fusion.enabled=false --set memory.stash=$stash \
        --set train.cuda_graph=$graph >/tmp/bench_run.log 2>&1
      rc=$?
      grep -E 'median step|cuda_graph:|error|Error' /tmp/bench_run.log | sed "s/^/$model $run: /"
      status $rc
    done
  done 2>&1 | tee "$OUT/bench.log"
  rm -rf /tmp/mp
  timeout "$(lim 60)" "$B/edgetrain" memprofile --config configs/resnet20_cifar10.json --synthetic --out /tmp/mp \
    --set train.device=cuda --set fusion.enabled=false --set memory.stash=bitmap_fp32 >"$OUT/memprofile.log" 2>&1
  status $?
  tail -3 "$OUT/memprofile.log"
}

step_memory() {
  # What the bitmap formats save on the device (the stash region as allocated, its room fitted)
  # against what they save on the CPU (its touched pages), activations included: issue 13's target
  # is the same ratios within 2 points.
  stamp "device memory of the bitmap stashes against the CPU's (bench/stash_device_memory.py)"
  PYTHONUNBUFFERED=1 timeout "$(lim "${MEMORY_S:-300}")" python3 bench/stash_device_memory.py --edgetrain "$B/edgetrain" \
    --models "${MEMORY_MODELS:-resnet20}" 2>&1 | tee "$OUT/memory.log"
}

step_budget() {
  # memory.budget_mb on CUDA (session 61): a budget of the device's memory, planned, then measured
  # by memprofile against what the model added to the driver's count.
  stamp "a memory budget of the device's memory (memprofile, ResNet-20, batch 128, ${BUDGET_MB:-200} MB)"
  rm -rf /tmp/mpb
  timeout "$(lim 120)" "$B/edgetrain" memprofile --config configs/resnet20_cifar10.json --synthetic --out /tmp/mpb \
    --set train.device=cuda --set fusion.enabled=false --set memory.budget_mb="${BUDGET_MB:-200}" >"$OUT/budget.log" 2>&1
  status $?
  grep -E 'memory budget|device memory|rror' "$OUT/budget.log"
}

step_fused() {
  # The CUDA fused stacks (BN -> ReLU [-> max-pool], BN -> add [-> ReLU]; docs/cuda-log.md, session 54): their tests
  # alone, then the step fused against unfused in one process (interleaved pairs), with and without
  # the CUDA graph, and a short training run with them.
  stamp "CUDA fused stacks: tests, bench step against the layers, a short training run"
  {
    # The whole report in its own file (a failure's "with message" names the model, stash and
    # checkpoint_every), its summary here.
    if has tests; then
      echo "(the [fusion] cases run with the tests step)"
    else
      EDGETRAIN_REQUIRE_GPU=1 timeout "$(lim 120)" "$B/edgetrain_cuda_tests" "[fusion]" >"$OUT/cuda_fused_tests.log" 2>&1
      grep -E '^(test cases|All tests)|FAILED|failed|with message' -A1 "$OUT/cuda_fused_tests.log" | head -40
    fi
    for model in ${FUSED_MODELS:-resnet20 vgg16_bn mobilenetv2}; do
      for graph in false true; do
        timeout "$(lim 120)" "$B/edgetrain" bench step --config "configs/${model}_cifar10.json" --steps "${BENCH_STEPS:-20}" \
          --warmup 3 --set train.device=cuda --set fusion.enabled=true --set train.cuda_graph=$graph \
          --against fusion.enabled=false >/tmp/fused_run.log 2>&1
        rc=$?
        grep -E 'median step|as fast|cuda_graph:|rror' /tmp/fused_run.log | sed "s/^/$model graph=$graph: /"
        status $rc
      done
    done
    rm -rf /tmp/run_fused
    timeout "$(lim "${TRAIN_S:-300}")" "$B/edgetrain" train --config configs/resnet20_cifar10_short.json --out /tmp/run_fused \
      --set train.epochs="${FUSED_EPOCHS:-$EPOCHS}" --set train.device=cuda --set fusion.enabled=true --set data.root="$data" 2>&1 |
      grep -E '^epoch [0-9]+/[0-9]+:|rror'
  } 2>&1 | tee "$OUT/fused.log"
}

step_luq() {
  # luq: scales on the device (session 57); luq_host_scales: read back as before; +graph: recorded;
  # luq_gather_across: the integer products' operands gathered across rows and columns everywhere,
  # as before session 66 (EDGETRAIN_CUDA_INT_GATHER; the default gathers along k where that coalesces).
  stamp "4-bit training (LUQ: INT4 forward, FP4 backward) on CUDA beside FP32 (batch 128): scales on the device or read back, op by op or recorded; 4-bit also with bitmap_int4"
  for model in ${LUQ_MODELS:-resnet20 resnet18 vgg16_bn}; do
    for run in fp32 fp32+graph luq luq_gather_across luq_host_scales luq+graph luq_bitmap_int4 luq_bitmap_int4+graph; do
      base=${run%+graph}
      graph=false; [ "$run" != "$base" ] && graph=true
      q=(--set memory.stash=dense_fp32)
      [ "$base" != fp32 ] && q+=(--set quant.forward=int4 --set quant.backward=luq_fp4)
      [ "$base" = luq_bitmap_int4 ] && q+=(--set memory.stash=bitmap_int4)
      host=0; [ "$base" = luq_host_scales ] && host=1
      gather=auto; [ "$base" = luq_gather_across ] && gather=across
      EDGETRAIN_CUDA_HOST_SCALES=$host EDGETRAIN_CUDA_INT_GATHER=$gather timeout "$(lim "${LUQ_S:-120}")" "$B/edgetrain" bench step \
        --config "configs/${model}_cifar10.json" --steps "${BENCH_STEPS:-20}" \
        --warmup 3 --set train.device=cuda --set fusion.enabled=false --set train.cuda_graph=$graph "${q[@]}" \
        >/tmp/luq_run.log 2>&1
      rc=$?
      grep -oE 'median step.*|train.cuda_graph: .*|"stash_peak_mb":[0-9.]+|[^ ]*rror.*' /tmp/luq_run.log | tr '\n' ' ' |
        sed "s/^/$model $run: /"
      echo
      status $rc
    done
    # Where a 4-bit step's time goes (each op timed after a device synchronise): the integer
    # products' gathers and the strided data gradients (session 58's phases) among them.
    echo "$model luq, per op:"
    EDGETRAIN_CUDA_HOST_SCALES=0 timeout "$(lim 60)" "$B/edgetrain" bench step --config "configs/${model}_cifar10.json" \
      --steps 5 --warmup 2 --profile --set train.device=cuda --set fusion.enabled=false \
      --set quant.forward=int4 --set quant.backward=luq_fp4 2>&1 | grep -vE '^\{|^[a-z0-9_.]+ +(fp32|bits|bitmap|-)' | head -20
  done 2>&1 | tee "$OUT/luq.log"
}

step_profile() {
  stamp "per-op profile on CUDA (each op timed after a device synchronise)"
  for model in resnet20 vgg16_bn; do
    timeout "$(lim 90)" "$B/edgetrain" bench step --config "configs/${model}_cifar10.json" --steps 10 --warmup 3 --profile \
      --set train.device=cuda --set fusion.enabled=false 2>&1 | grep -vE '^[a-z0-9_.]+ +(fp32|bits|bitmap|-)' | head -24
  done 2>&1 | tee "$OUT/profile.log"
}

step_badinput() {
  stamp "bad input on CUDA: a device that does not exist, a batch that does not fit"
  {
    rm -rf /tmp/bad7 /tmp/badoom
    timeout "$(lim 60)" "$B/edgetrain" train --config configs/resnet20_cifar10_short.json --set train.device=cuda:7 \
      --set data.root="$data" --out /tmp/bad7
    echo "exit $?; run folder left: $(ls -A /tmp/bad7 2>/dev/null | tr '\n' ' ')"
    timeout "$(lim 120)" "$B/edgetrain" train --config configs/resnet18_cifar10.json --set train.device=cuda \
      --set data.root="$data" --set train.batch_size=50000 --out /tmp/badoom 2>&1 | tail -3
    echo "exit ${PIPESTATUS[0]}; run folder left: $(ls -A /tmp/badoom 2>/dev/null | tr '\n' ' ')"
  } 2>&1 | tee "$OUT/badinput.log"
}

step_conv() {
  stamp "conv passes against cuBLAS SGEMM on the same GEMMs (bench_cuda_conv), each path"
  for mode in auto im2col; do
    echo "EDGETRAIN_CUDA_CONV=$mode"
    EDGETRAIN_CUDA_CONV=$mode timeout "$(lim 120)" "$B/bench_cuda_conv" --reps 10 --filter "${CONV_FILTER:-}"
    status $?
  done 2>&1 | tee "$OUT/conv.log" | grep -E '^(EDGETRAIN|total)|rror|usage|no CUDA|exit'
}

step_torch() {
  stamp "PyTorch's training step on the same GPU (bench/torch_step_cuda.py: FP32, TF32 off)"
  PYTHONUNBUFFERED=1 timeout "$(lim 180)" python3 bench/torch_step_cuda.py --models resnet20,resnet18,vgg16_bn >"$OUT/torch.log" 2>&1
  grep -v '^{' "$OUT/torch.log"
}

step_train() {
  # SEEDS: one run per train.seed (several, to tell a real accuracy gap from the spread of seeds).
  for seed in ${SEEDS:-1}; do
    stamp "train resnet20 (short recipe, $EPOCHS epochs, seed $seed) on CUDA"
    rm -rf /tmp/run_cuda
    timeout "$(lim "${TRAIN_S:-300}")" "$B/edgetrain" train --config configs/resnet20_cifar10_short.json --out /tmp/run_cuda \
      --set train.epochs="$EPOCHS" --set train.seed="$seed" --set train.device=cuda --set data.root="$data" \
      ${TRAIN_SETS:-} >"$OUT/train_seed$seed.log" 2>&1
    echo "exit $?" >>"$OUT/train_seed$seed.log"
    grep -E '^epoch [0-9]+/[0-9]+:|^exit|rror|cuda_graph' "$OUT/train_seed$seed.log"
    cp /tmp/run_cuda/metrics.jsonl "$OUT/train_seed${seed}_metrics.jsonl" 2>/dev/null
  done
}

step_suite() {
  stamp "the CPU suite, one process per test case (EDGETRAIN_REQUIRE_GPU=1)"
  # Catch2 reads ',' '[' ']' in a name as syntax: escape them.
  # The slowest cases (over 25 s on a 2-core host) start first, so the limit cuts none of them.
  slow='^(recomputed segments|fusion: synthetic stacks|a small ResNet|conv kernels match|exact stash formats|fusion: a BN -> ReLU stack.s output|gradcheck: conv2d|4-bit training: the budget|fusion: the shipped models|bitmap_int4 trains|fusion: a stack packs|fusion: BN statistics)'
  "$B/edgetrain_tests" --list-test-names-only | grep -v '^$' | sed 's/[],[]/\\&/g' >/tmp/all_cases.txt
  { grep -E "$slow" /tmp/all_cases.txt; grep -vE "$slow" /tmp/all_cases.txt; } >/tmp/cases.txt
  # Two threads a case (the CI host's count: the slow cases take there what they take in CI), as
  # many cases at once as pairs of cores. One thread a case left the slowest running for minutes
  # (session 34: 9 of 192 cases in 85 s).
  # Passive OpenMP waits, as ctest sets them (tests/CMakeLists.txt: spinning waits made the suite
  # 17x slower on a 2-vCPU host, session 55).
  export EDGETRAIN_REQUIRE_GPU=1 OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE
  # shellcheck disable=SC2016
  timeout "$(lim "${SUITE_S:-300}")" xargs -d '\n' -P "$(( $(nproc) / 2 ))" -I{} sh -c \
    '"$0" "$1" >/tmp/case.$$.log 2>&1 && echo "passed: $1" || { echo "FAILED: $1"; cat /tmp/case.$$.log; }' \
    "$B/edgetrain_tests" {} </tmp/cases.txt >"$OUT/suite.log" 2>&1
  echo "$(grep -c '^passed' "$OUT/suite.log") passed, $(grep -c '^FAILED' "$OUT/suite.log") failed of $(wc -l </tmp/cases.txt)" |
    tee -a "$OUT/suite.log"
  grep '^FAILED' "$OUT/suite.log" | head
}
# The steps, in the order STEPS names them (the first matter most: DEADLINE cuts the last).
step_times=""
for step in $STEPS; do
  s0=$(date +%s)
  "step_$step"
  step_times+="$step $(( $(date +%s) - s0 )) s, "
done
stamp "done (${step_times%, })"
# At most 8 files come back from $OUT: more than that go back as one archive.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/gpu_logs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_logs.tgz "$OUT/" &&
    echo "the logs: $OUT/gpu_logs.tgz (more than 8 files)"
fi
# The summaries again, last (a reader of the output's tail sees them even when steps were long).
[ -n "${tests_summary:-}" ] && echo "tests: $tests_summary"
has suite && [ -f "$OUT/suite.log" ] && echo "suite: $(tail -1 "$OUT/suite.log")"
exit 0
