#!/usr/bin/env bash
# The CUDA kernels' memory traffic in one training step, counted on the CUDA emulator
# (tests/cuda_emu/emu_traffic.cpp) and summed by scripts/cuda_traffic.py: per kernel the distinct
# bytes it moves, how well its warps' accesses coalesce, shared-memory bank conflicts. No GPU
# needed; a model of the memory system, not a measurement (docs/cuda.md, "Memory traffic").
#   scripts/cuda_traffic.sh CONFIG [--set key=value ...]   e.g.
#   scripts/cuda_traffic.sh configs/resnet20_cifar10_short.json --set memory.stash=bitmap_fp16
# Env: BUILD_DIR (default build-emu-races: the race checker's build, whose instrumentation this
# counts with; built when missing), BATCH (default 32: the grid's blocks scale with it, the
# layouts do not), OUT (the counts file, default a temporary one), BANDWIDTH (GB/s, default 4800),
# EDGETRAIN_CUDA_CONV (default im2col: the backend's own conv kernels; cuDNN's are not counted).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/cuda_traffic.sh CONFIG [--set key=value ...]" >&2; exit 2; }
dir="${BUILD_DIR:-build-emu-races}"
if [ ! -x "$dir/edgetrain" ]; then
  BUILD_DIR="$dir" RACES=1 scripts/cuda_emu.sh --build-only
  cmake --build "$dir" -j "$(nproc)" --target edgetrain
fi
out="${OUT:-$(mktemp)}"
[ -n "${OUT:-}" ] || trap 'rm -f "$out"' EXIT
: >"$out"
config="$1"
shift
EDGETRAIN_CUDA_CONV="${EDGETRAIN_CUDA_CONV:-im2col}" EDGETRAIN_CUDA_EMU_TRAFFIC="$out" \
  "$dir/edgetrain" bench step --config "$config" --set train.device=cuda --set train.batch_size="${BATCH:-32}" \
  --steps 1 --warmup 0 "$@" >/dev/null
python3 scripts/cuda_traffic.py "$out" --bandwidth "${BANDWIDTH:-4800}"
