#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh runs on a lent GPU machine and puts it in gpu/ (carry that folder).
# Portable x86 code, device code for sm_90 (H100 / H200), cuDNN where installed.
#
# A source edited while ninja compiles it leaves an object newer than the edit, built from the old
# text, and ninja then calls it up to date: session 34's first GPU run tested such a stale
# trainer.cpp.o. So every source changed after the build started is touched and built again, until
# none was; gpu/BUILD_INFO records the commit and whether the tree had uncommitted changes.
# The binaries go stripped into one gpu/bin.tgz (about 20 MB; unpacked they are about 56 MB, and
# the device tool carries at most 64 MiB with the tree and cifar.tgz); gpu_check.sh unpacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
B="${BUILD_DIR:-build-cuda}"
# Configured every time: a build folder configured otherwise (native code, other architectures)
# would run here and fault there.
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEDGETRAIN_CUDA=ON -DEDGETRAIN_ONNX=OFF \
  -DEDGETRAIN_PORTABLE=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
targets="edgetrain tests/edgetrain_tests tests/edgetrain_cuda_tests bench_cuda_conv"
sources() { find apps backends bench engine fusion layers memory models quant tests -type f \
              \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) "$@"; }
for attempt in 1 2 3; do
  stamp=$(mktemp)
  ninja -C "$B" $targets
  changed=$(sources -newer "$stamp")
  rm -f "$stamp"
  [ -z "$changed" ] && break
  echo "edited during the build, building again: $changed"
  touch $changed
done
if [ -n "$changed" ]; then echo "sources still changing during the build: not packing stale binaries" >&2; exit 1; fi
mkdir -p gpu
rm -f gpu/edgetrain gpu/edgetrain_tests gpu/edgetrain_cuda_tests gpu/bench_cuda_conv  # (the old unpacked form)
stage=$(mktemp -d)
for t in $targets; do cp "$B/$t" "$stage/"; done
strip "$stage"/*
tar czf gpu/bin.tgz -C "$stage" .
rm -rf "$stage"
if [ ! -f gpu/cifar.tgz ]; then (cd ../shared/data/cifar10 && tar czf - train test) >gpu/cifar.tgz; fi
{
  echo "commit $(git rev-parse HEAD)"
  echo "uncommitted changes: $(git status --porcelain --untracked-files=no | wc -l) files"
  date -u +"built %Y-%m-%dT%H:%M:%SZ"
  echo "build: $B, portable, sm_90"
} >gpu/BUILD_INFO
cat gpu/BUILD_INFO
du -sh gpu
