#!/usr/bin/env python3
"""BitTrain's model-level figures on CIFAR-10, measured with `edgetrain memprofile` (one training
step on a real batch, trained weights, memory.release_pages on so USS follows what is live) and,
for Fig. 9b's accuracy, short fine-tunes with `edgetrain train`. Prints Markdown tables.

  fig7b  activation memory, dense_fp32 against bitmap_fp32, per model and batch
  fig9b  bitmap_fp32 with activation pruning thresholds (memory; with --finetune-epochs, accuracy)
  fig11  recomputation (memory.checkpoint_every) x {dense_fp32, bitmap_fp32}

    python3 bench/bittrain_figures.py fig7b --model resnet20=runs/r20.ckpt --model vgg16_bn=runs/vgg.ckpt
    python3 bench/bittrain_figures.py fig9b --model resnet20=runs/r20.ckpt --finetune-epochs 1 --train-subset 10000
    python3 bench/bittrain_figures.py fig11 --model resnet20=runs/r20.ckpt --batch 32

Every run uses a config with the data section of --data-config (resolved numbers, not "auto", so
no statistics pass is needed) and model.name set per model.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_config(base, model, tmp):
    with open(base) as f:
        cfg = json.load(f)
    cfg["model"]["name"] = model
    path = os.path.join(tmp, f"{model}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def memprofile(a, tmp, model, ckpt, batch, sets):
    out = tempfile.mkdtemp(dir=tmp)
    cmd = [a.edgetrain, "memprofile", "--config", write_config(a.data_config, model, tmp), "--out", out,
           "--steps", str(a.steps), "--set", f"train.batch_size={batch}", "--set", f"train.threads={a.threads}"]
    if ckpt:
        cmd += ["--checkpoint", ckpt]
    for s in a.set + sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "memprofile.json")) as f:
        return json.load(f)


def finetune(a, tmp, model, ckpt, sets):
    out = tempfile.mkdtemp(dir=tmp)
    cmd = [a.edgetrain, "train", "--config", write_config(a.data_config, model, tmp), "--out", out,
           "--set", f"model.weights={ckpt}", "--set", f"train.epochs={a.finetune_epochs}",
           "--set", f"train.lr={a.finetune_lr}", "--set", "train.schedule.type=constant",
           "--set", f"train.batch_size={a.finetune_batch}", "--set", f"data.train_subset={a.train_subset}",
           "--set", f"train.threads={a.threads}"]
    for s in sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "test_acc" in r][-1]


def mb(x):
    return "n/a" if x is None else f"{x:.2f}"


def pct(new, old):
    return "n/a" if new is None or old is None or old == 0 else f"{100.0 * (1.0 - new / old):.1f}"


def totals(p):
    t = p["totals"]
    # What the activations kept for backward take at the stash's peak: the stash's own bytes,
    # plus, for dense_fp32 (zero copy), the forward buffers it keeps (counted in stash_peak_mb).
    return t["stash_peak_mb"], t.get("step_uss_mb"), t["arena_mb"]


def fig7b(a, tmp):
    print("| model | weights | batch | stash peak MB dense_fp32 | bitmap_fp32 | reduction % | arena MB dense_fp32 | "
          "bitmap_fp32 | step USS MB dense_fp32 | bitmap_fp32 | reduction % |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, ckpt in a.model:
        for batch in a.batches:
            d = totals(memprofile(a, tmp, model, ckpt, batch, ["memory.stash=dense_fp32"]))
            b = totals(memprofile(a, tmp, model, ckpt, batch, ["memory.stash=bitmap_fp32"]))
            print(f"| {model} | {os.path.basename(ckpt) if ckpt else 'init'} | {batch} | {mb(d[0])} | {mb(b[0])} | "
                  f"{pct(b[0], d[0])} | {mb(d[2])} | {mb(b[2])} | {mb(d[1])} | {mb(b[1])} | {pct(b[1], d[1])} |", flush=True)


def fig9b(a, tmp):
    head = "| model | batch | threshold | stash peak MB | vs dense_fp32 % | step USS MB | vs dense_fp32 % |"
    sep = "|---|---:|---:|---:|---:|---:|---:|"
    if a.finetune_epochs > 0:
        head += " test acc % after fine-tune |"
        sep += "---:|"
    print(head)
    print(sep)
    for model, ckpt in a.model:
        d = totals(memprofile(a, tmp, model, ckpt, a.batch, ["memory.stash=dense_fp32"]))
        print(f"| {model} | {a.batch} | dense_fp32 | {mb(d[0])} | 0.0 | {mb(d[1])} | 0.0 |" +
              (f" {100 * finetune(a, tmp, model, ckpt, ['memory.stash=dense_fp32'])['test_acc']:.2f} |"
               if a.finetune_epochs > 0 else ""), flush=True)
        for t in a.thresholds:
            sets = ["memory.stash=bitmap_fp32", f"memory.prune_threshold={t}"]
            b = totals(memprofile(a, tmp, model, ckpt, a.batch, sets))
            acc = f" {100 * finetune(a, tmp, model, ckpt, sets)['test_acc']:.2f} |" if a.finetune_epochs > 0 else ""
            print(f"| {model} | {a.batch} | bitmap {t} | {mb(b[0])} | {pct(b[0], d[0])} | {mb(b[1])} | "
                  f"{pct(b[1], d[1])} |{acc}", flush=True)


def fig11(a, tmp):
    print("| model | batch | checkpoint_every | stash peak MB dense_fp32 | bitmap_fp32 | bitmap vs dense % | "
          "arena MB dense_fp32 | bitmap_fp32 | step USS MB dense_fp32 | bitmap_fp32 | bitmap vs dense % |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, ckpt in a.model:
        for m in a.checkpoint_every:
            d = totals(memprofile(a, tmp, model, ckpt, a.batch, ["memory.stash=dense_fp32", f"memory.checkpoint_every={m}"]))
            b = totals(memprofile(a, tmp, model, ckpt, a.batch, ["memory.stash=bitmap_fp32", f"memory.checkpoint_every={m}"]))
            print(f"| {model} | {a.batch} | {m} | {mb(d[0])} | {mb(b[0])} | {pct(b[0], d[0])} | {mb(d[2])} | {mb(b[2])} "
                  f"| {mb(d[1])} | {mb(b[1])} | {pct(b[1], d[1])} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=["fig7b", "fig9b", "fig11"])
    ap.add_argument("--model", action="append", required=True, help="NAME=CHECKPOINT (NAME alone: initialisation)")
    ap.add_argument("--data-config", default=os.path.join(ROOT, "configs", "resnet20_cifar10.json"),
                    help="config whose data / train sections are used (a run's config.json: no 'auto' pass)")
    ap.add_argument("--set", action="append", default=[], help="a config override for every run (e.g. fusion.enabled=true)")
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--thresholds", default="0,0.01,0.05,0.1")
    ap.add_argument("--checkpoint-every", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--finetune-epochs", type=int, default=0)
    ap.add_argument("--finetune-lr", type=float, default=0.01)
    ap.add_argument("--finetune-batch", type=int, default=128)
    ap.add_argument("--train-subset", type=int, default=0)
    ap.add_argument("--edgetrain", default=os.path.join(ROOT, "build", "edgetrain"))
    a = ap.parse_args()
    a.model = [(m.split("=", 1)[0], m.split("=", 1)[1] if "=" in m else "") for m in a.model]
    a.batches = [int(b) for b in a.batches.split(",")]
    a.thresholds = [float(t) for t in a.thresholds.split(",")]
    a.checkpoint_every = [int(m) for m in a.checkpoint_every.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        {"fig7b": fig7b, "fig9b": fig9b, "fig11": fig11}[a.figure](a, tmp)


if __name__ == "__main__":
    main()
