"""PyTorch replicas of edgetrain's model builders (models/resnet.cpp, models/vgg.cpp,
models/mobilenetv2.cpp), for speed / memory comparisons (bench/compare_pytorch.py).

Layer structure and parameter names follow ours, so state_dict keys match the parameter names
of an edgetrain graph ("conv1.weight", "layer1.0.conv1.weight", "layer2.0.shortcut.0.weight",
"features.0.weight", "classifier.weight", "linear.weight", ...). Convolutions have no bias except
in VGG without BN; BN uses momentum 0.1, eps 1e-5; initialisation mirrors engine/init.cpp
(conv: Kaiming normal with fan-out, std sqrt(2 / fan_out); linear and conv bias: uniform
+-1/sqrt(fan_in); BN: gamma 1, beta 0).

  build_model(name, num_classes=10, dropout=0.0, shortcut="B") -> nn.Module (shortcut: model.shortcut)
  MODEL_NAMES: the names build_model knows (the same as edgetrain's registry).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _init(model):
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = (m.out_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            if m.bias is not None:
                fan_in = (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
                b = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(m.bias, -b, b)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            b = 1.0 / math.sqrt(m.in_features)
            nn.init.uniform_(m.weight, -b, b)
            if m.bias is not None:
                nn.init.uniform_(m.bias, -b, b)
    return model


def _conv(cin, cout, k, stride=1, groups=1, bias=False):
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=bias)


def _bn(c):
    return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)


# --------------------------------------------------------------------------------------------
# ResNets (models/resnet.cpp)


class ShortcutA(nn.Module):
    """He et al.'s option A: x[:, :, ::s, ::s] with zero channels, (cout - cin) // 2 before x's
    (for cout = 2 cin the published CIFAR ResNets' F.pad(..., (0, 0, 0, 0, cout // 4, cout // 4)))."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.stride, self.before, self.after = stride, (cout - cin) // 2, cout - cin - (cout - cin) // 2

    def forward(self, x):
        return F.pad(x[:, :, ::self.stride, ::self.stride], (0, 0, 0, 0, self.before, self.after))


class BasicBlock(nn.Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); shortcut on a shape change: option B,
    1x1 conv + BN (shortcut.0, shortcut.1), or option A (ShortcutA, no parameters)."""

    def __init__(self, cin, cout, stride, shortcut="B"):
        super().__init__()
        self.conv1 = _conv(cin, cout, 3, stride)
        self.bn1 = _bn(cout)
        self.conv2 = _conv(cout, cout, 3, 1)
        self.bn2 = _bn(cout)
        if (stride != 1 or cin != cout) and shortcut == "A":
            self.shortcut = ShortcutA(cin, cout, stride)
        elif stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(_conv(cin, cout, 1, stride), _bn(cout))
        else:
            self.shortcut = nn.Sequential()  # identity, no parameters

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths, blocks, stem, num_classes, shortcut="B"):
        super().__init__()
        self.conv1 = _conv(3, stem, 3, 1)
        self.bn1 = _bn(stem)
        cin = stem
        for stage, (w, n) in enumerate(zip(widths, blocks)):
            layer = []
            for b in range(n):
                stride = 2 if (stage > 0 and b == 0) else 1
                layer.append(BasicBlock(cin, w, stride, shortcut))
                cin = w
            setattr(self, "layer%d" % (stage + 1), nn.Sequential(*layer))
        self.num_stages = len(widths)
        self.linear = nn.Linear(cin, num_classes)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        for s in range(self.num_stages):
            y = getattr(self, "layer%d" % (s + 1))(y)
        y = F.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.linear(y)


def cifar_resnet(depth, num_classes=10, shortcut="B"):
    """resnet8/20/32/44/56/110: depth = 6n + 2, three stages of n blocks, 16/32/64 channels."""
    assert (depth - 2) % 6 == 0, "CIFAR ResNet depth must be 6n+2"
    n = (depth - 2) // 6
    return _init(ResNet([16, 32, 64], [n, n, n], 16, num_classes, shortcut))


def resnet18(num_classes=10, shortcut="B"):
    """CIFAR ResNet-18: 3x3 stem (64), no max-pool, [2,2,2,2] blocks, 64..512 channels."""
    return _init(ResNet([64, 128, 256, 512], [2, 2, 2, 2], 64, num_classes, shortcut))


# --------------------------------------------------------------------------------------------
# VGG (models/vgg.cpp)

VGG_CFG = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, depth, batchnorm, num_classes=10, dropout=0.0):
        super().__init__()
        layers, cin = [], 3
        for c in VGG_CFG[depth]:
            if c == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            layers.append(nn.Conv2d(cin, c, 3, padding=1, bias=not batchnorm))
            if batchnorm:
                layers.append(_bn(c))
            layers.append(nn.ReLU(inplace=False))
            cin = c
        self.features = nn.Sequential(*layers)  # indices as torchvision ("features.0.weight", ...)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x):
        y = self.features(x)
        # 32x32 inputs leave [N,512,1,1] -> flatten; other sizes are averaged to 1x1 first.
        if y.shape[2] != 1 or y.shape[3] != 1:
            y = F.adaptive_avg_pool2d(y, 1)
        y = y.flatten(1)
        if self.dropout is not None:
            y = self.dropout(y)
        return self.classifier(y)


def vgg(depth, batchnorm, num_classes=10, dropout=0.0):
    return _init(VGG(depth, batchnorm, num_classes, dropout))


# --------------------------------------------------------------------------------------------
# MobileNetV2 for CIFAR (models/mobilenetv2.cpp)


class InvertedResidual(nn.Module):
    """1x1 expand + BN + ReLU, 3x3 depthwise + BN + ReLU, 1x1 project + BN; residual add when stride
    is 1 (shortcut = 1x1 conv + BN when the channel count changes). ReLU, not ReLU6 (as ours)."""

    def __init__(self, cin, expansion, cout, stride):
        super().__init__()
        hidden = cin * expansion
        self.stride = stride
        self.conv1 = _conv(cin, hidden, 1)
        self.bn1 = _bn(hidden)
        self.conv2 = _conv(hidden, hidden, 3, stride, groups=hidden)
        self.bn2 = _bn(hidden)
        self.conv3 = _conv(hidden, cout, 1)
        self.bn3 = _bn(cout)
        if stride == 1 and cin != cout:
            self.shortcut = nn.Sequential(_conv(cin, cout, 1), _bn(cout))
        else:
            self.shortcut = nn.Sequential()

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        if self.stride != 1:
            return y
        return y + self.shortcut(x)


class MobileNetV2(nn.Module):
    # (expansion, out, blocks, stride); CIFAR: stride 1 in the stem and the second stage.
    STAGES = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, num_classes=10, dropout=0.0):
        super().__init__()
        self.conv1 = _conv(3, 32, 3, 1)
        self.bn1 = _bn(32)
        blocks, cin = [], 32
        for e, out, n, s in self.STAGES:
            for b in range(n):
                blocks.append(InvertedResidual(cin, e, out, s if b == 0 else 1))
                cin = out
        self.layers = nn.Sequential(*blocks)
        self.conv2 = _conv(cin, 1280, 1)
        self.bn2 = _bn(1280)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.linear = nn.Linear(1280, num_classes)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.layers(y)
        y = F.relu(self.bn2(self.conv2(y)))
        y = F.adaptive_avg_pool2d(y, 1).flatten(1)
        if self.dropout is not None:
            y = self.dropout(y)
        return self.linear(y)


def mobilenetv2(num_classes=10, dropout=0.0):
    return _init(MobileNetV2(num_classes, dropout))


# --------------------------------------------------------------------------------------------
# Registry (models/registry.cpp)

MODEL_NAMES = sorted(
    ["resnet%d" % d for d in (8, 20, 32, 44, 56, 110)]
    + ["resnet18", "mobilenetv2"]
    + ["vgg%d" % d for d in (11, 13, 16, 19)]
    + ["vgg%d_bn" % d for d in (11, 13, 16, 19)]
)


def build_model(name, num_classes=10, dropout=0.0, shortcut="B"):
    if name == "resnet18":
        return resnet18(num_classes, shortcut)
    if name.startswith("resnet"):
        return cifar_resnet(int(name[len("resnet"):]), num_classes, shortcut)
    if name.startswith("vgg"):
        bn = name.endswith("_bn")
        depth = int(name[3:].replace("_bn", ""))
        if depth not in VGG_CFG:
            raise ValueError("VGG depth %d" % depth)
        return vgg(depth, bn, num_classes, dropout)
    if name == "mobilenetv2":
        return mobilenetv2(num_classes, dropout)
    raise ValueError("unknown model '%s' (known: %s)" % (name, ", ".join(MODEL_NAMES)))


def freeze(model, policy):
    """finetune.trainable for the ResNets, as models/freeze.cpp applies it: "all", "head" (the
    classifier) or "last:N" (the last N blocks, the stem counting as one, and the head). Frozen
    parameters get requires_grad = False; BN layers stay in training mode (finetune.bn = train).
    Returns the names of the trained parameters."""
    names = [n for n, _ in model.named_parameters()]
    if policy == "all":
        return names
    units = ["conv1"] + sorted({".".join(n.split(".")[:2]) for n in names if n.startswith("layer")},
                               key=lambda u: (int(u[5:].split(".")[0]), int(u.split(".")[1])))
    last = 0 if policy == "head" else int(policy.split(":")[1])
    keep = set(units[len(units) - last:]) if last else set()
    trained = []
    for n, p in model.named_parameters():
        unit = "conv1" if n.startswith(("conv1.", "bn1.")) else ".".join(n.split(".")[:2])
        p.requires_grad = n.startswith("linear.") or unit in keep
        if p.requires_grad:
            trained.append(n)
    return trained


def num_params(model):
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    # Parameter counts and output shapes for a [2,3,32,32] input.
    for n in MODEL_NAMES:
        m = build_model(n)
        out = m(torch.randn(2, 3, 32, 32))
        print("%-12s %10d params  out %s" % (n, num_params(m), tuple(out.shape)))
