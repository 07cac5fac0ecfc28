"""Trains an edgetrain config's model and recipe with PyTorch, as an independent reference for the
accuracy edgetrain reaches (same model definition, data, augmentation, schedule and optimizer).

It reads the edgetrain JSON config (model.name, data.*, train.*), builds the model from
bench/torch_models.py, decodes the image folder once, and trains on a GPU when one is present
(the whole data set lives on the device, augmentation runs there), else on the CPU. Several seeds
or recipe variants run back to back; every epoch prints one line, the last line is one JSON object:
{"runs": [{"name", "seed", "epochs": [{"epoch", "train_loss", "train_acc", "test_acc", "test_acc_flip"}],
"final_test_acc", "seconds"}]}.

  /usr/bin/python3 bench/torch_train_reference.py --config configs/resnet20_cifar10_short.json \
      --data ../shared/data/cifar10 --seeds 1,2 [--variant name:key=value,key=value]...

A variant overrides train.* keys (lr, batch_size, weight_decay, label_smoothing, epochs, momentum,
nesterov) or schedule keys (schedule.pct_start, ...); "zero_init_residual=1" zeroes the last BN gamma
of every residual block (not an edgetrain feature; reported as such).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import build_model  # noqa: E402


def load_split(root, split, classes=None):
    """root/split/<class>/*.jpg in byte-wise sorted order -> uint8 [N,3,H,W], int64 [N], classes."""
    base = os.path.join(root, split)
    if classes is None:
        classes = sorted(d for d in os.listdir(base) if not d.startswith(".") and os.path.isdir(os.path.join(base, d)))
    files, labels = [], []
    for k, c in enumerate(classes):
        names = sorted(n for n in os.listdir(os.path.join(base, c)) if n.lower().endswith((".jpg", ".jpeg", ".png")))
        files += [os.path.join(base, c, n) for n in names]
        labels += [k] * len(names)
    try:
        from torchvision.io import decode_image, read_file

        imgs = [decode_image(read_file(f)) for f in files]
    except ImportError:
        import numpy as np
        from PIL import Image

        imgs = [torch.from_numpy(np.asarray(Image.open(f).convert("RGB"))).permute(2, 0, 1) for f in files]
    return torch.stack(imgs), torch.tensor(labels), classes


def channel_stats(x):
    """Per-channel mean and population std of uint8 [N,C,H,W] / 255, as data.mean / std = auto
    computes them (exact sums: float64 holds these integers exactly)."""
    s1 = torch.zeros(x.shape[1], dtype=torch.float64)
    s2 = torch.zeros(x.shape[1], dtype=torch.float64)
    for i in range(0, x.shape[0], 4096):
        v = x[i:i + 4096].to("cpu", torch.float64)
        s1 += v.sum(dim=(0, 2, 3))
        s2 += (v * v).sum(dim=(0, 2, 3))
    n = x.shape[0] * x.shape[2] * x.shape[3]
    m = s1 / n
    return (m / 255).tolist(), ((s2 / n - m * m).clamp(min=0).sqrt() / 255).tolist()


def learning_rate(t, epoch):
    """engine/train/schedule.cpp, evaluated at a fractional epoch."""
    s, base, total = t["schedule"], t["lr"], t["epochs"]
    typ = s.get("type", "constant")
    if typ == "onecycle":
        start = base / s.get("div_factor", 25.0)
        end = start / s.get("final_div_factor", 1e4)
        rise = s.get("pct_start", 0.3) * total
        if epoch < rise:
            return start + (base - start) * epoch / rise
        f = min(1.0, (epoch - rise) / (total - rise))
        return end + (base - end) * 0.5 * (1 + math.cos(math.pi * f))
    warm = s.get("warmup_epochs", 0)
    if epoch < warm:
        f0 = s.get("warmup_start_factor", 0.1)
        return base * (f0 + (1 - f0) * epoch / warm)
    if typ == "cosine":
        f = min(1.0, (epoch - warm) / (total - warm))
        m = s.get("min_lr", 0.0)
        return m + (base - m) * 0.5 * (1 + math.cos(math.pi * f))
    if typ == "multistep":
        lr = base
        for m in s.get("milestones", []):
            if epoch >= m:
                lr *= s.get("gamma", 0.1)
        return lr
    return base


def augment(x_u8, pad, flip, gen):
    """Random crop with `pad` zero pixels each side + horizontal flip, per sample (uint8 in, uint8 out)."""
    n, c, h, w = x_u8.shape
    if pad > 0:
        xp = F.pad(x_u8, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (n,), device=x_u8.device, generator=gen)
        dx = torch.randint(0, 2 * pad + 1, (n,), device=x_u8.device, generator=gen)
        rows = (dy[:, None] + torch.arange(h, device=x_u8.device)[None, :])  # [n,h]
        cols = (dx[:, None] + torch.arange(w, device=x_u8.device)[None, :])  # [n,w]
        idx_n = torch.arange(n, device=x_u8.device)[:, None, None, None]
        idx_c = torch.arange(c, device=x_u8.device)[None, :, None, None]
        x_u8 = xp[idx_n, idx_c, rows[:, None, :, None], cols[:, None, None, :]]
    if flip:
        m = torch.rand(n, device=x_u8.device, generator=gen) < 0.5
        x_u8 = torch.where(m[:, None, None, None], x_u8.flip(3), x_u8)
    return x_u8


def run(cfg, data, seed, name, zero_init_residual, dev, init=None, save=None):
    (xtr, ytr), (xte, yte) = data
    t = cfg["train"]
    d = cfg["data"]
    torch.manual_seed(seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    model = build_model(cfg["model"]["name"], cfg["model"].get("num_classes", 10), cfg["model"].get("dropout", 0.0),
                        cfg["model"].get("shortcut", "B"))
    if zero_init_residual:
        for m in model.modules():
            if hasattr(m, "bn2") and hasattr(m, "shortcut"):
                torch.nn.init.zeros_(m.bn2.weight)
    if init:  # a state_dict, or a published checkpoint holding one (as scripts/convert_pytorch.py reads it)
        sd = torch.load(init, map_location="cpu")
        sd = sd.get("state_dict", sd)
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
        own = model.state_dict()
        # Head swap, as model.weights does it: a classifier of another size keeps its initialisation.
        swapped = [k for k, v in sd.items() if k in own and own[k].shape != v.shape and k.split(".")[0] in ("linear", "classifier")]
        for k in swapped:
            sd[k] = own[k]
        if swapped:
            print("head swap: %s initialised anew" % ", ".join(swapped), flush=True)
        model.load_state_dict(sd)
    ft = cfg.get("finetune", {})
    if ft.get("bn", "train") != "train":
        raise SystemExit("finetune.bn = %s: only \"train\" has a PyTorch replica here" % ft["bn"])
    from torch_models import freeze
    freeze(model, ft.get("trainable", "all"))  # requires_grad = False outside the trained blocks
    model = model.to(dev).to(memory_format=torch.channels_last)
    mean, std = d.get("mean", "auto"), d.get("std", "auto")  # edgetrain's default: auto
    if mean == "auto" or std == "auto":
        m, s = channel_stats(xtr)
        mean, std = m if mean == "auto" else mean, s if std == "auto" else std
        print("data.mean / std = auto: mean %s, std %s" % (["%.4f" % v for v in mean], ["%.4f" % v for v in std]), flush=True)
    mean = torch.tensor(mean, device=dev).view(1, -1, 1, 1)
    std = torch.tensor(std, device=dev).view(1, -1, 1, 1)
    norm = lambda u8: ((u8.float() / 255.0 - mean) / std).contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=t["lr"], momentum=t.get("momentum", 0.9),
                          nesterov=t.get("nesterov", False), weight_decay=t.get("weight_decay", 0.0))
    bs, epochs = t["batch_size"], t["epochs"]
    steps = xtr.shape[0] // bs  # drop_last, as edgetrain
    ls = t.get("label_smoothing", 0.0)
    hist, t0 = [], time.time()
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(xtr.shape[0], device=dev, generator=gen)
        tl, tc = torch.zeros((), device=dev), torch.zeros((), device=dev)
        for s in range(steps):
            for g in opt.param_groups:
                g["lr"] = learning_rate(t, ep + s / steps)
            idx = perm[s * bs:(s + 1) * bs]
            x = norm(augment(xtr[idx], d.get("crop_padding", 4), d.get("hflip", True), gen))
            y = ytr[idx]
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=ls)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tl += loss.detach() * bs
            tc += (out.argmax(1) == y).sum()
        model.eval()
        correct = correct_flip = 0
        with torch.no_grad():
            for i in range(0, xte.shape[0], 1000):
                x = norm(xte[i:i + 1000])
                o = model(x)
                correct += (o.argmax(1) == yte[i:i + 1000]).sum().item()
                o2 = o.softmax(1) + model(x.flip(3)).softmax(1)
                correct_flip += (o2.argmax(1) == yte[i:i + 1000]).sum().item()
        n = steps * bs
        e = {"epoch": ep + 1, "train_loss": tl.item() / n, "train_acc": tc.item() / n,
             "test_acc": correct / xte.shape[0], "test_acc_flip": correct_flip / xte.shape[0]}
        hist.append(e)
        print("%s seed %d epoch %d loss %.4f train %.4f test %.4f (flip-TTA %.4f) %.0fs" % (
            name, seed, ep + 1, e["train_loss"], e["train_acc"], e["test_acc"], e["test_acc_flip"],
            time.time() - t0), flush=True)
    if save:  # as published CIFAR checkpoints are: DataParallel names under "state_dict"
        sd = {"module." + k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        torch.save({"state_dict": sd, "best_prec1": 100.0 * hist[-1]["test_acc"]}, save)
    return {"name": name, "seed": seed, "epochs": hist, "final_test_acc": hist[-1]["test_acc"],
            "seconds": time.time() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", help="image folder root (default: the config's data.root)")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--variant", action="append", default=[], help="name:key=value,... (train.* keys)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads when there is no GPU")
    ap.add_argument("--init", help="start from these weights (a state_dict .pt) instead of the initialisation")
    ap.add_argument("--save", help="save the (first) trained model here, as {'state_dict': module.* names}")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 like edgetrain
    torch.backends.cudnn.allow_tf32 = False
    root = args.data or cfg["data"]["root"]
    t0 = time.time()
    xtr, ytr, classes = load_split(root, "train")
    xte, yte, _ = load_split(root, "test", classes)
    print("data: %d train, %d test images, %.1fs, device %s" % (len(ytr), len(yte), time.time() - t0, dev), flush=True)
    data = ((xtr.to(dev), ytr.to(dev)), (xte.to(dev), yte.to(dev)))
    variants = [("shipped", {})]
    for v in args.variant:
        name, _, kvs = v.partition(":")
        over = {}
        for kv in filter(None, kvs.split(",")):
            k, _, val = kv.partition("=")
            over[k] = json.loads(val)
        variants.append((name, over))
    results = []
    for name, over in variants:
        c = json.loads(json.dumps(cfg))
        zero = bool(over.pop("zero_init_residual", 0))
        for k, val in over.items():
            if k.startswith("schedule."):
                c["train"]["schedule"][k.split(".", 1)[1]] = val
            else:
                c["train"][k] = val
        for seed in [int(s) for s in args.seeds.split(",")]:
            results.append(run(c, data, seed, name, zero, dev, args.init, None if results else args.save))
    print(json.dumps({"runs": results}))


if __name__ == "__main__":
    main()
