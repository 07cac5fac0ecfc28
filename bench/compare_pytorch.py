#!/usr/bin/env python3
"""edgetrain vs PyTorch (CPU): full training-step throughput and process memory (USS).

For each (model, batch) it runs, back to back and alternating, each in its own process:
  1. edgetrain:      build/edgetrain bench step --config <model config> --set train.threads=2 ...
  2. torch:          this script as a worker (--torch-worker MODEL BATCH STEPS), PyTorch as shipped
  3. torch+jemalloc: the same worker with LD_PRELOAD=libjemalloc.so.2 (skipped when not installed)
--reps times each, and reports medians over the repetitions.

A training step is zero_grad, forward, mean softmax cross-entropy, backward, SGD with momentum
and weight decay (the config's values), on synthetic N(0,1) images and uniform labels, as in
`edgetrain bench step`. The PyTorch models are bench/torch_models.py (replicas of our builders).
Memory: USS = Private_Clean + Private_Dirty + Private_Hugetlb of /proc/self/smaps_rollup, peak
over samples taken after each forward (after the loss) and after each optimizer step; step USS = peak minus the USS just before
the model was built (and, for torch, after `import torch`), as edgetrain reports it.

  /usr/bin/python3 bench/compare_pytorch.py                       # resnet20, vgg16_bn x 32, 128
  /usr/bin/python3 bench/compare_pytorch.py --reps 1 --steps 3    # quick check
  /usr/bin/python3 bench/compare_pytorch.py --models resnet56 --batches 64 --steps 10

Ratios: img/s ratios are edgetrain / torch (> 1: edgetrain is faster); memory ratios are
edgetrain / torch (< 1: edgetrain uses less). Timings are noisy when the machine is loaded: the
script prints the load average before and after each row.
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --------------------------------------------------------------------------------------------
# helpers shared by parent and worker


def read_uss_bytes():
    """Private_Clean + Private_Dirty + Private_Hugetlb of this process, in bytes."""
    total = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("Private_Clean", "Private_Dirty", "Private_Hugetlb"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def config_for(model):
    """The config file edgetrain uses for a model (and whose optimizer settings torch copies)."""
    if model == "resnet18":
        name = "resnet18_cifar10.json"
    elif model.startswith("resnet"):
        name = "resnet20_cifar10.json"
    elif model.startswith("vgg"):
        name = "vgg16_bn_cifar10.json"
    elif model == "mobilenetv2":
        name = "mobilenetv2_cifar10.json"
    else:
        raise SystemExit("no config for model %s" % model)
    return os.path.join(ROOT, "configs", name)


def optimizer_settings(model):
    with open(config_for(model)) as f:
        cfg = json.load(f)
    t = cfg.get("train", {})
    # edgetrain bench step uses lr 0.01 (the value does not matter for speed).
    return {
        "lr": 0.01,
        "momentum": float(t.get("momentum", 0.9)),
        "weight_decay": float(t.get("weight_decay", 5e-4)),
        "nesterov": bool(t.get("nesterov", False)),
        "num_classes": int(cfg.get("model", {}).get("num_classes", 10)),
    }


def os_threads():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


# --------------------------------------------------------------------------------------------
# worker: one PyTorch run, one JSON line


def torch_worker(model_name, batch, steps, warmup, threads, seed, finetune="all"):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    import torch  # after the environment is set

    sys.path.insert(0, HERE)
    import torch_models

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    opt_cfg = optimizer_settings(model_name)

    uss_before = read_uss_bytes()
    model = torch_models.build_model(model_name, num_classes=opt_cfg["num_classes"])
    model.train()
    trained = torch_models.freeze(model, finetune)  # finetune.trainable; frozen: requires_grad = False
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, opt_cfg["num_classes"], (batch,))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=opt_cfg["lr"], momentum=opt_cfg["momentum"],
                          weight_decay=opt_cfg["weight_decay"], nesterov=opt_cfg["nesterov"])
    criterion = torch.nn.CrossEntropyLoss()  # mean softmax cross-entropy

    peak = [0]

    def step():
        opt.zero_grad()  # PyTorch 1.13 default (set_to_none=False), as shipped
        loss = criterion(model(x), y)
        peak[0] = max(peak[0], read_uss_bytes())  # after the forward (and the loss)
        loss.backward()
        opt.step()
        peak[0] = max(peak[0], read_uss_bytes())  # and after the update: the peak over the step
        return loss

    for _ in range(warmup):
        step()
    ms = []
    loss = None
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        ms.append((time.perf_counter() - t0) * 1e3)
    median = sorted(ms)[len(ms) // 2]  # the same definition as edgetrain bench step
    out = {
        "model": model_name,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "os_threads": os_threads(),
        "steps": steps,
        "warmup": warmup,
        "step_ms_median": median,
        "step_ms_min": min(ms),
        "step_ms_max": max(ms),
        "img_per_s": batch * 1000.0 / median,
        "peak_uss_mb": peak[0] / 1048576.0,
        "step_uss_mb": max(0, peak[0] - uss_before) / 1048576.0,
        "uss_before_mb": uss_before / 1048576.0,
        "loss": float(loss.item()) if loss is not None else None,
        "jemalloc": "jemalloc" in os.environ.get("LD_PRELOAD", ""),
        "finetune": finetune,
        "trained_tensors": len(trained),
        "torch": torch.__version__,
    }
    if torch.get_num_threads() != threads:
        print("warning: torch uses %d threads, not %d" % (torch.get_num_threads(), threads), file=sys.stderr)
    print(json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------------
# parent


def find_jemalloc():
    pats = ["/usr/lib/*-linux-gnu/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
            "/usr/local/lib/libjemalloc.so.2", "/usr/lib/*-linux-gnu/libjemalloc.so*", "/usr/local/lib/libjemalloc.so*"]
    for p in pats:
        hits = sorted(glob.glob(p))
        if hits:
            return hits[0]
    return None


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return [float("nan")] * 3


def last_json_line(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in output")


def run_child(cmd, env, timeout):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timeout after %ds" % timeout}
    if p.returncode != 0:
        return {"error": "exit %d: %s" % (p.returncode, (p.stderr or p.stdout).strip()[-500:])}
    try:
        r = last_json_line(p.stdout)
    except ValueError as e:
        return {"error": "%s: %s" % (e, p.stdout.strip()[-300:])}
    if "step_ms_min" not in r:  # edgetrain prints "median step X ms (min Y, max Z)" in text only
        m = re.search(r"median step [0-9.]+ ms \(min ([0-9.]+), max ([0-9.]+)\)", p.stdout)
        if m:
            r["step_ms_min"], r["step_ms_max"] = float(m.group(1)), float(m.group(2))
    r["wall_s"] = time.time() - t0
    return r


def default_steps(model):
    # The CIFAR ResNets are cheap; VGG / ResNet-18 / MobileNetV2 steps take seconds on 2 cores.
    cheap = model.startswith("resnet") and model != "resnet18"
    return (20, 3) if cheap else (5, 1)


def med(rs, key):
    vals = [r[key] for r in rs if "error" not in r and key in r]
    return statistics.median(vals) if vals else None


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def ratio(a, b):
    return None if (a is None or b is None or b == 0) else a / b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-worker", nargs=3, metavar=("MODEL", "BATCH", "STEPS"),
                    help="internal: run one PyTorch measurement and print one JSON line")
    ap.add_argument("--models", default="resnet20,vgg16_bn", help="comma-separated (default resnet20,vgg16_bn)")
    ap.add_argument("--batches", default="32,128", help="comma-separated (default 32,128)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each configuration (median reported)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per run (default 20 for the CIFAR ResNets, 5 for VGG/ResNet-18/MobileNetV2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 for the CIFAR ResNets, else 1)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for edgetrain, e.g. memory.stash=bitmap_fp16 (repeatable)")
    ap.add_argument("--edgetrain", default=os.path.join(ROOT, "build", "edgetrain"), help="engine binary")
    ap.add_argument("--no-jemalloc", action="store_true", help="skip the torch+jemalloc runs")
    # jemalloc's default decay hands freed pages back within seconds, and re-faulting them costs
    # more than glibc's behaviour on this VM (measured 65 vs 360 img/s, resnet20 b128); keeping
    # them is what makes it the fast peer (760 img/s). "" runs jemalloc's defaults.
    ap.add_argument("--malloc-conf", default="dirty_decay_ms:-1,muzzy_decay_ms:-1",
                    help="MALLOC_CONF for the jemalloc run (default: never purge dirty pages; '' = jemalloc's defaults)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per child process")
    ap.add_argument("--finetune", default="all",
                    help="finetune.trainable for both engines (ResNets: all, head, last:N); torch freezes the same tensors")
    a = ap.parse_args()

    if a.torch_worker:
        model, batch, steps = a.torch_worker[0], int(a.torch_worker[1]), int(a.torch_worker[2])
        warmup = a.warmup if a.warmup is not None else default_steps(model)[1]
        torch_worker(model, batch, steps, warmup, a.threads, a.seed, a.finetune)
        return 0

    models = [m for m in a.models.split(",") if m]
    batches = [int(b) for b in a.batches.split(",") if b]
    if not os.path.exists(a.edgetrain):
        raise SystemExit("no engine binary at %s (build: cmake -S . -B build -G Ninja && ninja -C build edgetrain)"
                         % a.edgetrain)
    jemalloc = None if a.no_jemalloc else find_jemalloc()
    if jemalloc is None and not a.no_jemalloc:
        print("libjemalloc.so.2 not found (apt-get install libjemalloc2): the torch+jemalloc run is skipped")

    base_env = dict(os.environ)
    for k in ("LD_PRELOAD", "MALLOC_CONF"):
        base_env.pop(k, None)
    base_env["OMP_NUM_THREADS"] = str(a.threads)
    base_env["MKL_NUM_THREADS"] = str(a.threads)
    je_env = dict(base_env)
    if jemalloc:
        je_env["LD_PRELOAD"] = jemalloc
        if a.malloc_conf:
            je_env["MALLOC_CONF"] = a.malloc_conf

    t_start = time.time()
    load0 = loadavg()
    print("machine: %d CPUs, load average %.2f %.2f %.2f; threads %d; reps %d; jemalloc %s"
          % (os.cpu_count() or 0, *load0, a.threads, a.reps, jemalloc or "none"), flush=True)

    engines = ["edgetrain", "torch"] + (["torch+jemalloc"] if jemalloc else [])
    rows = []
    for model in models:
        for batch in batches:
            steps, warmup = default_steps(model)
            if a.steps is not None:
                steps = a.steps
            if a.warmup is not None:
                warmup = a.warmup
            cmds = {
                "edgetrain": ([a.edgetrain, "bench", "step", "--config", config_for(model), "--steps", str(steps),
                               "--warmup", str(warmup), "--set", "model.name=" + model,
                               "--set", "train.batch_size=%d" % batch, "--set", "train.threads=%d" % a.threads,
                               "--set", "train.seed=%d" % a.seed, "--set", "finetune.trainable=" + a.finetune]
                              + [x for kv in a.set for x in ("--set", kv)],
                              base_env),
                "torch": ([sys.executable, os.path.abspath(__file__), "--torch-worker", model, str(batch), str(steps),
                           "--warmup", str(warmup), "--threads", str(a.threads), "--seed", str(a.seed),
                           "--finetune", a.finetune], base_env),
            }
            if jemalloc:
                cmds["torch+jemalloc"] = (cmds["torch"][0], je_env)
            load_a = loadavg()
            results = {e: [] for e in engines}
            for rep in range(a.reps):
                for e in engines:  # alternating, back to back
                    cmd, env = cmds[e]
                    r = run_child(cmd, env, a.timeout)
                    results[e].append(r)
                    if "error" in r:
                        print("  %s %s b%d rep %d: ERROR %s" % (e, model, batch, rep + 1, r["error"]), flush=True)
                    else:
                        print("  %-15s %-10s b%-4d rep %d: %8.1f img/s  %8.1f ms/step  peak USS %7.1f MB  "
                              "step USS %7.1f MB  (threads %s)"
                              % (e, model, batch, rep + 1, r["img_per_s"], r["step_ms_median"], r["peak_uss_mb"],
                                 r["step_uss_mb"], r.get("threads")), flush=True)
            load_b = loadavg()
            row = {"model": model, "batch": batch, "steps": steps, "warmup": warmup, "reps": a.reps,
                   "threads": a.threads, "load_before": load_a, "load_after": load_b}
            for e in engines:
                key = e.replace("+", "_")
                for k in ("img_per_s", "step_ms_median", "peak_uss_mb", "step_uss_mb"):
                    row["%s_%s" % (key, k)] = med(results[e], k)
                ips = [r["img_per_s"] for r in results[e] if "error" not in r]
                row["%s_img_per_s_all" % key] = ips
                mins = [r["step_ms_min"] for r in results[e] if "error" not in r and "step_ms_min" in r]
                # Fastest single step over all reps: the least disturbed by other load on the machine.
                row["%s_best_img_per_s" % key] = batch * 1000.0 / min(mins) if mins else None
                errs = [r["error"] for r in results[e] if "error" in r]
                if errs:
                    row["%s_errors" % key] = errs
                if e != "edgetrain":
                    row["%s_threads" % key] = sorted({r.get("threads") for r in results[e] if "error" not in r})
            for e in engines[1:]:
                key = e.replace("+", "_")
                row["img_per_s_ratio_vs_%s" % key] = ratio(row["edgetrain_img_per_s"], row["%s_img_per_s" % key])
                row["peak_uss_ratio_vs_%s" % key] = ratio(row["edgetrain_peak_uss_mb"], row["%s_peak_uss_mb" % key])
                row["step_uss_ratio_vs_%s" % key] = ratio(row["edgetrain_step_uss_mb"], row["%s_step_uss_mb" % key])
            rows.append(row)
            print("  load average %.2f %.2f %.2f -> %.2f %.2f %.2f" % (*load_a, *load_b), flush=True)

    load1 = loadavg()
    je = bool(jemalloc)
    tv = _torch_version()
    print()
    print("edgetrain vs PyTorch %s, %d threads, median of %d reps (img/s ratio > 1: edgetrain faster; "
          "USS ratio < 1: edgetrain uses less)" % (tv, a.threads, a.reps))
    hdr = ("%-10s %5s | %9s %9s %9s | %7s %7s || %9s %9s %9s | %6s %6s || %9s %9s %9s"
           % ("model", "batch", "et img/s", "pt img/s", "pt+je", "et/pt", "et/ptje",
              "et peak", "pt peak", "pt+je pk", "et/pt", "et/ptje", "et step", "pt step", "pt+je st"))
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print("%-10s %5d | %9s %9s %9s | %7s %7s || %9s %9s %9s | %6s %6s || %9s %9s %9s" % (
            r["model"], r["batch"],
            fmt(r["edgetrain_img_per_s"], ".1f"), fmt(r["torch_img_per_s"], ".1f"),
            fmt(r.get("torch_jemalloc_img_per_s"), ".1f"),
            fmt(r["img_per_s_ratio_vs_torch"], ".2f"), fmt(r.get("img_per_s_ratio_vs_torch_jemalloc"), ".2f"),
            fmt(r["edgetrain_peak_uss_mb"], ".1f"), fmt(r["torch_peak_uss_mb"], ".1f"),
            fmt(r.get("torch_jemalloc_peak_uss_mb"), ".1f"),
            fmt(r["peak_uss_ratio_vs_torch"], ".2f"), fmt(r.get("peak_uss_ratio_vs_torch_jemalloc"), ".2f"),
            fmt(r["edgetrain_step_uss_mb"], ".1f"), fmt(r["torch_step_uss_mb"], ".1f"),
            fmt(r.get("torch_jemalloc_step_uss_mb"), ".1f")))
    print("fastest single step over all reps (img/s; less sensitive to other load than the medians):")
    for r in rows:
        print("%-10s %5d |  et %9s  pt %9s  pt+je %9s |  et/pt %6s  et/ptje %6s" % (
            r["model"], r["batch"], fmt(r["edgetrain_best_img_per_s"], ".1f"), fmt(r["torch_best_img_per_s"], ".1f"),
            fmt(r.get("torch_jemalloc_best_img_per_s"), ".1f"),
            fmt(ratio(r["edgetrain_best_img_per_s"], r["torch_best_img_per_s"]), ".2f"),
            fmt(ratio(r["edgetrain_best_img_per_s"], r.get("torch_jemalloc_best_img_per_s")), ".2f")))
    print("(et = edgetrain, pt = PyTorch as shipped, pt+je = PyTorch with LD_PRELOAD=%s%s; peak = peak USS MB of the "
          "process; step = peak USS minus USS before building the model)"
          % (jemalloc or "-", "" if je else " [skipped]"))
    elapsed = time.time() - t_start
    print("load average at start %.2f %.2f %.2f, at end %.2f %.2f %.2f (%d CPUs): timings are noisy when the "
          "1-minute load exceeds the CPUs minus this benchmark's %d threads; elapsed %.0f s"
          % (*load0, *load1, os.cpu_count() or 0, a.threads, elapsed))
    print(json.dumps({"rows": rows, "load_start": load0, "load_end": load1, "elapsed_s": elapsed,
                      "jemalloc": jemalloc, "cpus": os.cpu_count(), "torch": tv}))
    return 0


def _torch_version():
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120)
        return "torch " + out.stdout.strip()
    except Exception:  # noqa: BLE001
        return "torch ?"


if __name__ == "__main__":
    sys.exit(main())
