#!/usr/bin/python3
"""Is a PyTorch checkpoint imported exactly? Evaluates it in PyTorch and, converted by
scripts/convert_pytorch.py, in edgetrain (`edgetrain eval --set model.weights=...`) on the same
test images, and compares accuracy, per-image predictions and logits.

  /usr/bin/python3 bench/import_check.py --config configs/resnet20a_cifar10_pretrain.json \\
      --checkpoint runs/finetune/torch_resnet20a.pt [--data ../shared/data/cifar10]

The model is bench/torch_models.py's replica of the config's model (model.shortcut included), in
eval mode. PyTorch's images are decoded by PIL; edgetrain runs twice: on the very same pixels
(written as a CIFAR-10 binary test batch: the engines' numerics alone) and on the JPEG folder with
its own decoder (engine/data/jpeg_decode.h, bit-exact with PIL's libjpeg-turbo; stb_image before
it differed by a grey level here and there). The last line is one JSON object.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from torch_models import build_model  # noqa: E402
from torch_train_reference import load_split  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint", required=True, help="a PyTorch checkpoint as published (state_dict inside)")
    ap.add_argument("--data", help="image folder root (default: the config's data.root)")
    ap.add_argument("--edgetrain", default=os.path.join(ROOT, "build", "edgetrain"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with open(a.config) as f:
        cfg = json.load(f)
    m, d = cfg["model"], cfg["data"]
    root = a.data or d["root"]

    # PyTorch: the checkpoint as its users load it.
    model = build_model(m["name"], m.get("num_classes", 10), m.get("dropout", 0.0), m.get("shortcut", "B"))
    sd = torch.load(a.checkpoint, map_location="cpu")
    sd = sd.get("state_dict", sd)
    model.load_state_dict({k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()})
    model.eval()
    xte, yte, _ = load_split(root, "test")
    mean = torch.tensor(d["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(d["std"]).view(1, 3, 1, 1)
    logits = []
    with torch.no_grad():
        for i in range(0, xte.shape[0], 500):
            logits.append(model((xte[i:i + 500].float() / 255.0 - mean) / std))
    tl = torch.cat(logits)
    tpred = tl.argmax(1)
    tacc = (tpred == yte).float().mean().item()

    # edgetrain: convert, evaluate (twice: on the JPEG folder with its own decoder, and on the very
    # pixels PyTorch saw, written as a CIFAR-10 binary test batch), read its predictions.
    out = {"config": a.config, "checkpoint": a.checkpoint, "images": int(yte.shape[0]), "torch_test_acc": tacc}
    K = tl.shape[1]
    with tempfile.TemporaryDirectory() as tmp:
        st = os.path.join(tmp, "w.safetensors")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert_pytorch.py"), a.checkpoint, st], check=True)
        with open(os.path.join(tmp, "test_batch.bin"), "wb") as f:  # label byte + CHW pixels per image
            for i in range(xte.shape[0]):
                f.write(bytes([int(yte[i])]) + xte[i].contiguous().numpy().tobytes())
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        for name, sets in (("same_pixels", ["data.format=cifar10_binary", "data.root=" + tmp]),
                           ("own_decoder", ["data.root=" + root])):
            pred_csv = os.path.join(tmp, name + ".csv")
            cmd = [a.edgetrain, "eval", "--config", a.config, "--set", "model.weights=" + st,
                   "--set", "train.threads=%d" % a.threads, "--predictions", pred_csv]
            subprocess.run(cmd + [x for kv in sets for x in ("--set", kv)], check=True, env=env, stdout=subprocess.DEVNULL)
            with open(pred_csv) as f:
                rows = list(csv.DictReader(f))
            el = torch.tensor([[float(r["logit%d" % k]) for k in range(K)] for r in rows])
            elab = torch.tensor([int(r["label"]) for r in rows])
            epred = torch.tensor([int(r["predicted"]) for r in rows])
            if not torch.equal(elab, yte):
                raise SystemExit("the two engines read the test images in different orders")
            eacc = (epred == yte).float().mean().item()
            diff = (el - tl).abs()
            r = {"edgetrain_test_acc": eacc, "acc_diff_points": 100 * (eacc - tacc),
                 "same_prediction": (epred == tpred).float().mean().item(),
                 "differing_predictions": int((epred != tpred).sum().item()),
                 "logit_abs_diff_max": diff.max().item(), "logit_abs_diff_mean": diff.mean().item()}
            out[name] = r
            print("%-11s PyTorch %.4f, edgetrain %.4f (%+.3f points); identical predictions on %.3f %% (%d differ); "
                  "|logit difference| max %.2e, mean %.2e" % (name, tacc, eacc, r["acc_diff_points"],
                                                             100 * r["same_prediction"], r["differing_predictions"],
                                                             r["logit_abs_diff_max"], r["logit_abs_diff_mean"]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
