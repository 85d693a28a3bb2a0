"""An independent, slow reference quantizer: numpy + ml_dtypes, one block at a time in Python.

It shares no code with jetrl_cli.precision.quant: rounding comes from ml_dtypes (not torch's
casts), the power-of-two rounding from math.frexp, the blocking from explicit index loops.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

NP_DTYPE = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
FMT_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}


def pow2_ceil(v: float) -> float:
    mant, exp = math.frexp(v)
    return math.ldexp(1.0, exp - 1) if mant == 0.5 else math.ldexp(1.0, exp)


def reference_quantize(x: np.ndarray, fmt: str, block: tuple[int, int], pow2: bool, floor: float = 1e-12):
    """Returns (data as the format's numpy dtype, or int8; scale float32) for a 2-D float32 array."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    br = block[0] or m
    bc = block[1] or k
    nbr, nbc = -(-m // br), -(-k // bc)
    fmax = np.float32(FMT_MAX[fmt])
    scale = np.zeros((nbr, nbc), dtype=np.float32)
    out = np.zeros((m, k), dtype=np.float32)
    for i in range(nbr):
        for j in range(nbc):
            tile = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            if not np.all(np.isfinite(tile)):
                s = np.float32(np.nan)
            else:
                amax = np.float32(np.max(np.abs(tile))) if tile.size else np.float32(0)
                amax = max(amax, np.float32(floor))
                s = np.float32(amax / fmax)
                if pow2:
                    s = np.float32(pow2_ceil(float(s)))
            scale[i, j] = s
            with np.errstate(invalid="ignore"):
                q = np.clip(tile * (np.float32(1) / s), -fmax, fmax)  # 1 / s rounded once, then a product
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = q
    if fmt == "int8":
        data = np.rint(out)
        data[np.isnan(data)] = 0
        return data.astype(np.int8), scale
    return out.astype(NP_DTYPE[fmt]), scale
