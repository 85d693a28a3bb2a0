"""Number formats and scaling granularities: the vocabulary every precision flow is written in.

Formats
-------
- ``fp8_e4m3`` (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits, max 448, no infinities.
  More precision, less range: the format for weights and activations, and on Hopper for all three
  GEMMs of a linear layer when gradients are scaled finely (1x128 groups).
- ``fp8_e5m2`` (torch.float8_e5m2): 5 exponent bits, 2 mantissa bits, max 57344. More range, less
  precision: the classic choice for gradients under per-tensor scaling.
- ``int8``: symmetric, [-127, 127] (-128 is never produced, so negation is exact).
- ``bf16`` / ``fp32``: unscaled high precision. On a CPU, ``bf16`` is *emulated* as a GPU computes
  it: operands rounded to bfloat16 (round-to-nearest-even), products accumulated in fp32.

Granularities (``Block``)
-------------------------
A scale is shared by one block of a 2-D tensor (M rows, K columns; for activations M = tokens and
K = the reduction dimension). A block is ``(rows, cols)``, where 0 means "the whole extent":

========== ========= ============================================================
name       block     use
========== ========= ============================================================
tensor     (0, 0)    one scale per tensor (vLLM ``fp8`` online, TE delayed scaling)
row        (1, 0)    per token (activations) / per output channel (weights W[N, K])
col        (0, 1)    per column
1x128      (1, 128)  DeepSeek-V3 / Jet-RL activations and gradients, groups along K
128x1      (128, 1)  the transposed groups the weight-gradient GEMM needs (along tokens)
128x128    (128,128) DeepSeek-V3 / vLLM block-FP8 weights
========== ========= ============================================================

Any ``"RxC"`` spelling is accepted (e.g. ``"1x64"``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Format(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"

    @property
    def is_scaled(self) -> bool:
        """True for the 8-bit formats, which carry a scale per block."""
        return self in (Format.FP8_E4M3, Format.FP8_E5M2, Format.INT8)

    @property
    def is_fp8(self) -> bool:
        return self in (Format.FP8_E4M3, Format.FP8_E5M2)

    @property
    def max(self) -> float:
        """Largest finite magnitude of the format (the saturation bound)."""
        return _MAX[self]

    @property
    def short(self) -> str:
        return {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}.get(self.value, self.value)

    def torch_dtype(self):
        if not _DTYPES:  # torch imported on first use (the CLI starts without it), the map built once
            import torch

            _DTYPES.update({Format.FP32: torch.float32, Format.BF16: torch.bfloat16,
                            Format.FP8_E4M3: torch.float8_e4m3fn, Format.FP8_E5M2: torch.float8_e5m2,
                            Format.INT8: torch.int8})
        return _DTYPES[self]

    @classmethod
    def parse(cls, value: str) -> "Format":
        key = str(value).strip().lower()
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            allowed = ", ".join(f.value for f in cls)
            raise ValueError(f"unknown format {value!r} (allowed: {allowed})") from None


_DTYPES: dict = {}  # Format -> torch dtype (``Format.torch_dtype``)

_MAX = {
    Format.FP32: 3.4028234663852886e38,
    Format.BF16: 3.3895313892515355e38,
    Format.FP8_E4M3: 448.0,
    Format.FP8_E5M2: 57344.0,
    Format.INT8: 127.0,
}

_ALIASES = {
    "e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
}


@dataclass(frozen=True)
class Block:
    """The shape of the tile that shares one scale; 0 means the whole extent of that dim."""

    rows: int
    cols: int

    def __post_init__(self):
        if self.rows < 0 or self.cols < 0:
            raise ValueError(f"block dimensions must be >= 0, got {self.rows}x{self.cols}")

    @classmethod
    def parse(cls, value) -> "Block":
        if isinstance(value, Block):
            return value
        if isinstance(value, (list, tuple)) and len(value) == 2:
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):  # int(1.7) would be 1
                raise ValueError(f"expected two whole numbers [rows, cols], got {list(value)!r}")
            return cls(value[0], value[1])
        key = str(value).strip().lower()
        if key in _NAMED_BLOCKS:
            return _NAMED_BLOCKS[key]
        m = re.fullmatch(r"(\d+)x(\d+)", key)
        if not m:
            allowed = ", ".join(_NAMED_BLOCKS) + ", or RxC such as 1x64"
            raise ValueError(f"unknown granularity {value!r} (allowed: {allowed})")
        return cls(int(m.group(1)), int(m.group(2)))

    def resolve(self, m: int, k: int) -> tuple[int, int]:
        """The concrete tile for an (m, k) tensor."""
        return (self.rows or max(m, 1), self.cols or max(k, 1))

    def transposed(self) -> "Block":
        return Block(self.cols, self.rows)

    @property
    def name(self) -> str:
        for name, block in _NAMED_BLOCKS.items():
            if block == self:
                return name
        return f"{self.rows}x{self.cols}"

    def __str__(self) -> str:
        return self.name


# The blockwise FP8 recipe's groups, made once (the GEMM paths compare specs with them at every call)
B1x128, B128x1, B128x128 = Block(1, 128), Block(128, 1), Block(128, 128)

_NAMED_BLOCKS = {
    "tensor": Block(0, 0),
    "row": Block(1, 0),
    "col": Block(0, 1),
    "1x128": B1x128,
    "128x1": B128x1,
    "128x128": B128x128,
}
