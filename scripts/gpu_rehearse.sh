#!/usr/bin/env bash
# scripts/gpu_check.sh rehearsed on the CUDA emulator, without a GPU: the same script, its steps
# and the parsing of their output, run on the emulator's binaries (build-emu) at a small batch, so
# a fault in the script or in a command it runs shows here and not in a GPU run's few minutes of
# device time. The figures it prints are the emulator's: they say the run works end to end,
# nothing about a GPU's speed or memory.
#   scripts/gpu_rehearse.sh                 the steps of docs/cuda.md's two runs ("How it is checked")
#   STEPS="luq badinput" scripts/gpu_rehearse.sh
# Env: BATCH (default 8: every bench, memprofile and train command's batch; train also on 4 x
# BATCH images of each split), gpu_check.sh's own (STEPS, DEADLINE, BENCH_MODELS, ...), OUT
# (default /tmp/gpu_rehearsal). Builds build-emu's edgetrain, tests and bench_cuda_conv first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/cuda_emu.sh --build-only >/dev/null
cmake --build build-emu -j "$(nproc)" --target edgetrain bench_cuda_conv >/dev/null
batch="${BATCH:-8}"
G=$(mktemp -d)
trap 'rm -rf "$G"' EXIT
ln -s "$PWD/build-emu/tests/edgetrain_cuda_tests" "$G/edgetrain_cuda_tests"
# The commands gpu_check.sh runs, at the small batch: a later --set (--batch, --reps) wins. The
# bad-input step's batch of 50000 stays (its point is that it does not fit).
cat >"$G/edgetrain" <<EOF
#!/usr/bin/env bash
extra=()
case "\$1" in
  bench | memprofile) extra=(--set train.batch_size=$batch) ;;
  train) [[ " \$* " == *batch_size=50000* ]] ||
           extra=(--set train.batch_size=$batch --set data.train_subset=$((4 * batch)) --set data.test_subset=$((4 * batch))) ;;
esac
exec "$PWD/build-emu/edgetrain" "\$@" "\${extra[@]}"
EOF
cat >"$G/bench_cuda_conv" <<EOF
#!/usr/bin/env bash
exec "$PWD/build-emu/bench_cuda_conv" "\$@" --batch 2 --reps 1
EOF
chmod +x "$G/edgetrain" "$G/bench_cuda_conv"
# Run 1 and run 2 of docs/cuda.md, one model each, a few steps.
export STEPS="${STEPS:-tests train bench conv fused luq budget memory badinput}"
export TESTS_S="${TESTS_S:-60}" EPOCHS="${EPOCHS:-1}" FUSED_EPOCHS="${FUSED_EPOCHS:-1}" DEADLINE="${DEADLINE:-3000}"
export BENCH_MODELS="${BENCH_MODELS:-resnet20}" FUSED_MODELS="${FUSED_MODELS:-resnet20}" LUQ_MODELS="${LUQ_MODELS:-resnet20}"
export BENCH_STEPS="${BENCH_STEPS:-1}" BENCH_RUNS="${BENCH_RUNS:-dense_fp32 bitmap_fp32+graph}"
export CONV_FILTER="${CONV_FILTER:-resnet20}" BUDGET_MB="${BUDGET_MB:-60}"
export OUT="${OUT:-/tmp/gpu_rehearsal}" EDGETRAIN_CUDA_CONV="${EDGETRAIN_CUDA_CONV:-im2col}"
rm -rf "$OUT"
bash scripts/gpu_check.sh "$G"
