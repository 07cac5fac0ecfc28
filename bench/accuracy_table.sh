#!/usr/bin/env bash
# The 4-bit accuracy table of docs/quant.md on CIFAR-10 (JPEG copy), ResNet-20, the short recipe
# (configs/resnet20_cifar10_short.json, 30 epochs, seed 1): FP32, LUQ, LUQ + SMP 2 over 30 epochs;
# LUQ + SMP 2 + FNT as the paper runs it, one FNT epoch added after those 30 (train.epochs = 31,
# quant.fnt_epochs = 1: the main schedule still spans 30 epochs); FP32, INT4 forward only and
# fp4_rdn over 10. Runs one after the other in runs/accuracy/<name>; re-running the script resumes
# a partial run from its last checkpoint and skips finished ones, so the table can be built over
# several sittings (`--stop-after N` per invocation via STOP_AFTER=N). Prints the table of what has finished.
#
#   bench/accuracy_table.sh            # or: nice -n 19 bench/accuracy_table.sh; STOP_AFTER=5 ...
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/edgetrain}
OUT=${OUT:-runs/accuracy}
ONLY=${ONLY:-}
mkdir -p "$OUT"

run() {
  local name=$1 config=$2
  shift 2
  local dir="$OUT/$name"
  [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]] && return 0
  [ -f "$dir/finished" ] && return 0
  local extra=()
  [ -n "${STOP_AFTER:-}" ] && extra=(--stop-after "$STOP_AFTER")
  local resume=()
  [ -f "$dir/config.json" ] && resume=(--resume)
  echo "== $name: $BIN train --config $config $* ${resume[*]} ${extra[*]}"
  "$BIN" train --config "$config" --out "$dir" "$@" "${resume[@]}" "${extra[@]}"
  local want
  want=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['train']['epochs'])" "$dir/config.json")
  local have
  have=$(grep -c '"train_loss"' "$dir/metrics.jsonl")  # epoch records, not divergence events
  [ "$have" -ge "$want" ] && touch "$dir/finished"
  return 0
}

SHORT=configs/resnet20_cifar10_short.json
LUQ=(--set quant.forward=int4 --set quant.backward=luq_fp4)
run fp32_30 $SHORT
run luq_30 $SHORT "${LUQ[@]}"
run luq_smp2_30 $SHORT "${LUQ[@]}" --set quant.smp_samples=2
run fp32_10 $SHORT --set train.epochs=10
run int4fwd_10 $SHORT --set quant.forward=int4 --set train.epochs=10
run fp4rdn_10 $SHORT --set quant.forward=int4 --set quant.backward=fp4_rdn --set train.epochs=10
# LUQ + SMP 2 + FNT: its first 30 epochs are luq_smp2_30's bit for bit (tests/cli_test.sh, "an FNT
# epoch added after the schedule"), so a finished luq_smp2_30 seeds it (a copy whose config.json
# says 31 epochs with the FNT epoch) and only the FNT epoch runs; without one, all 31 run. The
# peak is given (it is also the default, 0.01 x train.lr) so that older binaries run the same.
FNT_EPOCHS=31 FNT_PEAK=0.001
seed_from() {
  local src="$OUT/$1" dst="$OUT/$2"
  [ -n "$ONLY" ] && [[ ",$ONLY," != *",$2,"* ]] && return 0
  { [ -e "$dst" ] || [ ! -f "$src/finished" ]; } && return 0
  rm -rf "$dst.tmp"
  cp -r "$src" "$dst.tmp"
  rm -f "$dst.tmp/finished"
  python3 -c 'import json, struct, sys
c = json.load(open(sys.argv[1]))
c["train"]["epochs"] = int(sys.argv[2])
c["quant"]["fnt_epochs"] = 1
c["quant"]["fnt_peak_lr"] = struct.unpack("f", struct.pack("f", float(sys.argv[3])))[0]  # as the binary stores it
json.dump(c, open(sys.argv[1], "w"), indent=2)' "$dst.tmp/config.json" "$FNT_EPOCHS" "$FNT_PEAK"
  mv "$dst.tmp" "$dst"
  echo "== $2: seeded from $1 (its 30 epochs); the FNT epoch follows"
}
seed_from luq_smp2_30 luq_smp2_fnt1_31
run luq_smp2_fnt1_31 $SHORT "${LUQ[@]}" --set quant.smp_samples=2 --set train.epochs=$FNT_EPOCHS --set quant.fnt_epochs=1 \
  --set quant.fnt_peak_lr=$FNT_PEAK

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':18} {'epochs':>6} {'final test acc':>15} {'best':>7}")
for name in ["fp32_30", "luq_30", "luq_smp2_30", "luq_smp2_fnt1_31", "fp32_10", "int4fwd_10", "fp4rdn_10"]:
    p = os.path.join(out, name, "metrics.jsonl")
    if not os.path.exists(p):
        continue
    rows = [r for r in (json.loads(l) for l in open(p) if l.strip()) if "test_acc" in r]  # no events
    if not rows:
        continue
    done = os.path.exists(os.path.join(out, name, "finished"))
    print(f"{name:18} {rows[-1]['epoch']:>6} {100 * rows[-1]['test_acc']:14.2f}% {100 * max(r['test_acc'] for r in rows):6.2f}%"
          + ("" if done else "  (running)"))
PY
