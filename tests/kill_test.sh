#!/usr/bin/env bash
# Crash-safety: a real training run (resnet8, tiny epochs on a generated CIFAR-10 binary set) is
# killed with SIGKILL at random moments, KILL_TEST_KILLS times (default 60), and resumed
# with --resume after each kill; the finished run's metrics (timing fields aside) and its final
# checkpoint (weights, momentum, progress) must equal an uninterrupted run's, bit for bit.
# A quarter of the kills wait for the checkpoint's temporary file to appear and strike a random
# moment later, so many land inside a checkpoint write. Launches before the last kill carry
# --stop-after so that none can finish the run early. KILL_TEST_SEED fixes the moments.
# Usage: kill_test.sh path/to/edgetrain
set -u
BIN="$1"
T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
NEED="${KILL_TEST_KILLS:-60}"
EPOCHS=24
SEED="${KILL_TEST_SEED:-$$}"
RANDOM=$SEED
# Passive OpenMP waits: on a busy machine spinning threads slow the runs many times over (the
# results do not depend on it).
export OMP_WAIT_POLICY=passive
now_ms() { local t=${EPOCHREALTIME/[.,]/}; echo $((t / 1000)); }
die() { echo "FAIL $1"; exit 1; }

mkdir -p "$T/cifar"
perl -e 'srand(11); for my $f ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch") {
  open(my $o, ">", "'"$T"'/cifar/$f.bin"); binmode $o;
  for (1..32) { my $l = int(rand(10)); print $o chr($l), join("", map { chr(($l * 20 + int(rand(40))) % 256) } 1..3072); } }'
cat >"$T/cfg.json" <<JSON
{"model": {"name": "resnet8"},
 "data": {"format": "cifar10_binary", "root": "$T/cifar", "train_subset": 32, "test_subset": 16},
 "train": {"epochs": $EPOCHS, "batch_size": 16, "lr": 0.05, "threads": 2, "schedule": {"type": "cosine"}}}
JSON

# The uninterrupted run, and the time of its start-up (S) and of an epoch (P), from a 1-epoch run.
t0=$(now_ms)
"$BIN" train --config "$T/cfg.json" --stop-after 1 --out "$T/one" >"$T/one.log" 2>&1 || die "1-epoch run: $(tail -3 "$T/one.log")"
t1=$(now_ms)
"$BIN" train --config "$T/cfg.json" --out "$T/ref" >"$T/ref.log" 2>&1 || die "reference run: $(tail -3 "$T/ref.log")"
t2=$(now_ms)
P=$(((t2 - t1 - (t1 - t0)) / (EPOCHS - 1)))
[ $P -lt 1 ] && P=1
S=$((t1 - t0 - P))
[ $S -lt 1 ] && S=1
echo "seed $SEED; uninterrupted run: $((t2 - t1)) ms for $EPOCHS epochs (start-up ~$S ms, epoch ~$P ms)"

run="$T/run" tmp="$T/run/checkpoint_last.ckpt.tmp"
kills=0 in_write=0 in_other_write=0 launches=0 finished=0 missed=0
D=$((S + 2 * P))  # random kills strike within D ms of a launch
records() { (grep -c '"train_loss"' "$run/metrics.jsonl" 2>/dev/null) || true; }
while [ $finished -eq 0 ]; do
  # A folder that does not exist or is empty (killed before config.json.tmp) is started afresh.
  args=(--resume); { [ -d "$run" ] && [ -n "$(ls -A "$run")" ]; } || args=()
  done_epochs=$(records)
  done_epochs=${done_epochs:-0}
  # Until the last kill no launch may finish the run, nor rush through it (a launch the window
  # misses on a machine faster than measured): one stops (exit 0) after 2 epochs at most and one
  # epoch short of the end; once only the last epoch is left, every launch is killed in that
  # epoch's checkpoint write.
  last=0
  if [ $kills -lt "$NEED" ]; then
    left=$((EPOCHS - 1 - done_epochs))
    if [ $left -ge 1 ]; then args+=(--stop-after $((left < 2 ? left : 2))); else last=1; fi
  fi
  # A last-epoch launch whose checkpoint write the spinning shell misses (a loaded machine can
  # deschedule it for longer than the write takes) would finish the run short of NEED kills: it is
  # undone from a copy of the folder and launched again.
  [ $last -eq 1 ] && { rm -rf "$T/undo"; cp -a "$run" "$T/undo"; }
  touch "$T/marker"
  "$BIN" train --config "$T/cfg.json" --out "$run" "${args[@]}" >>"$T/run.log" 2>&1 &
  pid=$!
  launches=$((launches + 1))
  if [ $kills -ge "$NEED" ]; then
    :  # enough: this launch finishes the run
  elif [ $last -eq 1 ] || [ $((launches % 4)) -eq 0 ]; then
    # Wait for this launch's checkpoint write to start, then (but in the last epoch) spin a random
    # while before the kill.
    # (No process started in this loop: a fork per turn would miss the write.)
    deadline=$((${EPOCHREALTIME/[.,]/} + 1000 * (20 * (S + P) + 5000)))
    until [ "$tmp" -nt "$T/marker" ] || ! kill -0 $pid 2>/dev/null || [ ${EPOCHREALTIME/[.,]/} -gt $deadline ]; do :; done
    [ $last -eq 1 ] || for ((i = RANDOM % 400; i > 0; i--)); do :; done
    kill -KILL $pid 2>/dev/null
  else
    ms=$(((RANDOM * 32768 + RANDOM) % D))
    sleep "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
    kill -KILL $pid 2>/dev/null
  fi
  wait $pid 2>/dev/null; rc=$?
  if [ $rc -eq 137 ] && [ $last -eq 1 ] && [ "$run/checkpoint_last.ckpt" -nt "$T/marker" ]; then
    # The kill struck after the last epoch's checkpoint was renamed into place (the shell was
    # descheduled between seeing the write and the kill): the run is complete, so counting this
    # kill would leave no epoch to kill in. Undone like a missed launch.
    rm -rf "$run" && mv "$T/undo" "$run"
    missed=$((missed + 1))
  elif [ $rc -eq 137 ]; then
    kills=$((kills + 1))
    [ "$tmp" -nt "$T/marker" ] && in_write=$((in_write + 1))
    for f in "$run/config.json.tmp" "$run/metrics.jsonl.tmp"; do [ "$f" -nt "$T/marker" ] && in_other_write=$((in_other_write + 1)); done
  elif [ $rc -ne 0 ]; then
    die "launch $launches exited with $rc after $kills kills: $(tail -5 "$T/run.log")"
  elif [ $last -eq 1 ] && [ $kills -lt "$NEED" ]; then
    rm -rf "$run" && mv "$T/undo" "$run"
    missed=$((missed + 1))
  elif [ "$(records)" -eq $EPOCHS ]; then
    finished=1
  fi
  # Keep to NEED kills over the run's first EPOCHS - 4 epochs, whatever the machine's load: a
  # longer window while behind that pace, a shorter one while ahead.
  done_epochs=$(records)
  if [ $((${done_epochs:-0} * NEED)) -lt $((kills * (EPOCHS - 4))) ]; then D=$((D * 3 / 2)); else D=$((D * 2 / 3 + 1)); fi
  [ $launches -gt $((20 * NEED)) ] && die "no end after $launches launches ($kills kills): $(tail -3 "$T/run.log")"
done
echo "kills: $kills over $launches launches ($in_write inside a checkpoint write, $in_other_write inside a config.json / metrics.jsonl rewrite; $missed last-epoch launches missed and undone)"

strip() { sed -E 's/"(img_per_s|epoch_s|peak_uss_mb)":[^,}]*//g' "$1"; }
fails=0
[ $kills -ge "$NEED" ] || { echo "FAIL only $kills kills (want $NEED)"; fails=1; }
[ $in_write -ge 1 ] || { echo "FAIL no kill landed inside a checkpoint write"; fails=1; }
[ "$(grep -c '"train_loss"' "$run/metrics.jsonl")" -eq $EPOCHS ] && [ "$(strip "$T/ref/metrics.jsonl")" = "$(strip "$run/metrics.jsonl")" ] \
  && echo "ok   metrics equal the uninterrupted run's" || { echo "FAIL metrics differ:"; diff <(strip "$T/ref/metrics.jsonl") <(strip "$run/metrics.jsonl") | head -10; fails=1; }
cmp "$T/ref/checkpoint_last.ckpt" "$run/checkpoint_last.ckpt" && echo "ok   final checkpoint equals the uninterrupted run's, bit for bit" \
  || { echo "FAIL final checkpoints differ"; fails=1; }
[ $fails -eq 0 ]
