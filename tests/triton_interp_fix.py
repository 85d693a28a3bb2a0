"""A test-only fix for Triton's interpreter: its fp32 -> fp8 conversion rounds wrongly.

``triton.runtime.interpreter._convert_float`` rounds the mantissa to nearest but drops the carry
into the exponent (31.6 -> 16 instead of 32 in e4m3) and does not saturate. The GPU compiler does
not share this code (it emits cvt instructions), so only interpreted runs are affected. For
downcasts to e4m3 / e5m2 this replaces it by ``ml_dtypes``' conversion (round to nearest even);
every other conversion goes to the original. ``tests/test_kernels.py`` shows the defect with the
original and checks the replacement against torch's own float8 casts.
"""

import contextlib

import numpy as np


@contextlib.contextmanager
def fixed_fp8_conversion():
    import ml_dtypes
    import triton.language as tl
    from triton.runtime import interpreter

    current = interpreter._convert_float
    original = getattr(current, "triton_original", current)  # the unfixed one, even when nested
    targets = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}
    sources = {tl.float32: np.float32, tl.float16: np.float16}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype in targets and (input_dtype in sources or input_dtype == tl.bfloat16):
            if input_dtype == tl.bfloat16:  # held as uint16: widen the bits to fp32 exactly
                x = (np.asarray(input).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                x = np.asarray(input).view(sources[input_dtype])
            return x.astype(targets[output_dtype]).view(np.uint8).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert.triton_original = original
    interpreter._convert_float = convert
    try:
        yield original
    finally:
        interpreter._convert_float = current
