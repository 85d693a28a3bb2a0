"""Triton kernels, installed as ``jetrl_cli.kernels``: what the ``triton`` GEMM backend of the
precision core runs (``backend: triton`` in a preset's GEMM spec, and ``auto``'s candidate on a GPU).

``kernels/fp8.py`` holds the unified FP8 flow's kernels (fused 1x128 / 128x1 activation quantizer,
128x128 weight quantizer with its transpose, SwiGLU + quantizer, residual add + RMSNorm +
quantizer, blockwise-scaled FP8 GEMM), ``kernels/int8.py`` the
INT8 rollout's (per-row quantizer, INT8 GEMM with its scaling fused), ``kernels/invariant.py`` the
batch-invariant ones, ``kernels/attention.py`` the decode attention that reads an FP8 KV cache as
stored; ``jetrl_cli.precision.gemm`` wraps them as backends. They run on a CUDA GPU, or
anywhere in Triton's interpreter (``TRITON_INTERPRET=1``, slow: that is how CPU tests run them).
``kernels/layouts.py`` (pure torch, importable without Triton) describes the operand layouts
Hopper's blockwise GEMM (``scaled_mm``) consumes, which the quantizers write directly, and converts
reference-quantized operands into them.
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


def quantize(x, spec):
    """The Triton quantizer for ``spec`` -- FP8 1x128 / 128x1 / 128x128 (``fp8.py``) or INT8 with one
    scale per row (``int8.py``) -- with the reference's values, or None where there is none."""
    from jetrl_cli.precision.formats import Format

    if spec.format is Format.INT8:
        from . import int8

        return int8.quantize(x, spec)
    from . import fp8

    return fp8.quantize(x, spec)
