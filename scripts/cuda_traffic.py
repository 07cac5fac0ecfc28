#!/usr/bin/env python3
"""The CUDA kernels' memory traffic, as the CUDA emulator counts it (EDGETRAIN_CUDA_EMU_TRAFFIC,
tests/cuda_emu/emu_traffic.cpp; scripts/cuda_traffic.sh runs a training step with it).

For each kernel: its launches and blocks; the distinct bytes its launches read and wrote in device
memory (each sector once: what it moves to or from DRAM at least, summed over launches); the
sectors its warps' instructions took against the fewest the same bytes need (coalescing: 1.00 is
perfect); in shared memory the wavefronts against the fewest (bank conflicts); and the time the
distinct bytes take at the given DRAM bandwidth, a floor for a kernel bound by memory. Then each
place (source line) whose instructions took 1.5 times the sectors or wavefronts they need, or more.

It is a model of a GPU's memory system, not a measurement: caches, the order blocks run in and
instruction costs are left out. What it is for: a layout that wastes sectors or banks, a kernel
that moves more bytes than its tensors hold, a launch of fewer blocks than the GPU has SMs.

  python3 scripts/cuda_traffic.py FILE... [--bandwidth GB/s] [--sms N] [--top N]
"""
import argparse
import collections
import sys

KINDS_GLOBAL = ("load", "store", "atomic")


def read(paths):
    kernels = collections.defaultdict(lambda: [0, None, 0, 0, 0, 0])  # launches, bmin, bmax, threads, rd, wr
    places = collections.defaultdict(lambda: [0, 0, 0, 0, 0])  # requests, lanes, bytes, units, ideal
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            sys.exit(f"cuda_traffic: cannot read {path}: {e.strerror}")
        for n, line in enumerate(lines, 1):
            f = line.split("\t")
            if f[0] == "K" and len(f) == 8:
                k = kernels[f[1]]
                launches, bmin, bmax, threads, rd, wr = map(int, f[2:])
                k[0] += launches
                k[1] = bmin if k[1] is None else min(k[1], bmin)
                k[2] = max(k[2], bmax)
                k[3] = max(k[3], threads)
                k[4] += rd
                k[5] += wr
            elif f[0] == "P" and len(f) == 9:
                p = places[(f[1], f[2], f[8])]
                for i, v in enumerate(map(int, f[3:8])):
                    p[i] += v
            else:
                sys.exit(f"cuda_traffic: {path}:{n}: not a line of EDGETRAIN_CUDA_EMU_TRAFFIC's format: {line[:80]!r}")
    return kernels, places


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--bandwidth", type=float, default=4800.0,
                    help="DRAM GB/s for the time floor (default 4800: an H200; an H100 SXM has 3350)")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (default 132: H100 / H200 SXM)")
    ap.add_argument("--top", type=int, default=40, help="kernels listed (default 40)")
    a = ap.parse_args()
    kernels, places = read(a.files)
    if not kernels:
        sys.exit("cuda_traffic: no kernel in " + ", ".join(a.files))

    per_kernel = collections.defaultdict(lambda: [0, 0, 0, 0])  # global units, ideal; shared units, ideal
    for (kernel, kind, _), p in places.items():
        k = per_kernel[kernel]
        if kind in KINDS_GLOBAL:
            k[0] += p[3]
            k[1] += p[4]
        else:
            k[2] += p[3]
            k[3] += p[4]

    rows = sorted(kernels.items(), key=lambda kv: -(kv[1][4] + kv[1][5]))
    total_bytes = sum(k[4] + k[5] for k in kernels.values())
    print(f"{'kernel':<44} {'launches':>8} {'blocks':>13} {'thr':>5} {'DRAM MB':>9} {'floor us':>9}"
          f" {'L2 MB':>9} {'sectors':>8} {'banks':>6}")
    for name, k in rows[:a.top]:
        launches, bmin, bmax, threads, rd, wr = k
        g = per_kernel[name]
        sectors = f"{g[0] / g[1]:.2f}" if g[1] else "-"
        banks = f"{g[2] / g[3]:.2f}" if g[3] else "-"
        blocks = f"{bmin}-{bmax}" if bmin != bmax else str(bmin)
        if bmin < a.sms:
            blocks = "*" + blocks
        mb = (rd + wr) / 1e6
        print(f"{name[:44]:<44} {launches:>8} {blocks:>13} {threads:>5} {mb:>9.2f} "
              f"{(rd + wr) / (a.bandwidth * 1e3):>9.1f} {g[0] * 32 / 1e6:>9.2f} {sectors:>8} {banks:>6}")
    if len(rows) > a.top:
        print(f"({len(rows) - a.top} more kernels, {sum(k[4] + k[5] for _, k in rows[a.top:]) / 1e6:.2f} MB)")
    print(f"all kernels: {total_bytes / 1e6:.2f} MB of distinct bytes, a floor of "
          f"{total_bytes / (a.bandwidth * 1e3):.1f} us at {a.bandwidth:.0f} GB/s")
    print(f"L2 MB: the sectors its warps' instructions took, x 32 bytes (what the SMs fetch without L1 hits); "
          f"sectors: those against the fewest for the same bytes (1.00 = coalesced); banks: shared-memory "
          f"wavefronts against the fewest (1.00 = no bank conflict); * = a launch of fewer blocks than {a.sms} SMs")

    worst = []
    for (kernel, kind, place), p in places.items():
        requests, lanes, nbytes, units, ideal = p
        if ideal and units >= 1.5 * ideal:
            worst.append((units - ideal, kernel, kind, place, units / ideal, requests, lanes))
    if worst:
        print("\nplaces that take 1.5x the sectors (or wavefronts) their bytes need, most wasted first:")
        for waste, kernel, kind, place, ratio, requests, lanes in sorted(worst, reverse=True)[:30]:
            unit = "sectors" if kind in KINDS_GLOBAL else "wavefronts"
            print(f"  {ratio:5.2f}x  {kernel} {kind} at {place}: {requests} instructions, "
                  f"{lanes / max(1, requests):.1f} lanes each, {waste} {unit} more than needed")


if __name__ == "__main__":
    main()
