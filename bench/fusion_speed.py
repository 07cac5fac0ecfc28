#!/usr/bin/env python3
"""Fused against unfused training steps (docs/fusion.md): for each model, `edgetrain bench step
--profile` with fusion.enabled false and true, interleaved over several repetitions (machine drift
hits both alike). Prints per model the median step, images/s, the speed-up, the time of the
memory-bound layers (BN, ReLU, add, pooling; fused: the fused stacks plus what stays unfused) and
the peak USS of the step.

    GOMP_SPINCOUNT=10000 python3 bench/fusion_speed.py --models resnet20,vgg16_bn --reps 5
"""
import argparse
import json
import os
import statistics

from bench_step import ROOT, run_step

MEMORY_BOUND = {"batchnorm2d", "relu", "add", "maxpool2d", "avgpool2d", "global_avgpool", "fused_stack"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "edgetrain"))
    ap.add_argument("--models", default="resnet20,vgg16_bn")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="extra config override for both runs")
    a = ap.parse_args()
    rows = []
    for model in a.models.split(","):
        res = {False: [], True: []}
        for _ in range(a.reps):
            for fused in (False, True):
                res[fused].append(run_step(a.binary, model, a.batch, a.threads, a.steps, a.warmup,
                                          a.set + [f"fusion.enabled={str(fused).lower()}"]))
        med = lambda fused, f: statistics.median(f(r) for r in res[fused])
        step = {f: med(f, lambda r: r["step_ms_median"]) for f in (False, True)}
        mb = {f: med(f, lambda r: sum(v for k, v in r["op_ms"].items() if k in MEMORY_BOUND)) for f in (False, True)}
        uss = {f: med(f, lambda r: r["peak_uss_mb"]) for f in (False, True)}
        row = {"model": model, "batch": a.batch, "unfused_ms": step[False], "fused_ms": step[True],
               "speedup": step[False] / step[True], "img_per_s_unfused": a.batch * 1e3 / step[False],
               "img_per_s_fused": a.batch * 1e3 / step[True], "memory_bound_ms_unfused": mb[False],
               "memory_bound_ms_fused": mb[True], "memory_bound_cut": 1 - mb[True] / mb[False],
               "peak_uss_mb_unfused": uss[False], "peak_uss_mb_fused": uss[True], "reps": a.reps}
        rows.append(row)
        print(f"{model} batch {a.batch}: step {step[False]:.1f} -> {step[True]:.1f} ms ({row['speedup']:.3f}x), "
              f"BN/ReLU/add/pool {mb[False]:.1f} -> {mb[True]:.1f} ms ({-100 * row['memory_bound_cut']:+.0f}%), "
              f"peak USS {uss[False]:.1f} -> {uss[True]:.1f} MB", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
