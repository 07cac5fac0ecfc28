#!/usr/bin/env python3
"""memory.budget_mb: measured step USS and step time of budgets between the smallest exact plan and
the fastest one, against the fastest (no budget), side by side.

Each round runs `edgetrain bench step` once per budget (and once without), in an interleaved order;
the table gives per budget the median over rounds of the step time, its ratio to the no-budget
run of the same round, the measured step USS and the planner's prediction. The smallest exact plan
is read from the error of a budget no plan meets.

  bench/budget_table.py [--config configs/resnet20_cifar10.json] [--budgets 110,140,175] [--reps 3]
"""
import argparse
import json
import re
import statistics
import subprocess
import sys


def bench(binary, config, budget, steps, sets):
    cmd = [binary, "bench", "step", "--config", config, "--steps", str(steps), "--warmup", "2"]
    for s in sets:
        cmd += ["--set", s]
    if budget is not None:
        cmd += ["--set", f"memory.budget_mb={budget}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def smallest(binary, config, lossy, sets):
    cmd = [binary, "bench", "step", "--config", config, "--steps", "1", "--warmup", "0",
           "--set", "memory.budget_mb=1", "--set", f"memory.budget_lossy={'true' if lossy else 'false'}"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = re.search(r"predicted at ([0-9.]+) MB", out.stderr)
    return float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/edgetrain")
    ap.add_argument("--config", default="configs/resnet20_cifar10.json")
    ap.add_argument("--budgets", default="110,140,175")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    a = ap.parse_args()
    budgets = [float(b) for b in a.budgets.split(",")]
    print(f"smallest exact plan (predicted): {smallest(a.bin, a.config, False, a.set)} MB; "
          f"with fp16 formats: {smallest(a.bin, a.config, True, a.set)} MB")
    runs = {b: [] for b in [None] + budgets}
    for r in range(a.reps):
        order = [None] + budgets if r % 2 == 0 else budgets[::-1] + [None]
        for b in order:
            runs[b].append(bench(a.bin, a.config, b, a.steps, a.set))
    base = runs[None]
    print(f"{'budget MB':>10} {'predicted MB':>13} {'step USS MB':>12} {'met':>4} {'step ms':>8} {'vs none':>8} "
          f"{'predicted extra ms':>19} {'segments':>9}")
    for b in [None] + budgets:
        rs = runs[b]
        ms = statistics.median(r["step_ms_median"] for r in rs)
        ratio = statistics.median(r["step_ms_median"] / o["step_ms_median"] for r, o in zip(rs, base))
        uss = max(r["step_uss_mb"] for r in rs)
        pred = rs[0].get("budget_predicted_mb")
        met = "-" if b is None else ("yes" if uss <= b else "NO")
        pred_s = f"{pred:.1f}" if pred is not None else "-"
        segs = str(rs[0].get("budget_segments", 0))
        if rs[0].get("budget_code_segments", 0):  # 4-bit training: BN inputs recomputed from INT4 codes
            segs = f"{rs[0]['budget_code_segments']} codes"
        print(f"{'none' if b is None else b:>10} {pred_s:>13} {uss:12.1f} {met:>4} {ms:8.1f} "
              f"{ratio:8.3f} {rs[0].get('budget_extra_ms', 0):19.1f} {segs:>9}")


if __name__ == "__main__":
    main()
