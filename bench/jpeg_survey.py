#!/usr/bin/env python3
"""What kinds of JPEG a folder holds: frame type (baseline / extended / progressive / ...),
components and sampling factors, restart intervals, JFIF / Adobe markers, sizes.

Reads the markers itself (no PIL), so it runs anywhere:
    bench/jpeg_survey.py /work/shared/data/cifar10
"""
import collections
import os
import sys

SOF_NAMES = {0xC0: "baseline", 0xC1: "extended-huffman", 0xC2: "progressive-huffman", 0xC3: "lossless",
             0xC5: "diff-sequential", 0xC6: "diff-progressive", 0xC7: "diff-lossless",
             0xC9: "extended-arithmetic", 0xCA: "progressive-arithmetic", 0xCB: "lossless-arithmetic",
             0xCD: "diff-seq-arith", 0xCE: "diff-prog-arith", 0xCF: "diff-lossless-arith"}


def survey(data):
    """Marker walk up to the first SOS: a dict of what the header says."""
    info = {"restart": 0, "app": set(), "scans": 0}
    if data[:2] != b"\xff\xd8":
        info["kind"] = "not-jpeg"
        return info
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            at += 1
            continue
        m = data[at + 1]
        if m in (0xFF, 0x00) or 0xD0 <= m <= 0xD8:
            at += 1 if m == 0xFF else 2
            continue
        if m == 0xD9:
            break
        length = data[at + 2] << 8 | data[at + 3]
        seg = data[at + 4:at + 2 + length]
        if m in SOF_NAMES:
            info["kind"] = SOF_NAMES[m]
            info["precision"] = seg[0]
            info["height"] = seg[1] << 8 | seg[2]
            info["width"] = seg[3] << 8 | seg[4]
            n = seg[5]
            info["sampling"] = ",".join(f"{seg[6 + 3 * i + 1] >> 4}x{seg[6 + 3 * i + 1] & 15}" for i in range(n))
            info["components"] = n
        elif m == 0xDD:
            info["restart"] = seg[0] << 8 | seg[1]
        elif 0xE0 <= m <= 0xEF:
            tag = bytes(seg[:5]).split(b"\0")[0].decode("latin1", "replace")
            info["app"].add(f"APP{m - 0xE0}:{tag}")
        elif m == 0xDA:
            info["scans"] += 1
            # Skip the entropy-coded data: to the next marker that is not a stuffed byte or RSTn.
            at += 2 + length
            while at + 1 < len(data) and not (data[at] == 0xFF and data[at + 1] not in (0x00,) and
                                              not 0xD0 <= data[at + 1] <= 0xD7):
                at += 1
            continue
        at += 2 + length
    return info


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "/work/shared/data/cifar10"
    counts = collections.Counter()
    sizes = collections.Counter()
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            if not f.lower().endswith((".jpg", ".jpeg")):
                continue
            with open(os.path.join(d, f), "rb") as fh:
                info = survey(fh.read())
            n += 1
            key = (info.get("kind"), info.get("precision"), info.get("components"), info.get("sampling"),
                   f"restart={info['restart']}", f"scans={info['scans']}", " ".join(sorted(info["app"])))
            counts[key] += 1
            sizes[(info.get("width"), info.get("height"))] += 1
    print(f"{n} JPEG files under {root}")
    for key, c in counts.most_common():
        print(f"{c:8d}  " + "  ".join(str(k) for k in key))
    print("sizes (w, h):", ", ".join(f"{k}: {v}" for k, v in sizes.most_common(5)))


if __name__ == "__main__":
    main()
