#!/usr/bin/env python3
"""Up to which dequantised coefficient magnitude M libjpeg's islow IDCT (jidctint.c) cannot
overflow 32 bits: engine/data/jpeg_idct.cpp runs blocks with every |coefficient x quantiser|
<= 1024 in int32 and all others with libjpeg's 64-bit intermediates, which gives the same bytes
only if no int32 intermediate can overflow below that bound.

Every intermediate of a pass is a linear form of the pass's 8 inputs; its largest magnitude is the
L1 norm of its weights times the inputs' bound. Pass 1 inputs are bounded by M; pass 2 inputs
(pass 1 outputs, descaled by 2^11, plus 1 for the rounding) by what pass 1 gives for M.
    python3 bench/jpeg_idct_bound.py      # prints the bound (1173)
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
    pass1 = max(v.l1(unit) for v in inter)  # per unit of M
    ws = max(v.l1(unit) for v in outs) / 2 ** 11  # pass 1 outputs per unit of M (+1 rounding)
    # Pass 2: each row's 8 inputs are pass 1 outputs (of 8 columns), each <= ws * M + 1.
    pass2 = max(v.l1(unit) for v in inter) * ws
    pass2_rounding = max(v.l1(unit) for v in inter) + 2 ** 17
    bound = min(2 ** 31 / pass1, (2 ** 31 - pass2_rounding) / pass2)
    print(f"pass 1: |intermediate| <= {pass1} M; pass 2: <= {pass2:.0f} M + {pass2_rounding}")
    print(f"no int32 overflow for M < {bound:.0f}")


if __name__ == "__main__":
    main()
