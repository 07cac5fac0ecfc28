#!/usr/bin/python3
"""Runs an exported ONNX model (`edgetrain export --format onnx`) in an independent runtime, OpenCV's
DNN module (Debian's python3-opencv), on CIFAR-10 test images and compares its logits with the ones
`edgetrain eval --predictions CSV` writes for the same images.

  compare: an ONNX file and an eval CSV of a CIFAR-10 binary test split (tests/onnx_test.sh):
    /usr/bin/python3 bench/onnx_check.py compare model.onnx eval.csv --cifar DATA_ROOT

  run: the whole check for a checkpoint (export, eval, runtime, comparison) on a data set in
  either format; an image folder's test JPEGs are decoded once by OpenCV into a CIFAR-10 binary
  test_batch.bin in --work, which both edgetrain eval and the runtime then read, so the two see the
  same pixels whatever their JPEG decoders do:
    /usr/bin/python3 bench/onnx_check.py run --edgetrain build/edgetrain \\
        --checkpoint RUN/checkpoint_last.ckpt --data ../shared/data/cifar10

The images go in as the exported graph expects them: float32 NCHW, RGB pixel values / 255 (the
normalisation is inside the graph). Prints the largest absolute logit difference, the same relative
to the logits' scale (max(1, max |logit|)), and the share of images with the same predicted class;
the last line is a JSON object. Exits 1 if the relative difference exceeds --tol, or a prediction
differs where edgetrain's top two logits are further apart than that tolerance (a near tie may
flip); 2 for bad input. The eval must cover the whole test file in order (no data.test_subset).
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def fail(msg):
    print(f"onnx_check: {msg}", file=sys.stderr)
    sys.exit(2)


def load_cifar_test(root):
    path = os.path.join(root, "test_batch.bin")
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        fail(f"cannot read {path}: {e}")
    if raw.size == 0 or raw.size % 3073:
        fail(f"{path} is not a CIFAR-10 binary file ({raw.size} bytes)")
    rec = raw.reshape(-1, 3073)
    return rec[:, 1:].reshape(-1, 3, 32, 32), rec[:, 0].astype(np.int64)


def load_predictions(path):
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        fail(f"cannot read {path}: {e}")
    if not rows or rows[0][:3] != ["index", "label", "predicted"]:
        fail(f"{path} is not an `edgetrain eval --predictions` file")
    body = np.array(rows[1:], dtype=np.float64)
    return body[:, 1].astype(np.int64), body[:, 3:].astype(np.float32)


def folder_to_cifar_bin(root, out_dir):
    """test/<class>/*.jpg|png (classes in sorted order = labels, as edgetrain's image_folder) ->
    out_dir/test_batch.bin, decoded by OpenCV (BGR -> RGB), 32x32 only."""
    import cv2
    test = os.path.join(root, "test")
    classes = sorted(d for d in os.listdir(test) if os.path.isdir(os.path.join(test, d)))
    records = []
    for label, c in enumerate(classes):
        for name in sorted(os.listdir(os.path.join(test, c))):
            if not name.lower().endswith((".jpg", ".jpeg", ".png", ".bmp")):
                continue
            img = cv2.imread(os.path.join(test, c, name), cv2.IMREAD_COLOR)
            if img is None or img.shape != (32, 32, 3):
                fail(f"{os.path.join(test, c, name)}: not a 32x32 colour image")
            chw = img[:, :, ::-1].transpose(2, 0, 1)  # RGB, channel-major as CIFAR-10's records
            records.append(np.concatenate([[label], chw.reshape(-1)]).astype(np.uint8))
    np.stack(records).tofile(os.path.join(out_dir, "test_batch.bin"))
    return len(records)


def compare(onnx, predictions, cifar, tol, batch, threads):
    import cv2  # Debian: python3-opencv

    images, labels = load_cifar_test(cifar)
    ref_labels, ref = load_predictions(predictions)
    if len(ref) != len(images) or not np.array_equal(ref_labels, labels):
        fail(f"{predictions} ({len(ref)} images) does not follow {cifar}/test_batch.bin ({len(images)} images) "
             "in order (an eval with data.test_subset?)")
    if threads > 0:
        cv2.setNumThreads(threads)
    net = cv2.dnn.readNetFromONNX(onnx)
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
    n = len(ref)
    out = np.empty((n, ref.shape[1]), dtype=np.float32)
    t0 = time.time()
    for b in range(0, n, batch):
        x = images[b: b + batch].astype(np.float32) / np.float32(255.0)
        net.setInput(x)
        out[b: b + len(x)] = net.forward().reshape(len(x), -1)
    seconds = time.time() - t0
    diff = np.abs(out - ref)
    scale = max(1.0, float(np.abs(ref).max()))
    same = out.argmax(1) == ref.argmax(1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tol * scale  # not a near tie
    r = {
        "runtime": f"opencv {cv2.__version__} dnn",
        "images": int(n),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "logit_scale": scale,
        "max_rel_diff": float(diff.max()) / scale,
        "same_prediction_pct": 100.0 * float(same.mean()),
        "flipped_clear_predictions": int((~same & clear).sum()),
        "onnx_accuracy": float((out.argmax(1) == labels).mean()),
        "edgetrain_accuracy": float((ref.argmax(1) == labels).mean()),
        "tol": tol,
        "onnx_seconds": round(seconds, 2),
    }
    print(f"{n} images through {r['runtime']} in {seconds:.1f} s: max |logit diff| {r['max_abs_diff']:.3g} "
          f"({r['max_rel_diff']:.3g} of the logit scale {scale:.3g}), mean {r['mean_abs_diff']:.3g}; "
          f"same prediction {r['same_prediction_pct']:.2f} %; accuracy ONNX {r['onnx_accuracy']:.4f}, "
          f"edgetrain {r['edgetrain_accuracy']:.4f}", flush=True)
    ok = r["max_rel_diff"] <= tol and r["flipped_clear_predictions"] == 0
    return ok, r


def run(a):
    work = a.work or tempfile.mkdtemp(prefix="onnx_check_")
    os.makedirs(work, exist_ok=True)
    run_dir = os.path.dirname(os.path.abspath(a.checkpoint))
    config = a.config or os.path.join(run_dir, "config.json")
    if os.path.exists(os.path.join(a.data, "test_batch.bin")):
        cifar = a.data
    elif os.path.isdir(os.path.join(a.data, "test")):
        t0 = time.time()
        n = folder_to_cifar_bin(a.data, work)
        print(f"decoded {n} test images of {a.data} with OpenCV into {work}/test_batch.bin "
              f"({time.time() - t0:.1f} s)", flush=True)
        cifar = work
    else:
        fail(f"{a.data} holds neither test_batch.bin nor test/<class>/ folders")
    onnx = os.path.join(work, "model.onnx")
    csv_path = os.path.join(work, "eval.csv")
    for p in (onnx, csv_path):
        if os.path.exists(p):
            os.remove(p)
    cmd = [a.edgetrain, "export", "--checkpoint", a.checkpoint, "--config", config, "--format", "onnx", "--out", onnx]
    if a.keep_bn:
        cmd.append("--keep-bn")
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"export: {time.time() - t0:.1f} s", flush=True)
    t0 = time.time()
    subprocess.run([a.edgetrain, "eval", "--config", config, "--checkpoint", a.checkpoint,
                    "--set", "data.format=cifar10_binary", "--set", f"data.root={cifar}",
                    "--set", "data.test_subset=0", "--predictions", csv_path], check=True)
    print(f"edgetrain eval: {time.time() - t0:.1f} s", flush=True)
    return compare(onnx, csv_path, cifar, a.tol, a.batch, a.threads)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="an ONNX file against an eval CSV of a CIFAR-10 binary test split")
    c.add_argument("onnx")
    c.add_argument("predictions", help="edgetrain eval --predictions CSV of the same test split")
    c.add_argument("--cifar", required=True, help="CIFAR-10 binary folder (test_batch.bin)")
    r = sub.add_parser("run", help="export, eval and compare for a checkpoint")
    r.add_argument("--edgetrain", default="build/edgetrain")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--config", help="the run's config (default: config.json beside the checkpoint)")
    r.add_argument("--data", required=True, help="CIFAR-10: binary folder, or image folder with test/<class>/")
    r.add_argument("--work", help="folder for model.onnx, eval.csv, test_batch.bin (default: a new temp folder)")
    r.add_argument("--keep-bn", action="store_true", help="export BatchNormalization nodes (no folding)")
    for p in (c, r):
        p.add_argument("--tol", type=float, default=1e-4, help="max |logit difference| / max(1, max |logit|)")
        p.add_argument("--batch", type=int, default=100, help="images per runtime call")
        p.add_argument("--threads", type=int, default=0, help="OpenCV threads (0 = its default)")
    a = ap.parse_args()
    try:
        import cv2  # noqa: F401
    except ImportError:
        fail("OpenCV's Python module is missing: apt-get install python3-opencv (and run with /usr/bin/python3)")
    if a.cmd == "compare":
        ok, res = compare(a.onnx, a.predictions, a.cifar, a.tol, a.batch, a.threads)
    else:
        ok, res = run(a)
    print(json.dumps(res))
    if not ok:
        print(f"onnx_check: FAIL: tolerance {a.tol} exceeded or a clear prediction flipped", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
