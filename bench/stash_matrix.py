#!/usr/bin/env python3
"""Stash formats side by side: for each model, runs `edgetrain bench step --profile` for every
(format, checkpoint_every[, sets]) variant, interleaved over several repetitions, and prints the
stash peak against the first variant's, the step USS, the median step time against the first
variant's (same run), and the share of the step spent packing / unpacking the stash and recomputing.

    python3 bench/stash_matrix.py --models resnet20,vgg16 --batch 128 --reps 3

A variant's third field, `+`-separated config overrides, gives other settings of the same model:
`dense_fp32:0:luq` is 4-bit training (`luq` stands for quant.forward=int4+quant.backward=luq_fp4).
The CPU's side of the CUDA backend's speed table (docs/cuda.md; the GPU's is scripts/gpu_check.sh's
`bench` and `luq` steps):

    python3 bench/stash_matrix.py --models resnet20,resnet18,vgg16_bn --reps 3 --set fusion.enabled=false \
        --variants dense_fp32:0,bitmap_fp32:0,bitmap_fp16:0,dense_bf16:0,auto:0,dense_fp32:0:luq
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"resnet20": "configs/resnet20_cifar10.json", "resnet18": "configs/resnet18_cifar10.json",
           "vgg16_bn": "configs/vgg16_bn_cifar10.json", "mobilenetv2": "configs/mobilenetv2_cifar10.json"}
SHORTHANDS = {"luq": "quant.forward=int4+quant.backward=luq_fp4"}


def parse_variant(text):
    """'format:checkpoint_every[:key=value+key=value]' -> (format, checkpoint_every, sets, label)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise SystemExit(f"stash_matrix: variant '{text}': expected format:checkpoint_every[:sets]")
    extra = parts[2] if len(parts) == 3 else ""
    sets = tuple(SHORTHANDS.get(extra, extra).split("+")) if extra else ()
    bad = [s for s in sets if "=" not in s]
    if bad:
        raise SystemExit(f"stash_matrix: variant '{text}': '{bad[0]}' is not key=value")
    return parts[0], int(parts[1]), sets, parts[0] + ("+" + extra if extra else "")


DEFAULT_VARIANTS = "dense_fp32:0,bitmap_fp32:0,bitmap_fp16:0,dense_fp32:1,bitmap_fp32:1,bitmap_fp16:1"


def run(binary, model, batch, fmt, ck, sets, steps, warmup, threads):
    config = CONFIGS.get(model, CONFIGS["resnet20"])
    cmd = [binary, "bench", "step", "--config", os.path.join(ROOT, config), "--steps", str(steps),
           "--warmup", str(warmup), "--profile", "--set", f"model.name={model}", "--set", f"train.batch_size={batch}",
           "--set", f"memory.stash={fmt}", "--set", f"memory.checkpoint_every={ck}", "--set", f"train.threads={threads}"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet20,vgg16")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="format:checkpoint_every[:key=value+...],... (first is the baseline; 'luq' for 4-bit)")
    ap.add_argument("--set", action="append", default=[], help="a config override for every variant (repeatable)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--edgetrain", default=os.path.join(ROOT, "build", "edgetrain"))
    a = ap.parse_args()
    variants = [parse_variant(v) for v in a.variants.split(",")]
    variants = [(f, ck, tuple(a.set) + sets, label) for f, ck, sets, label in variants]
    rows = []
    for model in a.models.split(","):
        runs = {v: [] for v in variants}
        for _ in range(a.reps):  # interleaved: drift in machine load hits every variant alike
            for v in variants:
                runs[v].append(run(a.edgetrain, model, a.batch, v[0], v[1], v[2], a.steps, a.warmup, a.threads))
        base_ms = statistics.median(r["step_ms_median"] for r in runs[variants[0]])
        base_stash = runs[variants[0]][0]["stash_peak_mb"]
        print(f"\n{model} batch {a.batch}, {a.threads} threads, {a.reps} reps x {a.steps} steps (medians)")
        print(f"{'stash':<16} {'ckpt':>4} {'stash MB':>9} {'x first':>8} {'step USS':>9} {'step ms':>8} "
              f"{'x first':>8} {'pack+unpack':>11} {'recompute':>9}")
        for v in variants:
            rs = runs[v]
            ms = statistics.median(r["step_ms_median"] for r in rs)
            pu = statistics.median((r["stash_pack_ms"] + r["stash_unpack_ms"]) / r["step_ms_median"] for r in rs)
            rc = statistics.median(r["recompute_ms"] / r["step_ms_median"] for r in rs)
            row = {"model": model, "batch": a.batch, "stash": v[0], "variant": v[3], "checkpoint_every": v[1],
                   "stash_peak_mb": rs[0]["stash_peak_mb"], "stash_ratio": rs[0]["stash_peak_mb"] / base_stash,
                   "step_uss_mb": statistics.median(r["step_uss_mb"] for r in rs), "step_ms": ms,
                   "step_ratio": ms / base_ms, "pack_unpack_share": pu, "recompute_share": rc}
            rows.append(row)
            print(f"{v[3]:<16} {v[1]:>4} {row['stash_peak_mb']:>9.1f} {row['stash_ratio']:>8.3f} "
                  f"{row['step_uss_mb']:>9.1f} {ms:>8.1f} {row['step_ratio']:>8.3f} {100 * pu:>10.1f}% {100 * rc:>8.1f}%")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
