"""Test-only fixes for Triton's interpreter: its fp32 -> fp8 conversion rounds wrongly, and before
Triton 3.7 its ``tl.fma`` rounds twice (``exact_fma``).

``triton.runtime.interpreter._convert_float`` rounds the mantissa to nearest but drops the carry
into the exponent (31.6 -> 16 instead of 32 in e4m3) and does not saturate. The GPU compiler does
not share this code (it emits cvt instructions), so only interpreted runs are affected. For
downcasts to e4m3 / e5m2 this replaces it by ``ml_dtypes``' conversion (round to nearest even);
every other conversion goes to the original. ``tests/test_kernels.py`` shows the defect with the
original and checks the replacement against torch's own float8 casts.
"""

import contextlib
import os

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


def fma_fp32(x, y, z):
    """IEEE fp32 ``x * y + z`` rounded once (as ``fma.rn.f32``, ``std::fma``), for numpy float32 arrays:
    the product is exact in float64 (24 + 24 bits), the sum is rounded to odd in float64 (its exact
    error by TwoSum; an inexact sum takes the odd one of its two neighbours), and round to odd at 53
    bits, then to nearest even at 24 (or fewer: subnormals), is the sum rounded once."""
    p = np.multiply(x, y, dtype=np.float64)
    zd = np.asarray(z, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + zd
        bp = s - zd
        err = (p - bp) + (zd - (s - bp))  # the sum's exact rounding error (TwoSum)
        inexact = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(inexact, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


@contextlib.contextmanager
def exact_fma():
    """Within the block the interpreter's fp32 ``tl.fma`` rounds once, as a GPU's does (Triton 3.6's
    multiplies, then adds: two roundings, which ``kernels.fp8._quotient``'s corrections cannot take,
    so the kernels divide there instead: ``kernels.fp8.MARKSTEIN``). A no-op where the interpreter's
    is exact already (Triton 3.7 on) or Triton does not interpret."""
    import triton.language as tl
    from triton.runtime import interpreter

    try:
        from triton._C.libtriton import interpreter as native
    except ImportError:
        native = None
    builder = interpreter.InterpreterBuilder
    original = builder.create_fma
    if os.environ.get("TRITON_INTERPRET") != "1" or native is not None and hasattr(native, "fma_fp32"):
        yield
        return

    def create_fma(self, x, y, z):
        if z.dtype.scalar == tl.float32:
            out = fma_fp32(*np.broadcast_arrays(x.data, y.data, z.data))
            return interpreter.TensorHandle(out, z.dtype.scalar)
        return original(self, x, y, z)

    builder.create_fma = create_fma
    try:
        yield
    finally:
        builder.create_fma = original


def install_row_independent_dot() -> None:
    """The interpreter's ``tl.dot`` with each row of the product computed on its own.

    Triton's interpreter computes a tile's ``tl.dot`` as one ``np.matmul`` of the whole tile, and numpy's
    OpenBLAS does not promise that a row's result is independent of the tile's other rows: on an
    AVX2-only CPU (Haswell kernels, 2026-11-29) row 12 of a 64-row fp32 tile and the same values as row
    1 of another tile differed in the last bit of one K block's partial sum (they agreed on the AVX-512
    machine before). A GPU's MMA computes each output from its row and column alone, which is what the
    batch-invariant kernels rely on (a rollout's row in a 2-row tile must give the trainer's in a
    36-row one). So every row is its own ``(1, K) x (K, N)`` product here: the same call, and the same
    bits, whatever the other rows hold or where the row sits. Idempotent; only under
    ``TRITON_INTERPRET=1``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "row_independent", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        if a_data.ndim != 2:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        dt = d.data.dtype
        b_data = np.ascontiguousarray(b_data)
        rows = [np.matmul(np.array(a_data[i:i + 1], copy=True), b_data, dtype=dt) for i in range(a_data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows, axis=0) + d.data, d.dtype.scalar)

    create_dot.row_independent = True
    builder.create_dot = create_dot
