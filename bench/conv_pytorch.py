#!/usr/bin/env python3
"""Times PyTorch's CPU conv2d passes on the same shapes as bench/bench_conv.cpp (2 threads by default).

forward: F.conv2d; backward-data / backward-weight: torch.ops.aten.convolution_backward with
output_mask (True,False,False) / (False,True,False), i.e. the kernels autograd calls (oneDNN).

  python3 bench/conv_pytorch.py [--filter S] [--reps N] [--batch N] [--threads T] [--ours ours.csv]
--ours takes the CSV of `bench_conv --csv` and prints the per-shape ratios torch_ms / our_ms
(> 1 means we are faster) and weighted per-network totals.
"""
import argparse
import csv
import time

import torch
import torch.nn.functional as F


def all_shapes():
    v = []  # [net, name, C, K, H, R, stride, groups, count]

    def add(net, C, K, H, R, s, gr):
        for e in v:
            if e[0] == net and e[2:8] == [C, K, H, R, s, gr]:
                e[8] += 1
                return
        name = "%s%dx%d_%dto%d_h%d%s" % ("dw" if gr > 1 else "c", R, R, C, K, H, "_s2" if s > 1 else "")
        v.append([net, name, C, K, H, R, s, gr, 1])

    add("resnet20", 3, 16, 32, 3, 1, 1)
    inp, h = 16, 32
    for st, wd in enumerate([16, 32, 64]):
        for b in range(3):
            s = 2 if st > 0 and b == 0 else 1
            add("resnet20", inp, wd, h, 3, s, 1)
            ho = h // s
            add("resnet20", wd, wd, ho, 3, 1, 1)
            if s != 1 or inp != wd:
                add("resnet20", inp, wd, h, 1, s, 1)
            inp, h = wd, ho
    inp, h = 3, 32
    for c in [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0]:
        if c == 0:
            h //= 2
            continue
        add("vgg16", inp, c, h, 3, 1, 1)
        inp = c
    add("mobilenetv2", 3, 32, 32, 3, 1, 1)
    inp, h = 32, 32
    for e, out, n, s0 in [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                          (6, 160, 3, 2), (6, 320, 1, 1)]:
        for b in range(n):
            s = s0 if b == 0 else 1
            hid = inp * e
            add("mobilenetv2", inp, hid, h, 1, 1, 1)
            add("mobilenetv2", hid, hid, h, 3, s, hid)
            ho = (h + 2 - 3) // s + 1
            add("mobilenetv2", hid, out, ho, 1, 1, 1)
            if s == 1 and inp != out:
                add("mobilenetv2", inp, out, h, 1, 1, 1)
            inp, h = out, ho
    add("mobilenetv2", 320, 1280, h, 1, 1, 1)
    return v


def median_ms(reps, f):
    f()
    t = []
    for _ in range(reps):
        a = time.perf_counter()
        f()
        t.append((time.perf_counter() - a) * 1e3)
    t.sort()
    return t[len(t) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", default="")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ours", default="")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (match OMP_NUM_THREADS of bench_conv)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ours = {}
    if a.ours:
        with open(a.ours) as f:
            for r in csv.DictReader(f):
                ours[r["net"] + "/" + r["shape"]] = [float(r["fwd_ms"]), float(r["bwd_data_ms"]), float(r["bwd_weight_ms"])]
    print("torch %s, threads %d, batch %d, median of %d" % (torch.__version__, torch.get_num_threads(), a.batch, a.reps))
    hdr = "%-12s %-26s %3s | %8s %8s %8s | %7s %7s %7s" % ("net", "shape", "n", "fwd", "bwd_d", "bwd_w", "GF fwd", "bwd_d", "bwd_w")
    if ours:
        hdr += " | torch/ours: %5s %5s %5s" % ("fwd", "bwd_d", "bwd_w")
    print(hdr)
    tot_t, tot_o = {}, {}
    with torch.no_grad():
        for net, name, C, K, H, R, s, gr, cnt in all_shapes():
            full = net + "/" + name
            if a.filter not in full:
                continue
            x = torch.randn(a.batch, C, H, H)
            w = torch.randn(K, C // gr, R, R) * 0.1
            pad = R // 2
            y = F.conv2d(x, w, None, s, pad, 1, gr)
            dy = torch.randn_like(y)
            P = y.shape[2]
            tf = median_ms(a.reps, lambda: F.conv2d(x, w, None, s, pad, 1, gr))
            args = (dy, x, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], gr)
            td = median_ms(a.reps, lambda: torch.ops.aten.convolution_backward(*args, [True, False, False]))
            tw = median_ms(a.reps, lambda: torch.ops.aten.convolution_backward(*args, [False, True, False]))
            gf = 2.0 * a.batch * K * P * P * (C // gr) * R * R * 1e-6
            line = "%-12s %-26s %3d | %8.3f %8.3f %8.3f | %7.1f %7.1f %7.1f" % (net, name, cnt, tf, td, tw, gf / tf, gf / td, gf / tw)
            tot_t[net] = tot_t.get(net, 0.0) + cnt * (tf + td + tw)
            if full in ours:
                o = ours[full]
                line += " | %16.2f %5.2f %5.2f" % (tf / o[0], td / o[1], tw / o[2])
                tot_o[net] = tot_o.get(net, 0.0) + cnt * sum(o)
            print(line, flush=True)
    for net, ms in tot_t.items():
        extra = ""
        if net in tot_o:
            extra = "   ours %9.2f ms  torch/ours %.2f" % (tot_o[net], ms / tot_o[net])
        print("total %-12s torch %9.2f ms per batch%s" % (net, ms, extra))


if __name__ == "__main__":
    main()
