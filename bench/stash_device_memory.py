#!/usr/bin/env python3
"""What the bitmap stash formats save on a GPU against what they save on the CPU (issue 13's memory
target: the same ratios within 2 points). For each model and format, `edgetrain bench step` runs on
both devices; the memory that follows the stash format is the arena's planned activations (the
forward buffers, which die earlier when the stash copies a value) plus the stash region: on the
CPU the pages its top touched (what USS counts), on CUDA the region as allocated, its room fitted
to what each entry kept (memory.stash_headroom; docs/cuda.md). Prints each format's total against
dense_fp32's on each device, and the difference.

    python3 bench/stash_device_memory.py --edgetrain gpu/edgetrain --models resnet20,vgg16_bn
"""
import argparse
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(binary, model, device, stash, batch, steps, quant):
    cmd = [binary, "bench", "step", "--config", os.path.join(ROOT, "configs", f"{model}_cifar10.json"),
           "--steps", str(steps), "--warmup", "3", "--set", f"train.device={device}", "--set", "fusion.enabled=false",
           "--set", f"memory.stash={stash}", "--set", f"train.batch_size={batch}"]
    if quant:
        cmd += ["--set", "quant.forward=int4", "--set", "quant.backward=luq_fp4"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:  # reported, and the other runs go on (a GPU's minutes are few)
        print(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def held_mb(j, device):
    region = j["stash_region_mb"] if device != "cpu" else j["stash_region_peak_mb"]
    return j["activations_mb"] + region, region


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edgetrain", default=os.path.join(ROOT, "build", "edgetrain"))
    ap.add_argument("--models", default="resnet20,vgg16_bn")
    ap.add_argument("--formats", default="bitmap_fp32,bitmap_fp16,auto,bitmap_int4")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    worst = 0.0
    for model in a.models.split(","):
        cpu_ratio = {}
        for device in ("cpu", a.device):
            base = {}
            for quant in (False, True):
                if quant and "bitmap_int4" not in a.formats:
                    continue
                j = bench(a.edgetrain, model, device, "dense_fp32", a.batch, a.steps, quant)
                if j is not None:
                    base[quant] = held_mb(j, device)[0]
            for fmt in a.formats.split(","):
                quant = fmt == "bitmap_int4"  # its codes are a 4-bit layer's: against 4-bit dense_fp32
                j = bench(a.edgetrain, model, device, fmt, a.batch, a.steps, quant) if quant in base else None
                if j is None:
                    continue
                total, region = held_mb(j, device)
                ratio = total / base[quant]
                print(f"{model} {device:5s} {fmt:12s}: activations {j['activations_mb']:7.1f} MB + stash region "
                      f"{region:6.1f} MB = {total:7.1f} MB, {ratio:.3f} of dense_fp32 ({base[quant]:.1f} MB); "
                      f"steps run again for room {j.get('stash_room_grown', 0)}", flush=True)
                if device == "cpu":
                    cpu_ratio[fmt] = ratio
                elif fmt in cpu_ratio:
                    diff = ratio - cpu_ratio[fmt]
                    worst = max(worst, abs(diff))
                    print(f"{model} {fmt}: {device} {ratio:.3f} against cpu {cpu_ratio[fmt]:.3f} of dense_fp32: "
                          f"{100 * diff:+.1f} points", flush=True)
    print(f"largest difference: {100 * worst:.1f} points (target: within 2)")


if __name__ == "__main__":
    main()
