"""Triton kernels for the unified FP8 flow, installed as ``jetrl_cli.kernels``.

This is the home of the ``triton`` GEMM backend (fused 1x128 / 128x1 quantizers, 128x128 weight
quantizer, blockwise-scaled FP8 GEMM). No kernel ships in this release: the precision core's
``emulated`` backend is the reference, and selecting ``backend: triton`` in a preset is a clear
error until the kernels register themselves with ``jetrl_cli.precision.register_backend``.
"""
