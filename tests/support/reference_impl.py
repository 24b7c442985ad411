"""Independent scalar reference implementations (numpy float32, nearest-value search) used to
check the vectorised quantizers. Written from the spec without sharing code with blockscale."""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _all_e4m3():
    vals = []
    for code in range(0x7F):  # 0x00..0x7E positive finite
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


E4M3_GRID = _all_e4m3()


def nearest_even(v: float, grid: list[float]) -> tuple[int, float]:
    """Index and value of the grid point nearest to |v| (v >= 0), ties to the even index, saturating."""
    if v >= grid[-1]:
        return len(grid) - 1, grid[-1]
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - v), i % 2))
    return best, grid[best]


def e4m3_rne(v: float) -> float:
    return nearest_even(v, E4M3_GRID)[1]


def nvfp4_reference(x: np.ndarray, bound: float = 448.0, amax: float | None = None, rule: str = "6",
                    error: str = "mse"):
    """x: float32 [rows, 16*k]. Returns (codes [rows, 16k] uint8 unpacked, scales [rows, k] float, S).

    Blocks are 1x16; outer scale per tensor. rule "6" | "4" | "4over6" (errors summed pairwise
    by halving, as the spec's fixed order).
    """
    x = x.astype(F32)
    amax = F32(np.abs(x).max()) if amax is None else F32(amax)
    S = F32(1.0) if amax == 0 else F32(min(F32(bound * 6) / amax, np.finfo(F32).max))
    inv_s = F32(1) / S
    rows, cols = x.shape
    codes = np.zeros((rows, cols), np.uint8)
    scales = np.zeros((rows, cols // 16), np.float64)

    def encode(block, s):
        s = F32(s)
        e = F32(0) if s == 0 else F32(min(F32(1) / F32(s * inv_s), np.finfo(F32).max))
        cs, xh = [], []
        for v in block:
            y = F32(min(max(F32(v * e), F32(-6)), F32(6)))
            idx, mag = nearest_even(abs(float(y)), E2M1_GRID)
            neg = math.copysign(1.0, float(v)) < 0
            cs.append(idx | (8 if neg else 0))
            xh.append(F32(F32(F32(-mag if neg else mag) * s) * inv_s))
        return cs, xh

    def err(block, xh):
        d = [F32(a - b) for a, b in zip(xh, block)]
        if error == "maxabs":
            return max(abs(v) for v in d)
        t = [F32(v * v) if error == "mse" else F32(abs(v)) for v in d]
        while len(t) > 1:
            h = len(t) // 2
            t = [F32(t[i] + t[i + h]) for i in range(h)]
        return t[0]

    for r in range(rows):
        for b in range(cols // 16):
            block = x[r, 16 * b:16 * b + 16]
            t = F32(F32(np.abs(block).max()) * F32(S * F32(1 / 6)))
            s6 = e4m3_rne(float(min(t, F32(448))))
            s4 = e4m3_rne(float(min(F32(t * F32(1.5)), F32(448))))
            if rule == "6":
                s = s6
            elif rule == "4":
                s = s4
            else:
                c6, x6 = encode(block, s6)
                c4, x4 = encode(block, s4)
                s = s4 if err(block, x4) < err(block, x6) else s6
            c, _ = encode(block, s)
            codes[r, 16 * b:16 * b + 16] = c
            scales[r, b] = s
    return codes, scales, S


def mx_reference(x: np.ndarray, max_elem: float, emax: int, grid: list[float], rule: str = "ceil"):
    """MX along the last dim (multiple of 32). grid: non-negative element values (ascending).

    Returns (values [rows, cols] on the element grid, signed; exponents k [rows, cols/32])."""
    x = x.astype(F32)
    rows, cols = x.shape
    vals = np.zeros((rows, cols), np.float64)
    ks = np.zeros((rows, cols // 32), np.int64)
    for r in range(rows):
        for b in range(cols // 32):
            block = x[r, 32 * b:32 * b + 32].astype(np.float64)
            amax = float(np.abs(block).max())
            if amax == 0:
                k = -127
            elif rule == "ceil":
                k = -127
                while max_elem * 2.0**k < amax:
                    k += 1
                k = min(k, 127)
            else:
                k = max(-127, min(127, math.floor(math.log2(amax)) - emax))
            ks[r, b] = k
            for i, v in enumerate(block):
                _, mag = nearest_even(abs(v) * 2.0**-k, grid)
                vals[r, 32 * b + i] = -mag if math.copysign(1.0, v) < 0 else mag
    return vals, ks


def fp_grid(mbits: int, emin: int, max_val: float) -> list[float]:
    """All non-negative values of a minifloat, ascending."""
    out = set()
    e = emin
    while True:
        for m in range(2**mbits):
            out.add(m * 2.0 ** (emin - mbits))  # subnormals
            v = (1 + m / 2**mbits) * 2.0**e
            if v <= max_val:
                out.add(v)
        if 2.0**e > max_val:
            break
        e += 1
    return sorted(out)
