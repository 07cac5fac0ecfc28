#!/usr/bin/env python3
"""Why engine/data/jpeg_idct.cpp's plain-int32 path gives libjpeg-turbo's islow IDCT bytes: it
runs a block only when every |coefficient x quantiser| <= 1024 (M) and every pass 1 result is
within +-16383; otherwise libjpeg-turbo's SIMD arithmetic (16-bit lanes) could wrap or saturate,
and the block takes the scalar reference. This computes the largest magnitudes both passes can
reach in between: every intermediate is a linear form of the pass's 8 inputs, bounded by the L1
norm of its weights times the inputs' bound.
    python3 bench/jpeg_idct_bound.py
"""
FIX = dict(c0298=2446, c0390=3196, c0541=4433, c0765=6270, c0899=7373, c1175=9633, c1501=12299,
           c1847=15137, c1961=16069, c2053=16819, c2562=20995, c3072=25172)


class Lin:
    """A linear form: input index -> integer weight."""

    def __init__(self, w):
        self.w = w

    def __add__(self, o):
        w = dict(self.w)
        for k, v in o.w.items():
            w[k] = w.get(k, 0) + v
        return Lin(w)

    def __sub__(self, o):
        return self + o * -1

    def __mul__(self, c):
        return Lin({k: v * c for k, v in self.w.items()})

    def l1(self, bounds):
        return sum(abs(v) * bounds[k] for k, v in self.w.items())


def islow_pass(x):
    """jidctint.c's 1-D pass on inputs x[0..7]: (every intermediate, the 8 outputs)."""
    seen = []

    def r(v):
        seen.append(v)
        return v

    z1 = r((x[2] + x[6]) * FIX["c0541"])
    tmp2 = r(z1 + x[6] * -FIX["c1847"])
    tmp3 = r(z1 + x[2] * FIX["c0765"])
    tmp0 = r((x[0] + x[4]) * 8192)
    tmp1 = r((x[0] - x[4]) * 8192)
    t10, t13, t11, t12 = r(tmp0 + tmp3), r(tmp0 - tmp3), r(tmp1 + tmp2), r(tmp1 - tmp2)
    o0, o1, o2, o3 = x[7], x[5], x[3], x[1]
    z5 = r((o0 + o2 + o1 + o3) * FIX["c1175"])
    y1 = r((o0 + o3) * -FIX["c0899"])
    y2 = r((o1 + o2) * -FIX["c2562"])
    y3 = r(r((o0 + o2) * -FIX["c1961"]) + z5)
    y4 = r(r((o1 + o3) * -FIX["c0390"]) + z5)
    p0 = r(r(o0 * FIX["c0298"]) + y1 + y3)
    p1 = r(r(o1 * FIX["c2053"]) + y2 + y4)
    p2 = r(r(o2 * FIX["c3072"]) + y2 + y3)
    p3 = r(r(o3 * FIX["c1501"]) + y1 + y4)
    outs = [r(t10 + p3), r(t11 + p2), r(t12 + p1), r(t13 + p0), r(t13 - p0), r(t12 - p1), r(t11 - p2), r(t10 - p3)]
    return seen, outs


def main():
    x = [Lin({i: 1}) for i in range(8)]
    inter, outs = islow_pass(x)
    unit = [1] * 8
    l1 = max(v.l1(unit) for v in inter)  # any intermediate, per unit of input bound
    ws = max(v.l1(unit) for v in outs) / 2 ** 11  # a pass 1 result (descaled), per unit of M
    m = 1024
    print(f"pass 1, inputs <= {m}: intermediates <= {l1 * m:,} (int32 < 2,147,483,648); "
          f"results <= {ws * m + 1:,.0f} (16-bit: no saturation below 32,767); 16-bit sums in0+-in4, "
          f"z3, z4 <= {2 * m}")
    w = 16383
    print(f"pass 2, inputs <= {w}: 16-bit sums <= {2 * w}; intermediates <= {l1 * w + 2 ** 17:,} with rounding; "
          f"results <= {(l1 * w + 2 ** 17) / 2 ** 18:,.0f} (no 16-bit saturation before the -128..127 clamp)")
    print(f"pass 1 results stay within +-16383 for any block with M <= {16383 / ws:.0f}; beyond that the "
          f"path checks them")


if __name__ == "__main__":
    main()
