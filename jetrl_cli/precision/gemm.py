"""GEMM backends behind one interface: ``mm(a, b) = a @ b.T`` with both operands K-major.

An operand is either a ``QTensor`` (8-bit data + fp32 scales) or a plain fp32 tensor whose values
were already rounded to the operand's high-precision format (bf16 emulation on CPU). Backends
return the fp32 product; the caller adds the bias and rounds to the GEMM's ``out`` format.

- ``emulated`` (the reference, CPU and GPU): dequantize both operands to fp32, fp32 matmul. Any
  granularity. On CUDA, an all-bf16 GEMM runs as a real bf16 matmul (fp32 accumulation).
- ``scaled_mm``: ``torch._scaled_mm`` for FP8 with per-tensor or per-row scales (runs on CPU too),
  ``torch._int_mm`` (int32 accumulation) for INT8 per-row / per-tensor. Blockwise scales are not
  supported by it: choose ``emulated`` or the ``triton`` kernels for 1x128 / 128x128.
- ``triton``: the blockwise FP8 kernels of ``jetrl_cli.kernels``, loaded on first use (on a CUDA
  GPU, or in Triton's interpreter with ``TRITON_INTERPRET=1``); elsewhere choosing it is a clear error.
- ``te``: a slot for a Transformer Engine integration; until one registers, choosing it is a clear error.

``register_backend(name, backend)`` is the extension point.
"""

from __future__ import annotations

from typing import Protocol, Union

import torch

from ..errors import JetrlError
from .flow import REDUCTION_ON_ROWS, GemmSpec, factorable_scale
from .formats import Block, Format
from .quant import QTensor

Operand = Union[QTensor, torch.Tensor]


class GemmBackend(Protocol):
    name: str

    def check(self, spec: GemmSpec, where: str, gemm: str) -> None:
        """Raise JetrlError naming ``where`` if this backend cannot run ``spec`` as GEMM ``gemm``
        (``fprop``, ``dgrad``, ``wgrad`` or ``rollout.linear``)."""

    def mm(self, a: Operand, b: Operand) -> torch.Tensor:
        """fp32 ``a @ b.T``; a is (M, K), b is (N, K), both already cast per the spec."""


ROW_TILE = 8


def row_invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` whose every output row is bitwise independent of how many rows ``a`` has.

    A rollout decodes one token per sequence (a few rows per GEMM); the trainer scores whole
    sequences (thousands of rows). CPU BLAS picks a different kernel (and summation order) for
    small M, so the same row would come out with different low bits. Padding M to a multiple of
    ``ROW_TILE`` keeps one kernel for all row counts; ``tests/test_engine.py`` checks the property on
    this machine's BLAS. CUDA is left alone (bitwise batch invariance there needs batch-invariant
    kernels, which jetrl does not ship yet).
    """
    m = a.shape[0]
    if a.is_cuda or m % ROW_TILE == 0:
        return torch.mm(a, b.t())
    pad = ROW_TILE - m % ROW_TILE
    return torch.mm(torch.nn.functional.pad(a, (0, 0, 0, pad)), b.t())[:m]


def _values(op: Operand) -> torch.Tensor:
    if isinstance(op, QTensor):
        return op.dequantize(torch.float32)
    return op if op.dtype is torch.float32 else op.float()


class EmulatedBackend:
    """Dequantize, then an fp32 matmul: exact products of the quantized values, fp32 sums."""

    name = "emulated"

    def check(self, spec: GemmSpec, where: str, gemm: str) -> None:
        return None

    def mm(self, a: Operand, b: Operand) -> torch.Tensor:
        if (
            not isinstance(a, QTensor)
            and not isinstance(b, QTensor)
            and a.is_cuda
            and a.dtype == torch.bfloat16
            and b.dtype == torch.bfloat16
        ):
            return torch.matmul(a, b.t()).float()
        return row_invariant_mm(_values(a), _values(b))


class ScaledMMBackend:
    """torch._scaled_mm (FP8) / torch._int_mm (INT8) with per-tensor or per-row scales."""

    name = "scaled_mm"

    def check(self, spec: GemmSpec, where: str, gemm: str) -> None:
        for op, rows in zip((spec.a, spec.b), REDUCTION_ON_ROWS[gemm]):
            if not factorable_scale(op, rows):
                raise JetrlError(
                    f"{where}: backend scaled_mm needs per-tensor or per-row scales that are constant along "
                    f"the reduction dim, not {op.block.name} (use backend: emulated, or triton for blockwise)"
                )

    def mm(self, a: Operand, b: Operand) -> torch.Tensor:
        if not isinstance(a, QTensor):
            return EmulatedBackend().mm(a, b)
        for op in (a, b):  # K-major operands: scales must be one per row (or one in all)
            if op.spec.block not in (Block(0, 0), Block(1, 0)) and op.scale.numel() != 1:
                raise JetrlError(f"backend scaled_mm got an operand with {op.spec.block.name} scales along K")
        m, n = a.data.shape[0], b.data.shape[0]
        # reshape through 1-D: a transposed (1, M) grid has a large stride on its size-1 dim,
        # which _scaled_mm rejects even though the tensor counts as contiguous
        sa = a.scale.reshape(()) if a.scale.numel() == 1 and m != 1 else a.scale.reshape(-1).reshape(m, 1)
        sb = b.scale.reshape(()) if b.scale.numel() == 1 and n != 1 else b.scale.reshape(-1).reshape(1, n)
        if a.spec.format is Format.INT8:
            acc = torch._int_mm(a.data, b.data.t())
            return acc.float() * sa * sb
        if sa.dim() != sb.dim():  # _scaled_mm wants both tensor-wise or both row-wise
            sa = sa.expand(m, 1).contiguous() if sa.dim() == 0 else sa
            sb = sb.expand(1, n).contiguous() if sb.dim() == 0 else sb
        return torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=torch.float32)


class UnavailableBackend:
    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def check(self, spec: GemmSpec, where: str, gemm: str) -> None:
        raise JetrlError(f"{where}: GEMM backend {self.name!r} is not available: {self.why}")

    def mm(self, a: Operand, b: Operand) -> torch.Tensor:
        raise JetrlError(f"GEMM backend {self.name!r} is not available: {self.why}")


_BACKENDS: dict[str, GemmBackend] = {
    "emulated": EmulatedBackend(),
    "scaled_mm": ScaledMMBackend(),
    "triton": UnavailableBackend("triton", "not loaded"),  # replaced by jetrl_cli.kernels on first use
    "te": UnavailableBackend("te", "no Transformer Engine integration is in this release; use 'emulated'"),
}


def register_backend(name: str, backend: GemmBackend) -> None:
    _BACKENDS[name] = backend


def get_backend(name: str) -> GemmBackend:
    if name == "triton" and isinstance(_BACKENDS["triton"], UnavailableBackend):
        from ..kernels import register  # imports triton only when a flow asks for it

        why = register()
        if why is not None:
            _BACKENDS["triton"] = UnavailableBackend("triton", why)
    try:
        return _BACKENDS[name]
    except KeyError:
        raise JetrlError(f"unknown GEMM backend {name!r} (allowed: {', '.join(_BACKENDS)})") from None
