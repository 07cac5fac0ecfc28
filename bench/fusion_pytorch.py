#!/usr/bin/env python3
"""PyTorch 1.13 beside `edgetrain bench fusion`: the same micro-benchmark (BrainSlug's stack),
`depth` blocks of <MaxPool 3x3 stride 1 pad 1, BN, ReLU> on [batch, channels, size, size], then
global average pooling, a linear layer and cross-entropy; forward (training mode) and training
step (forward + backward), medians of --reps after --warmup. 2 threads unless told otherwise.
The last line is one JSON object. With jemalloc:

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 /usr/bin/python3 bench/fusion_pytorch.py --depth 8
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    layers = []
    for _ in range(a.depth):
        layers += [nn.MaxPool2d(3, 1, 1), nn.BatchNorm2d(a.channels), nn.ReLU(inplace=False)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(a.channels, 10))
    model.train()
    x = torch.randn(a.batch, a.channels, a.size, a.size)
    y = torch.arange(a.batch) % 10
    loss_fn = nn.CrossEntropyLoss()
    fwd, step = [], []
    for r in range(a.warmup + a.reps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if r >= a.warmup:
            fwd.append((t1 - t0) * 1e3)
            step.append((t2 - t0) * 1e3)
    med = lambda v: sorted(v)[len(v) // 2]
    allocator = "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc"
    print("pytorch %s (%s), <MaxPool 3x3 s1 p1, BN, ReLU> x %d on [%d, %d, %d, %d], %d threads: forward %.2f ms, "
          "step %.2f ms (median of %d)" % (torch.__version__, allocator, a.depth, a.batch, a.channels, a.size, a.size,
                                            a.threads, med(fwd), med(step), a.reps))
    print(json.dumps({"framework": "pytorch", "version": torch.__version__, "allocator": allocator,
                      "depth": a.depth, "batch": a.batch, "channels": a.channels, "size": a.size,
                      "threads": a.threads, "forward_ms": med(fwd), "step_ms": med(step)}))


if __name__ == "__main__":
    main()
