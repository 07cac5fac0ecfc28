"""Shared by the bench/*_speed.py scripts: one `edgetrain bench step --profile` run of a shipped
config, returning the JSON object its last line prints."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"resnet20": "configs/resnet20_cifar10.json", "vgg16_bn": "configs/vgg16_bn_cifar10.json",
           "mobilenetv2": "configs/mobilenetv2_cifar10.json", "resnet18": "configs/resnet18_cifar10.json",
           "vgg16": "configs/vgg16_bn_cifar10.json"}  # with model.name=vgg16: the same recipe without BN


def run_step(binary, model, batch, threads, steps, warmup, sets, env=None):
    cmd = [binary, "bench", "step", "--config", os.path.join(ROOT, CONFIGS[model]), "--steps", str(steps),
           "--warmup", str(warmup), "--profile", "--set", f"train.batch_size={batch}",
           "--set", f"train.threads={threads}", "--set", f"model.name={model}"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env=dict(os.environ, **env) if env else None).stdout
    return json.loads(out.strip().splitlines()[-1])
