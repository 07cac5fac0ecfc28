#!/usr/bin/env python3
"""4-bit training speed against edgetrain's own FP32 step: for each model, runs `edgetrain bench
step --profile` for every quantization variant, interleaved over several repetitions (so machine
drift hits every variant alike), and prints the median step time, images/s, the speed-up over the
FP32 step of the same run and the share of the step spent quantizing.

    python3 bench/quant_speed.py --models resnet20,vgg16_bn --batch 128 --reps 5
"""
import argparse
import os
import statistics

from bench_step import ROOT, run_step

VARIANTS = {
    "fp32": [],
    "int4_fwd": ["quant.forward=int4"],
    "luq": ["quant.forward=int4", "quant.backward=luq_fp4"],
    "luq_smp2": ["quant.forward=int4", "quant.backward=luq_fp4", "quant.smp_samples=2"],
    "luq_int4stash": ["quant.forward=int4", "quant.backward=luq_fp4", "memory.stash=bitmap_int4"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "edgetrain"))
    ap.add_argument("--models", default="resnet20,vgg16_bn")
    ap.add_argument("--variants", default="fp32,luq,luq_smp2")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    variants = a.variants.split(",")
    for model in a.models.split(","):
        times = {v: [] for v in variants}
        quant = {v: [] for v in variants}
        for _ in range(a.reps):
            for v in variants:
                r = run_step(a.binary, model, a.batch, a.threads, a.steps, a.warmup, VARIANTS[v])
                times[v].append(r["step_ms_median"])
                quant[v].append(r.get("quantize_ms", 0.0))
        base = statistics.median(times[variants[0]])
        print(f"{model} batch {a.batch}, {a.threads} threads, median of {a.reps} interleaved runs "
              f"({a.steps} steps each)")
        print(f"{'variant':14} {'step ms':>9} {'img/s':>8} {'vs ' + variants[0]:>9} {'quantizing':>11}")
        for v in variants:
            t = statistics.median(times[v])
            q = statistics.median(quant[v])
            print(f"{v:14} {t:9.1f} {a.batch * 1000 / t:8.1f} {base / t:8.2f}x {100 * q / t:10.1f}%")


if __name__ == "__main__":
    main()
