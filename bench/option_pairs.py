#!/usr/bin/env python3
"""One config key at two values, side by side: for each model, `edgetrain bench step --profile` with
KEY=A and KEY=B interleaved over several repetitions (machine drift hits both alike). Prints each
run, then per model and value the median step, its ratio to A's, and the median peak USS and arena.

    GOMP_SPINCOUNT=10000 python3 bench/option_pairs.py --key memory.recompute_stack_outputs \\
        --values false,true --models resnet20,resnet18,vgg16_bn,mobilenetv2 --reps 3 --steps 4

A key env:NAME sets the environment variable NAME instead (the A/B switches such as
ET_FORWARD_BY_READERS=0|1 and ET_CONV_PATH).
"""
import argparse
import os
import statistics

from bench_step import ROOT, run_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "edgetrain"))
    ap.add_argument("--key", required=True, help="a config key, as --set takes it")
    ap.add_argument("--values", required=True, help="A,B")
    ap.add_argument("--models", default="resnet20")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    values = a.values.split(",")
    if len(values) != 2:
        ap.error("--values takes two values, A,B")
    for model in a.models.split(","):
        runs = {v: [] for v in values}
        for rep in range(a.reps):
            for v in values:
                if a.key.startswith("env:"):
                    r = run_step(a.binary, model, a.batch, a.threads, a.steps, a.warmup, [], {a.key[4:]: v})
                else:
                    r = run_step(a.binary, model, a.batch, a.threads, a.steps, a.warmup, [f"{a.key}={v}"])
                runs[v].append(r)
                print(f"{model} {a.key}={v} rep {rep + 1}: step {r['step_ms_median']:.1f} ms, "
                      f"peak USS {r['peak_uss_mb']:.1f} MB", flush=True)
        base = statistics.median(r["step_ms_median"] for r in runs[values[0]])
        for v in values:
            step = statistics.median(r["step_ms_median"] for r in runs[v])
            uss = statistics.median(r["peak_uss_mb"] for r in runs[v])
            print(f"{model} batch {a.batch} {a.key}={v}: median step {step:.1f} ms ({step / base:.3f}x of "
                  f"{values[0]}), peak USS {uss:.1f} MB, arena {runs[v][0]['arena_mb']:.1f} MB over {a.reps} reps")


if __name__ == "__main__":
    main()
