#!/bin/sh
# ctest cuda_emu_traffic: the traffic count (emu_traffic.cpp) of `emu_selftest traffic`'s three
# kernels, line by line (kernel, kind, instructions, lanes, bytes, sectors or wavefronts taken, the
# fewest they need), then scripts/cuda_traffic.py's report of them.
#   traffic_check.sh EMU_SELFTEST CUDA_TRAFFIC_PY
set -eu
f=$(mktemp)
trap 'rm -f "$f"' EXIT
EDGETRAIN_CUDA_EMU_TRAFFIC="$f" "$1" traffic
tab=$(printf '\t')
expect() {  # a line of the count, its place left out; how many such lines
  n=$(grep -c "^P${tab}$1${tab}" "$f" || true)
  [ "$n" -eq "$2" ] || { echo "traffic_check: $n lines '$1', expected $2"; cat "$f"; exit 1; }
}
# Two warps of 32 lanes, 4 bytes each: 4 sectors a warp coalesced, 32 at a stride of 32 bytes.
expect "traffic_coalesced${tab}load${tab}2${tab}64${tab}256${tab}8${tab}8" 1
expect "traffic_coalesced${tab}store${tab}2${tab}64${tab}256${tab}8${tab}8" 1
expect "traffic_strided${tab}load${tab}2${tab}64${tab}256${tab}64${tab}8" 1
# One warp: a column of the 32 x 32 array in one bank (32 wavefronts), of the 32 x 33 in all 32.
for kind in shared_store shared_load; do
  expect "traffic_banks${tab}${kind}${tab}1${tab}32${tab}128${tab}32${tab}1" 1
  expect "traffic_banks${tab}${kind}${tab}1${tab}32${tab}128${tab}1${tab}1" 1
done
expect "traffic_banks${tab}store${tab}1${tab}32${tab}128${tab}4${tab}4" 1
grep -q "^K${tab}traffic_strided${tab}1${tab}1${tab}1${tab}64${tab}2048${tab}256$" "$f" ||
  { echo "traffic_check: traffic_strided's distinct bytes"; cat "$f"; exit 1; }
python3 "$2" "$f"
