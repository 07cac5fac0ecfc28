#!/usr/bin/env python3
"""PyTorch's training step on a GPU, the peer of `edgetrain bench step --set train.device=cuda`.

The same models (bench/torch_models.py, replicas of ours), the same step as bench/compare_pytorch.py:
zero_grad, forward, mean softmax cross-entropy, backward, SGD with the config's momentum, weight
decay and Nesterov, on synthetic N(0,1) images and uniform labels. FP32 as edgetrain computes it:
TF32 off for matmuls and cuDNN. Two rows per model: cuDNN's autotuner on (PyTorch's fastest), and
deterministic algorithms (edgetrain's choice is deterministic). The time of a step is from before
it to a torch.cuda.synchronize after it; the median over --steps after --warmup. Memory: the peak
of torch.cuda.max_memory_allocated over the timed steps (tensors only, not the allocator's cache).

  python3 bench/torch_step_cuda.py [--models resnet20,resnet18,vgg16_bn] [--batch 128] [--steps 20]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def run(model_name, batch, steps, warmup, deterministic, device="cuda"):
    import torch
    import torch_models
    from compare_pytorch import optimizer_settings

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.manual_seed(1)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = optimizer_settings(model_name)
    model = torch_models.build_model(model_name, num_classes=cfg["num_classes"]).to(dev).train()
    x = torch.randn(batch, 3, 32, 32, device=dev)
    y = torch.randint(0, cfg["num_classes"], (batch,), device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                          weight_decay=cfg["weight_decay"], nesterov=cfg["nesterov"])
    criterion = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ms = []
    loss = None
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
    median = sorted(ms)[len(ms) // 2]
    return {
        "model": model_name,
        "batch": batch,
        "deterministic": deterministic,
        "step_ms_median": median,
        "step_ms_min": min(ms),
        "step_ms_max": max(ms),
        "img_per_s": batch * 1000.0 / median,
        "peak_allocated_mb": torch.cuda.max_memory_allocated() / 1048576.0 if cuda else None,
        "loss": float(loss.item()),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet20,resnet18,vgg16_bn")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the script itself")
    a = ap.parse_args()
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("torch_step_cuda: no CUDA device for PyTorch", file=sys.stderr)
        return 1
    for m in a.models.split(","):
        for deterministic in (False, True):
            r = run(m, a.batch, a.steps, a.warmup, deterministic, a.device)
            print("%-10s %-13s median step %7.2f ms (min %.2f, max %.2f), peak allocated %s MB"
                  % (m, "deterministic" if deterministic else "autotuned", r["step_ms_median"], r["step_ms_min"],
                     r["step_ms_max"], "%.1f" % r["peak_allocated_mb"] if r["peak_allocated_mb"] else "-"), flush=True)
            print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
