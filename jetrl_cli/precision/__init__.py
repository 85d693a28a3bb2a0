"""The precision core: formats, quantizers, precision flows, GEMM backends and the FP8 linear layer.

Rollout and training both call this package, so the same quantizer produces the same bits on both
sides of an RL step.
"""

from .formats import Block, Format
from .quant import CastSpec, QTensor, dequantize, error_stats, fake_quantize, quantize, round_to

__all__ = [
    "Block",
    "CastSpec",
    "Format",
    "QTensor",
    "dequantize",
    "error_stats",
    "fake_quantize",
    "quantize",
    "round_to",
]

from .flow import (  # noqa: E402
    NAMED_FLOWS,
    GemmSpec,
    KVCacheSpec,
    LinearPrecision,
    PrecisionFlow,
    named_flow,
    parse_flow,
)
from .gemm import backend_report, get_backend, register_backend, resolve  # noqa: E402
from .linear import JetLinear, SwapReport, apply_flow, linear_forward, linear_group, swap_linears  # noqa: E402

__all__ += [
    "NAMED_FLOWS",
    "GemmSpec",
    "JetLinear",
    "KVCacheSpec",
    "LinearPrecision",
    "PrecisionFlow",
    "SwapReport",
    "apply_flow",
    "backend_report",
    "get_backend",
    "linear_forward",
    "linear_group",
    "named_flow",
    "parse_flow",
    "register_backend",
    "resolve",
    "swap_linears",
]
