#!/usr/bin/python3
"""Are edgetrain's decoded JPEG pixels PIL's? Decodes every JPEG under ROOT (or the files given)
with PIL (Debian's python3-pil, libjpeg-turbo) and with edgetrain's decoder (build/bench_jpeg
dump) and reports how many images are bit-identical, and the largest pixel difference otherwise.

    /usr/bin/python3 bench/jpeg_exactness.py [--root /work/shared/data/cifar10] [--bin build/bench_jpeg]
    /usr/bin/python3 bench/jpeg_exactness.py --files a.jpg b.jpg ...
    /usr/bin/python3 bench/jpeg_exactness.py --damage 1 --no-simd
    --damage SEED: instead, 55 randomly damaged copies of each file in tests/data/jpeg (bytes
        changed, removed or inserted in the scan data, cut and ended with EOI, header bits flipped)
    --no-simd: PIL with libjpeg-turbo's SIMD off (JSIMD_FORCENONE=1), i.e. its C code, which the
        decoder follows where the SIMD code differs: on corrupt data whose coefficients overflow
        16 bits (the x86 SIMD IDCT saturates, the C code wraps)
Exit status 0 when every image PIL decodes is identical.
"""
import argparse
import glob
import os
import random
import subprocess
import sys
import tempfile


def damaged_copies(seed, out):
    """Randomly damaged copies of the reference files (not the ones PIL or the decoder refuse)."""
    rnd = random.Random(seed)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "jpeg")
    files = []
    for base in sorted(glob.glob(os.path.join(here, "*.jpg"))):
        if os.path.basename(base).startswith(("error_", "unsupported_", "smoothing_")):
            continue
        data = open(base, "rb").read()
        at = 2
        while data[at + 1] != 0xDA:  # to the first scan's data
            at += 2 + (data[at + 2] << 8 | data[at + 3])
        start = at + 2 + (data[at + 2] << 8 | data[at + 3])
        for k in range(55):
            d = bytearray(data)
            kind = k % 6
            if kind == 0:  # bytes changed
                for _ in range(rnd.randint(1, 8)):
                    d[rnd.randrange(start, len(d) - 2)] = rnd.randrange(256)
            elif kind == 1:  # a span removed
                i = rnd.randrange(start, len(d) - 2)
                del d[i:min(len(d) - 2, i + rnd.randint(1, 20))]
            elif kind == 2:  # bytes inserted, markers among them
                i = rnd.randrange(start, len(d) - 2)
                d[i:i] = bytes(rnd.choice([0xFF, 0xD0 + rnd.randrange(8), 0, rnd.randrange(256)])
                               for _ in range(rnd.randint(1, 6)))
            elif kind == 3:  # cut, EOI appended
                d = d[:rnd.randrange(start, len(d) - 2)] + b"\xff\xd9"
            else:  # header bytes or bits
                for _ in range(rnd.randint(1, 2)):
                    i = rnd.randrange(2, start)
                    if rnd.random() < 0.5:
                        d[i] ^= 1 << rnd.randrange(8)
                    else:
                        d[i] = rnd.choice([0, 1, 2, 3, 4, 0x10, 0x11, 0x22, 0xFF, rnd.randrange(256)])
            name = os.path.join(out, f"{os.path.basename(base)[:-4]}_{k}.jpg")
            open(name, "wb").write(bytes(d))
            files.append(name)
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/work/shared/data/cifar10")
    ap.add_argument("--files", nargs="*")
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "build", "bench_jpeg"))
    ap.add_argument("--no-simd", action="store_true")
    ap.add_argument("--damage", type=int, metavar="SEED")
    ap.add_argument("--show", type=int, default=10, help="list at most this many differing files")
    args = ap.parse_args()
    if args.no_simd:
        os.environ["JSIMD_FORCENONE"] = "1"  # read by libjpeg-turbo when PIL first decodes
    from PIL import Image

    damage_dir = tempfile.TemporaryDirectory()
    files = args.files
    if args.damage is not None:
        files = damaged_copies(args.damage, damage_dir.name)
    elif not files:
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(args.root) for f in fs
                       if f.lower().endswith((".jpg", ".jpeg")))
    with tempfile.TemporaryDirectory() as tmp:
        lst, out = os.path.join(tmp, "files.txt"), os.path.join(tmp, "pixels.bin")
        with open(lst, "w") as fh:
            fh.write("\n".join(files) + "\n")
        res = subprocess.run([args.bin, "dump", lst, out], stdout=subprocess.PIPE, text=True, check=True)
        lines = res.stdout.splitlines()
        assert len(lines) == len(files), (len(lines), len(files))
        pixels = open(out, "rb").read()

    counts = {"identical": 0, "different": 0, "unsmoothed (libjpeg smooths)": 0, "edgetrain error": 0, "PIL error": 0,
              "both error": 0}
    max_diff, shown, at = 0, 0, 0
    for f, line in zip(files, lines):
        ours = None
        if line.startswith(("ok ", "smoothed ")):
            w, h, c = map(int, line.split()[1:])
            ours = pixels[at:at + w * h * c]
            at += w * h * c
        try:
            with Image.open(f) as im:
                im.load()
                ref = im.tobytes() if im.mode in ("L", "RGB") else None
                ref_shape = (im.width, im.height, len(im.getbands()))
        except Exception as e:  # PIL refuses the file
            kind = "both error" if line.startswith("error") else "PIL error"
            counts[kind] += 1
            if kind == "PIL error" and shown < args.show:
                print(f"PIL error, edgetrain {line.split()[0]}: {f}: {e}")
                shown += 1
            continue
        if line.startswith("smoothed "):  # jpeg_decode.h: decoded without libjpeg's block smoothing
            counts["unsmoothed (libjpeg smooths)"] += 1
            continue
        if ours is None:
            counts["edgetrain error"] += 1
            if shown < args.show:
                print(f"edgetrain error, PIL decodes it: {line}")
                shown += 1
            continue
        if ref == ours and ref_shape == (w, h, c):
            counts["identical"] += 1
            continue
        counts["different"] += 1
        d = max(abs(a - b) for a, b in zip(ref, ours)) if ref is not None and len(ref) == len(ours) else 255
        max_diff = max(max_diff, d)
        if shown < args.show:
            n = sum(a != b for a, b in zip(ref, ours)) if ref is not None and len(ref) == len(ours) else -1
            print(f"differs: {f} ({w}x{h}x{c}, PIL {ref_shape}): {n} values, max |diff| {d}")
            shown += 1
    print(f"{len(files)} files: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k == "identical"))
    decodable = len(files) - counts["PIL error"] - counts["both error"] - counts["unsmoothed (libjpeg smooths)"]
    print(f"bit-identical to PIL{' (SIMD off)' if args.no_simd else ''}: {counts['identical']} of "
          f"{decodable} that PIL decodes without block smoothing; max |diff| otherwise {max_diff}")
    return 0 if counts["identical"] == decodable else 1


if __name__ == "__main__":
    sys.exit(main())
