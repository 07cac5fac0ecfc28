#!/usr/bin/python3
"""Writes the JPEG decoder's test files (tests/data/jpeg/, read by tests/test_jpeg.cpp): small
JPEGs of the kinds edgetrain's decoder handles, each with the pixels PIL decodes from it
(NAME.ppm for RGB, NAME.pgm for gray, binary). CI has no PIL: it reads these.

    apt-get install python3-pil libjpeg-turbo-progs     # PIL; cjpeg for restarts, sampling, scans
    /usr/bin/python3 bench/make_jpeg_references.py [--out tests/data/jpeg]

The files and what the test expects of each, by name:
    NAME.jpg + NAME.ppm/.pgm   decoded exactly as PIL does (damaged_*: corrupt data PIL still
                               decodes, by libjpeg's recovery rules)
    smoothing_*.jpg            progressive with unfinished coefficients, which libjpeg smooths and
                               edgetrain does not; NAME.smoothed.ppm holds PIL's pixels, which the
                               test compares within a tolerance
    unsupported_*.jpg          a kind edgetrain does not decode: a UserError naming the kind
    error_*.jpg                PIL fails on it: a UserError naming the file
Deterministic: the same PIL / libjpeg-turbo give the same bytes.
"""
import argparse
import os
import random
import shutil
import subprocess
import tempfile

from PIL import Image


def synthetic(w, h, seed, gray=False, saturated=False):
    """Gradients, sharp coloured edges and noise: every block has chroma and high frequencies."""
    rnd = random.Random(seed)
    px = []
    for y in range(h):
        for x in range(w):
            edge = 1 if (x * 7 + y * 3) % 23 < 11 else 0
            r = (x * 255 // max(1, w - 1) + rnd.randint(-40, 40)) if not edge else 250 - y * 3
            g = (y * 255 // max(1, h - 1) + rnd.randint(-40, 40)) if edge else 30 + x * 5
            b = ((x + y) * 9 + rnd.randint(-60, 60))
            if saturated:  # pure colours: YCbCr -> RGB hits the clamps
                r, g, b = [(255 if v > 127 else 0) for v in (r, b, g)]
            px.append(tuple(max(0, min(255, v)) for v in (r, g, b)))
    im = Image.new("RGB", (w, h))
    im.putdata(px)
    return im.convert("L") if gray else im


def write_pnm(path_stem, im):
    """The pixels PIL decodes, as binary PPM (RGB) or PGM (L)."""
    assert im.mode in ("RGB", "L"), im.mode
    ext, magic = (".ppm", b"P6") if im.mode == "RGB" else (".pgm", b"P5")
    with open(path_stem + ext, "wb") as f:
        f.write(magic + f"\n{im.width} {im.height}\n255\n".encode() + im.tobytes())


def reference(out, name):
    """Decodes out/name.jpg with PIL and writes its pixels next to it."""
    with Image.open(os.path.join(out, name + ".jpg")) as im:
        im.load()
        write_pnm(os.path.join(out, name), im)


def smoothed_reference(out, name):
    """PIL's pixels of a smoothing_ file (libjpeg's block smoothing in them) as NAME.smoothed.ppm."""
    with Image.open(os.path.join(out, name + ".jpg")) as im:
        im.load()
        write_pnm(os.path.join(out, name + ".smoothed"), im)


def cjpeg(out, name, source, args, tmp):
    src = os.path.join(tmp, name + (".pgm" if source.mode == "L" else ".ppm"))
    write_pnm(src[:-4], source)
    subprocess.run(["cjpeg", *args, "-outfile", os.path.join(out, name + ".jpg"), src], check=True)


def segments(data):
    """(marker, start, end) of each marker segment before the first SOS, and the SOS's."""
    out, at = [], 2
    while at < len(data):
        m = data[at + 1]
        length = data[at + 2] << 8 | data[at + 3]
        out.append((m, at, at + 2 + length))
        if m == 0xDA:
            break
        at += 2 + length
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "jpeg"))
    args = ap.parse_args()
    out = args.out
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    tmp = tempfile.mkdtemp()
    names = []

    def pil(name, im, **save):
        im.save(os.path.join(out, name + ".jpg"), "JPEG", **save)
        names.append(name)

    # PIL's encoder (what a PyTorch user's data is usually written with): qualities, sampling,
    # odd sizes (chroma 1, 2 or 3 samples wide: libjpeg replicates below 3), progressive,
    # optimised Huffman tables, gray.
    pil("q75_420_32x32", synthetic(32, 32, 1), quality=75, subsampling=2)
    pil("q95_444_17x13", synthetic(17, 13, 2), quality=95, subsampling=0)
    pil("q50_422_17x13", synthetic(17, 13, 3), quality=50, subsampling=1)
    pil("q10_420_17x13", synthetic(17, 13, 4), quality=10, subsampling=2)
    pil("q100_420_24x16", synthetic(24, 16, 5), quality=100, subsampling=2)
    pil("q100_444_saturated_16x16", synthetic(16, 16, 6, saturated=True), quality=100, subsampling=0)
    pil("q90_420_saturated_19x11", synthetic(19, 11, 7, saturated=True), quality=90, subsampling=2)
    pil("q90_420_33x1", synthetic(33, 1, 8), quality=90, subsampling=2)
    pil("q90_420_1x33", synthetic(1, 33, 9), quality=90, subsampling=2)
    pil("q90_420_1x1", synthetic(1, 1, 10), quality=90, subsampling=2)
    pil("q90_420_4x4", synthetic(4, 4, 11), quality=90, subsampling=2)
    pil("q90_420_5x3", synthetic(5, 3, 12), quality=90, subsampling=2)
    pil("q85_422_3x5", synthetic(3, 5, 13), quality=85, subsampling=1)
    pil("q85_422_6x2", synthetic(6, 2, 14), quality=85, subsampling=1)
    pil("q75_420_progressive_33x17", synthetic(33, 17, 15), quality=75, subsampling=2, progressive=True)
    pil("q90_444_progressive_optimize_20x20", synthetic(20, 20, 16), quality=90, subsampling=0, progressive=True,
        optimize=True)
    pil("q60_422_progressive_18x26", synthetic(18, 26, 17), quality=60, subsampling=1, progressive=True)
    pil("q75_420_optimize_25x25", synthetic(25, 25, 18), quality=75, subsampling=2, optimize=True)
    pil("gray_q80_17x13", synthetic(17, 13, 19, gray=True), quality=80)
    pil("gray_q70_progressive_23x9", synthetic(23, 9, 20, gray=True), quality=70, progressive=True)

    # No CIFAR-10 images here: the data set stays outside the repository (all 60,000 are compared
    # with PIL by bench/jpeg_exactness.py).

    # cjpeg: restart intervals, the other sampling factors, RGB, multi-scan sequential.
    scans = os.path.join(tmp, "scans")
    src = synthetic(40, 24, 21)

    def cj(name, cj_args, image=src):
        cjpeg(out, name, image, cj_args, tmp)
        names.append(name)

    cj("restart_rows_420_40x56", ["-quality", "80", "-restart", "1"], synthetic(40, 56, 27))
    cj("restart_mcu_420_40x24", ["-quality", "80", "-restart", "1B"])
    cj("restart_progressive_420_40x24", ["-quality", "80", "-restart", "2B", "-progressive"])
    cj("sample_1x2_40x24", ["-quality", "85", "-sample", "1x2,1x1,1x1"])
    cj("sample_2x1_41x23", ["-quality", "85", "-sample", "2x1,1x1,1x1"], synthetic(41, 23, 22))
    cj("sample_4x1_int_upsample_37x9", ["-quality", "85", "-sample", "4x1,1x1,1x1"], synthetic(37, 9, 23))
    cj("sample_mixed_2x2_1x2_1x1_21x19", ["-quality", "85", "-sample", "2x2,1x2,1x1"], synthetic(21, 19, 24))
    cj("sample_1x4_progressive_13x35", ["-quality", "85", "-sample", "1x4,1x1,1x1", "-progressive"],
       synthetic(13, 35, 25))
    cj("rgb_colorspace_20x12", ["-quality", "90", "-rgb"], synthetic(20, 12, 26))
    cj("gray_restart_progressive_30x20", ["-quality", "75", "-restart", "3B", "-progressive", "-grayscale"])
    with open(scans, "w") as f:
        f.write("0;\n2;\n1;\n")  # one sequential scan per component, Cr before Cb
    cj("multiscan_sequential_420_40x24", ["-quality", "80", "-scans", scans])
    with open(scans, "w") as f:  # successive approximation on DC and AC, both refined to the end
        f.write("0,1,2: 0-0, 0, 2;\n0: 1-5, 0, 1;\n1: 1-63, 0, 0;\n2: 1-63, 0, 0;\n0: 6-63, 0, 1;\n"
                "0,1,2: 0-0, 2, 1;\n0,1,2: 0-0, 1, 0;\n0: 1-63, 1, 0;\n")
    cj("progressive_refinement_420_40x24", ["-quality", "90", "-scans", scans])

    # Kinds the decoder declines.
    with open(scans, "w") as f:  # the chroma's AC never sent: libjpeg smooths blocks
        f.write("0,1,2: 0-0, 0, 0;\n0: 1-63, 0, 0;\n")
    cjpeg(out, "smoothing_chroma_dc_only", src, ["-quality", "80", "-scans", scans], tmp)
    cjpeg(out, "unsupported_arithmetic", src, ["-quality", "80", "-arithmetic"], tmp)
    src.convert("CMYK").save(os.path.join(out, "unsupported_cmyk.jpg"), "JPEG", quality=80)

    # Damaged files PIL decodes (libjpeg warns and recovers).
    def damage(name, base, edit):
        data = bytearray(open(os.path.join(out, base + ".jpg"), "rb").read())
        data = edit(data, segments(data)[-1][2])  # (bytes, where the first scan's data starts)
        with open(os.path.join(out, name + ".jpg"), "wb") as f:
            f.write(bytes(data))
        if not name.startswith("smoothing_"):
            names.append(name)

    def rst_positions(data, start):
        return [i for i in range(start, len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]

    damage("damaged_rst_missing", "restart_mcu_420_40x24",
           lambda d, s: d[:rst_positions(d, s)[3]] + d[rst_positions(d, s)[3] + 2:])
    damage("damaged_rst_wrong_number", "restart_rows_420_40x56",
           lambda d, s: d[:rst_positions(d, s)[0] + 1] + bytes([0xD5]) + d[rst_positions(d, s)[0] + 2:])
    damage("damaged_rst_two_missing", "restart_mcu_420_40x24",
           lambda d, s: (lambda p: d[:p[2]] + d[p[2] + 2:p[3]] + d[p[3] + 2:])(rst_positions(d, s)))
    damage("damaged_garbage_before_rst", "restart_rows_420_40x56",
           lambda d, s: (lambda p: d[:p] + b"\x12\x34\xff\x00\x56" + d[p:])(rst_positions(d, s)[1]))
    damage("damaged_early_eoi", "q75_420_32x32", lambda d, s: d[:s + (len(d) - s) // 3] + b"\xff\xd9")
    damage("smoothing_early_eoi_progressive", "q75_420_progressive_33x17",
           lambda d, s: d[:len(d) * 2 // 3] + b"\xff\xd9")

    def flip(d, s):
        rnd = random.Random(99)
        for _ in range(6):
            i = rnd.randrange(s + 4, len(d) - 4)
            if d[i] != 0xFF and d[i - 1] != 0xFF:
                d[i] = (d[i] ^ 0x5A) if (d[i] ^ 0x5A) != 0xFF else 0
        return d

    damage("damaged_flipped_bytes", "q75_420_32x32", flip)
    damage("damaged_flipped_bytes_restart", "restart_mcu_420_40x24", flip)

    def no_dht(d, s):  # Motion-JPEG style: libjpeg-turbo uses Annex K's tables
        for m, a, b in reversed(segments(d)):
            if m == 0xC4:
                d = d[:a] + d[b:]
        return d

    damage("no_dht_standard_tables", "q75_420_32x32", no_dht)

    # Files PIL rejects: an error naming the file.
    data = open(os.path.join(out, "q75_420_32x32.jpg"), "rb").read()
    with open(os.path.join(out, "error_truncated.jpg"), "wb") as f:
        f.write(data[:len(data) * 2 // 3])
    with open(os.path.join(out, "error_truncated_header.jpg"), "wb") as f:
        f.write(data[:100])

    for name in names:
        reference(out, name)
    for name in ("smoothing_chroma_dc_only", "smoothing_early_eoi_progressive"):
        smoothed_reference(out, name)
    shutil.rmtree(tmp)
    print(f"{len(names)} JPEGs with references, plus the smoothing_, unsupported_ and error_ files, in {out}")


if __name__ == "__main__":
    main()
