#!/usr/bin/env bash
# `edgetrain export --format onnx` end to end: small models trained one step on a generated
# CIFAR-10 binary data set (so BN statistics are not the initial ones) are exported, and an
# independent runtime, OpenCV's DNN module (Debian's python3-opencv, via bench/onnx_check.py), runs
# the files on the 64 test images; its logits must equal `edgetrain eval --predictions`' within
# 1e-4 of the logit scale (max(1, max |logit|)), and no prediction may flip that is not a near tie.
# Covered: option-B and option-A ResNets (Slice + Pad), VGG with biases and max-pooling, VGG-BN
# and MobileNetV2 (depthwise: Conv groups) with dropout, folded BN and BatchNormalization nodes, a
# run trained with fusion, an FNT checkpoint (INT4 weights: exact), a weights file through
# --config / --set model.weights. Then bad input: a clear message naming the file, a non-zero exit
# and nothing written. Usage: onnx_test.sh path/to/edgetrain
# Exit 77 (ctest: skipped) when the binary was built without ONNX support, or python3-opencv is
# missing (the export checks still run; only the runtime comparison is skipped).
set -u
BIN="$1"
CHECK="$(cd "$(dirname "$0")/.." && pwd)/bench/onnx_check.py"
PY="${PYTHON:-/usr/bin/python3}"
. "$(dirname "$0")/test_lib.sh"
make_cifar "$T/cifar" random
cat >"$T/cfg.json" <<JSON
{"model": {"name": "resnet8"},
 "data": {"format": "cifar10_binary", "root": "$T/cifar"},
 "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "threads": 2}}
JSON
ONE=(--set data.train_subset=32)  # one training step

# --- a build without ONNX support says so and writes nothing
"$BIN" train --config "$T/cfg.json" "${ONE[@]}" --out "$T/r8" >/dev/null 2>&1 || fail "train resnet8"
out="$("$BIN" export --checkpoint "$T/r8/checkpoint_last.ckpt" --out "$T/probe.onnx" 2>&1)"
if grep -q "built without ONNX support" <<<"$out"; then
  [ ! -e "$T/probe.onnx" ] && [ ! -e "$T/probe.onnx.tmp" ] && pass "no ONNX support: clear error, nothing written" \
    || fail "no ONNX support: a file was written"
  echo "skip: this edgetrain was built without ONNX support (install libonnx-dev libprotobuf-dev: scripts/setup.sh)"
  [ $fails -eq 0 ] && exit 77 || exit 1
fi
grep -q "ONNX opset 13" <<<"$out" && grep -q "checked by onnx::checker" <<<"$out" \
  && pass "export by extension (.onnx), checked" || fail "export resnet8: $out"

have_cv=1
if ! "$PY" -c "import cv2, numpy" 2>/dev/null; then
  have_cv=0
  echo "skip runtime comparisons: OpenCV's Python module is missing ($PY -c 'import cv2' fails; apt-get install python3-opencv)"
fi
# compare NAME ONNX CSV: the runtime's logits against edgetrain eval's
compare() {
  [ $have_cv -eq 1 ] || return 0
  local res
  res="$("$PY" "$CHECK" compare "$2" "$3" --cifar "$T/cifar" --batch 16 2>&1)" && pass "$1: $(head -1 <<<"$res" | sed 's/.*: max/max/')" \
    || fail "$1: $res"
}
# model NAME ARGS...: train one step, export (folded BN), eval with predictions, compare
model() {
  local name="$1"; shift
  local d="$T/$name"
  if ! "$BIN" train --config "$T/cfg.json" "${ONE[@]}" "$@" --out "$d" >"$d.log" 2>&1; then fail "train $name: $(tail -2 "$d.log")"; return; fi
  "$BIN" export --checkpoint "$d/checkpoint_last.ckpt" --format onnx --out "$d.onnx" >"$d.export.log" 2>&1 \
    || { fail "export $name: $(cat "$d.export.log")"; return; }
  "$BIN" eval --config "$d/config.json" --checkpoint "$d/checkpoint_last.ckpt" --predictions "$d.csv" >/dev/null 2>&1 \
    || { fail "eval $name"; return; }
  compare "$name" "$d.onnx" "$d.csv"
}

model resnet8_B
model resnet8_A --set model.shortcut=A
model vgg11 --set model.name=vgg11
model vgg11_bn --set model.name=vgg11_bn --set model.dropout=0.5
model mobilenetv2 --set model.name=mobilenetv2 --set model.dropout=0.2
model resnet8_fused --set fusion.enabled=true
"$BIN" export --checkpoint "$T/resnet8_B/checkpoint_last.ckpt" --keep-bn --out "$T/r8_keep.onnx" >/dev/null \
  && compare "resnet8, BatchNormalization nodes (--keep-bn)" "$T/r8_keep.onnx" "$T/resnet8_B.csv" || fail "export --keep-bn"
"$BIN" export --checkpoint "$T/mobilenetv2/checkpoint_last.ckpt" --keep-bn --out "$T/mnv2_keep.onnx" >/dev/null \
  && compare "mobilenetv2, BatchNormalization nodes (--keep-bn)" "$T/mnv2_keep.onnx" "$T/mobilenetv2.csv" || fail "export mobilenetv2 --keep-bn"
grep -q "0 BatchNorms folded" "$T/vgg11.export.log" && grep -q "57 BatchNorms folded" "$T/mobilenetv2.export.log" \
  && pass "BN folding counts" || fail "BN folding counts: $(cat "$T/vgg11.export.log" "$T/mobilenetv2.export.log")"

# A weights file (model.weights) through --config / --set: the same network as the checkpoint's
"$BIN" export --checkpoint "$T/resnet8_B/checkpoint_last.ckpt" --out "$T/r8.safetensors" >/dev/null || fail "export safetensors"
"$BIN" export --config "$T/resnet8_B/config.json" --set model.weights="$T/r8.safetensors" --out "$T/r8_w.onnx" >/dev/null \
  && compare "weights file via --set model.weights" "$T/r8_w.onnx" "$T/resnet8_B.csv" || fail "export of model.weights"

# 4-bit: an FNT checkpoint (INT4 weights, FP32 activations) exports exactly what eval runs; an INT4
# forward exports its float weights and says the logits differ
Q=(--set quant.forward=int4 --set quant.backward=luq_fp4 --set train.epochs=2)
model resnet8_fnt "${Q[@]}" --set quant.fnt_epochs=1
grep -q "INT4 weights (FNT, dequantised)" "$T/resnet8_fnt.export.log" && pass "FNT export says so" || fail "FNT export: $(cat "$T/resnet8_fnt.export.log")"
"$BIN" train --config "$T/cfg.json" "${ONE[@]}" "${Q[@]}" --out "$T/q" >/dev/null 2>&1
"$BIN" export --checkpoint "$T/q/checkpoint_last.ckpt" --out "$T/q.onnx" 2>&1 | grep -q "the ONNX graph runs them in FP32" \
  && pass "INT4-forward export: float weights, and it says so" || fail "INT4-forward export note"

# --- bad input: a clear message naming the file, non-zero exit, nothing written
CK="$T/resnet8_B/checkpoint_last.ckpt"
touch "$T/afile"
expect_error "unwritable --out" "$T/afile/m.onnx" "$BIN" export --checkpoint "$CK" --out "$T/afile/m.onnx"
sum="$(md5sum <"$T/r8_keep.onnx")"
expect_error "--out exists" "exists" "$BIN" export --checkpoint "$CK" --out "$T/r8_keep.onnx"
[ "$sum" = "$(md5sum <"$T/r8_keep.onnx")" ] && pass "existing file untouched" || fail "existing file modified"
mkdir -p "$T/corrupt" && cp "$T/resnet8_B/config.json" "$T/corrupt/" && head -c 5000 "$CK" >"$T/corrupt/checkpoint_last.ckpt"
expect_error "corrupt checkpoint" "checkpoint '$T/corrupt/checkpoint_last.ckpt' is not valid" \
  "$BIN" export --checkpoint "$T/corrupt/checkpoint_last.ckpt" --out "$T/x1.onnx"
cp "$CK" "$T/lonely.ckpt"
expect_error "no config.json beside the checkpoint" "no config.json beside checkpoint '$T/lonely.ckpt'" \
  "$BIN" export --checkpoint "$T/lonely.ckpt" --out "$T/x2.onnx"
expect_error "checkpoint of another model" "is for model 'resnet8'" \
  "$BIN" export --checkpoint "$CK" --set model.name=resnet20 --out "$T/x3.onnx"
expect_error "double-mask BN" "double_mask_bn" "$BIN" export --checkpoint "$CK" --set memory.double_mask_bn=true --out "$T/x4.onnx"
expect_error "--keep-bn with safetensors" "for --format onnx" "$BIN" export --checkpoint "$CK" --keep-bn --out "$T/x5.safetensors"
expect_error "no weights" "--checkpoint FILE" "$BIN" export --config "$T/cfg.json" --out "$T/x6.onnx"
# A file-size limit (ulimit -f, 1 KiB blocks) below VGG-11's 35 MB: the write fails naming the file
expect_error "file-size limit during the write" "cannot write '$T/x7.onnx': File too large" \
  bash -c 'ulimit -f 1000; exec "$@"' _ "$BIN" export --checkpoint "$T/vgg11/checkpoint_last.ckpt" --out "$T/x7.onnx"
left="$(ls "$T" | grep -E '^x[0-9]')"
[ -z "$left" ] && pass "failed exports left nothing" || fail "failed exports left: $left"

echo "$fails failure(s)"
[ $fails -eq 0 ] || exit 1
[ $have_cv -eq 1 ] || exit 77
exit 0
