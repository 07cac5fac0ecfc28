#!/usr/bin/python3
"""Reference training step of a CIFAR ResNet-8 in PyTorch, for tests/test_reference_step.cpp.

Builds the network exactly as models/resnet.cpp does (depth 8 = one BasicBlock per stage):
  conv1 3x3/16 (no bias) -> bn1 -> relu
  layer1.0: conv1 3x3 -> bn1 -> relu -> conv2 3x3 -> bn2, + identity, relu          (16 ch)
  layer2.0: same with stride 2 and 32 ch, shortcut = 1x1 conv stride 2 (shortcut.0) + BN (shortcut.1)
  layer3.0: same with 64 ch
  global average pool -> linear (10 classes, with bias)
so the state_dict names equal the engine's parameter and buffer names. With deterministic
pseudo-random weights, BN affine parameters and running statistics, input and labels (numpy
RandomState(2024)), it runs one training-mode forward + backward (batch statistics, running
statistics updated with momentum 0.1, unbiased variance) with softmax cross-entropy and label
smoothing 0.1, then one SGD step (lr 0.1, momentum 0.9, weight decay 5e-4, PyTorch's SGD).

The reference values are computed in float64 and stored as float32. The same step is also run
in float32; for every stored result tensor T the file holds "f32err:<T>" = max |T_f32 - T_f64| /
max |T_f64|, i.e. how far PyTorch's own float32 step is from the float64 one (a yardstick for the
engine's float32 tolerance).

Output: tests/data/ref_resnet8_step.bin, little-endian:
  8 bytes magic "ETREF001", uint32 count, then per tensor
  uint32 name length, name bytes (UTF-8, no terminator), uint32 ndim, int64 dims[ndim],
  float32 data[prod(dims)] (row-major).
Tensors: "input" [N,3,H,W], "labels" [N] (class indices as floats), hyper-parameters
("label_smoothing", "lr", "momentum", "weight_decay", "bn_momentum", "bn_eps") as [1], every
parameter under its state_dict name, every BN buffer (running_mean / running_var) before the step
under its name and after the step as "after_step:<name>", "loss" [1], "grad:<param>",
"after_sgd:<param>", and the "f32err:<...>" scalars described above.

Run: /usr/bin/python3 bench/make_reference.py   (from the repository root; PyTorch 1.13 CPU)
"""
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

N, C, H, W = 4, 3, 16, 16
NUM_CLASSES = 10
LABEL_SMOOTHING = 0.1
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
BN_MOMENTUM, BN_EPS = 0.1, 1e-5
SEED = 2024


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False),
                                          nn.BatchNorm2d(cout, eps=BN_EPS, momentum=BN_MOMENTUM))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth=8, num_classes=NUM_CLASSES):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16, eps=BN_EPS, momentum=BN_MOMENTUM)
        cin = 16
        for stage, width in enumerate([16, 32, 64]):
            blocks = []
            for b in range(n):
                stride = 2 if stage > 0 and b == 0 else 1
                blocks.append(BasicBlock(cin, width, stride))
                cin = width
            setattr(self, "layer%d" % (stage + 1), nn.Sequential(*blocks))
        self.linear = nn.Linear(64, num_classes)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.layer3(self.layer2(self.layer1(y)))
        y = F.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.linear(y)


def make_state(model, rng):
    """Deterministic values for every parameter and BN buffer (float64 numpy arrays)."""
    state = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("num_batches_tracked"):
            continue
        if name.endswith("running_mean"):
            v = 0.1 * rng.standard_normal(shape)
        elif name.endswith("running_var"):
            v = rng.uniform(0.5, 1.5, shape)
        elif t.dim() == 4:  # conv weight: Kaiming normal, fan_out, as the engine initialises it
            fan_out = shape[0] * shape[2] * shape[3]
            v = rng.standard_normal(shape) * np.sqrt(2.0 / fan_out)
        elif name.startswith("linear."):
            bound = 1.0 / np.sqrt(64)
            v = rng.uniform(-bound, bound, shape)
        elif name.endswith(".weight"):  # BN gamma
            v = rng.uniform(0.5, 1.5, shape)
        else:  # BN beta
            v = 0.2 * rng.standard_normal(shape)
        state[name] = v
    return state


def run_step(state, x_np, labels_np, dtype):
    """One training step in `dtype`; returns {name: float64 numpy array} of every result."""
    model = CifarResNet().to(dtype)
    model.load_state_dict({k: torch.tensor(v, dtype=dtype) for k, v in state.items()}, strict=False)
    model.train()
    x = torch.tensor(x_np, dtype=dtype)
    labels = torch.tensor(labels_np, dtype=torch.long)
    logits = model(x)
    loss = F.cross_entropy(logits, labels, label_smoothing=LABEL_SMOOTHING)
    model.zero_grad()
    loss.backward()
    out = {"loss": np.array([loss.item()])}
    for name, p in model.named_parameters():
        out["grad:" + name] = p.grad.detach().double().numpy().copy()
    for name, b in model.named_buffers():
        if not name.endswith("num_batches_tracked"):
            out["after_step:" + name] = b.detach().double().numpy().copy()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    opt.step()
    for name, p in model.named_parameters():
        out["after_sgd:" + name] = p.detach().double().numpy().copy()
    return out


def write(path, tensors):
    with open(path, "wb") as f:
        f.write(b"ETREF001")
        f.write(struct.pack("<I", len(tensors)))
        for name, arr in tensors:
            arr = np.ascontiguousarray(arr, dtype="<f4")
            nb = name.encode("utf-8")
            f.write(struct.pack("<I", len(nb)))
            f.write(nb)
            f.write(struct.pack("<I", arr.ndim))
            f.write(struct.pack("<%dq" % arr.ndim, *arr.shape))
            f.write(arr.tobytes())


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = np.random.RandomState(SEED)
    state = make_state(CifarResNet(), rng)
    # Parameters and input rounded to float32 first, so the float64 and float32 runs (and the
    # engine, which reads the float32 file) start from identical values.
    state = {k: v.astype(np.float32).astype(np.float64) for k, v in state.items()}
    x = rng.standard_normal((N, C, H, W)).astype(np.float32).astype(np.float64)
    labels = rng.randint(0, NUM_CLASSES, size=N)

    ref = run_step(state, x, labels, torch.float64)
    f32 = run_step(state, x, labels, torch.float32)

    tensors = [("input", x), ("labels", labels.astype(np.float64))]
    for k, v in [("label_smoothing", LABEL_SMOOTHING), ("lr", LR), ("momentum", MOMENTUM),
                 ("weight_decay", WEIGHT_DECAY), ("bn_momentum", BN_MOMENTUM), ("bn_eps", BN_EPS)]:
        tensors.append((k, np.array([v])))
    tensors += list(state.items())
    tensors += list(ref.items())
    for k, v in ref.items():
        scale = max(np.abs(v).max(), 1e-30)
        tensors.append(("f32err:" + k, np.array([np.abs(f32[k] - v).max() / scale])))

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "tests", "data", "ref_resnet8_step.bin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write(path, tensors)
    worst = max((v[0], k) for k, v in tensors if k.startswith("f32err:"))
    print("wrote %s: %d tensors, %d bytes; loss %.6f; PyTorch float32 vs float64 worst %.2e (%s)" %
          (path, len(tensors), os.path.getsize(path), ref["loss"][0], worst[0], worst[1]))


if __name__ == "__main__":
    sys.exit(main())
