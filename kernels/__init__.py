"""Triton kernels for the unified FP8 flow, installed as ``jetrl_cli.kernels``: the ``triton`` GEMM
backend of the precision core (``backend: triton`` in a preset's GEMM spec).

``kernels/fp8.py`` holds the kernels (fused 1x128 / 128x1 activation quantizer, 128x128 weight
quantizer with its transpose, blockwise-scaled FP8 GEMM); this module wraps them as a backend. They
run on a CUDA GPU, or anywhere in Triton's interpreter (``TRITON_INTERPRET=1``, slow: that is how CPU
tests run them). ``kernels/layouts.py`` (pure torch, importable without Triton) describes the operand
layouts Hopper's blockwise GEMM (``scaled_mm``) consumes, which the quantizers write directly, and
converts reference-quantized operands into them.
"""

from __future__ import annotations

import os


def unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed: pip install triton"
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return ("the Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 to run them in Triton's interpreter, "
                "slowly); use backend: emulated")
    return None


class TritonBackend:
    """Blockwise FP8 GEMM (1x128 / 128x128 scales along K) and its quantizers, in Triton."""

    name = "triton"

    def check(self, spec, where: str, gemm: str) -> None:
        from ..precision.flow import REDUCTION_ON_ROWS
        from ..errors import JetrlError

        for op, rows, which in zip((spec.a, spec.b), REDUCTION_ON_ROWS[gemm], ("a", "b")):
            blk = op.block.transposed() if rows else op.block  # the K-major layout the kernel reads
            if not op.format.is_fp8 or blk.cols != 128 or blk.rows not in (1, 128):
                raise JetrlError(
                    f"{where}: backend triton runs FP8 operands with 1x128 or 128x128 scales along the "
                    f"reduction dim; operand {which} is {op.short_str()} (use backend: emulated or scaled_mm)")

    def cast(self, x, spec):
        from . import fp8

        return fp8.quantize(x, spec)

    def mm(self, a, b):
        from ..precision.gemm import EmulatedBackend
        from ..precision.quant import QTensor
        from . import fp8

        if isinstance(a, QTensor) and isinstance(b, QTensor):
            return fp8.blockwise_mm(a, b)
        return EmulatedBackend().mm(a, b)


def register() -> str | None:
    """Register the backend if it can run here; otherwise return why not."""
    why = unavailable_reason()
    if why is None:
        from ..precision.gemm import register_backend

        register_backend("triton", TritonBackend())
    return why
