"""The memory layouts a blockwise-scaled FP8 GEMM on Hopper consumes, in pure torch (no Triton).

``torch.nn.functional.scaled_mm`` (torch >= 2.10; the checks are ``meta_scaled_mm_v2`` in
``torch/_meta_registrations.py``) computes ``out (M, N) = A (M, K) @ B (K, N)`` with A row-major
FP8 and B column-major FP8, i.e. ``B = b.t()`` for a row-major ``b`` of shape (N, K). Both operands
are *K-major*: ``a`` (M, K) and ``b`` (N, K) with K contiguous, which is how jetrl's GEMM backends
already see them (``mm(a, b) = a @ b.T``). The scale grids must be laid out as follows (K is the
reduction dim, ``L4 = round_up(ceil(K / 128), 4)``):

============ ============================= ==================== ===================================
granularity  what scaled_mm is passed      shape, strides       memory
============ ============================= ==================== ===================================
1x128 (a)    ``scale_a``                   (M, K/128), (1, M)   column-major: the M scales of one
                                                                K-group are contiguous
1x128 (b)    ``scale_b``                   (N, K/128), (1, N)   the same, for b (Wgrad's B)
128x128 (b)  ``scale_b``                   (L4, N/128), (1, L4) a contiguous (N/128, L4) buffer
                                                                whose first K/128 columns hold the
                                                                block scales, transposed
============ ============================= ==================== ===================================

The kernels' epilogue reads the scales of one K-group for a whole tile of rows at once, so a group's
scales are contiguous; the 128x128 grid is padded to a multiple of 4 K-groups (16 bytes) per row.

The *GEMM layout* of a jetrl ``QTensor`` is therefore (``is_gemm_layout`` checks it):

- ``data``: (R, K) row-major (K-major), FP8;
- 1x128: ``scale`` (R, ceil(K/128)) with strides (1, R);
- 128x128: ``scale`` (ceil(R/128), ceil(K/128)), a view with strides (L4, 1) into a contiguous
  (ceil(R/128), L4) buffer whose pad entries are 1.0 (``scale_buffer`` returns the whole buffer).

The scale *values* are the reference's (``jetrl_cli.precision.quant``); only their strides differ,
so ``dequantize`` and every other QTensor consumer works unchanged. The three GEMMs of a linear layer
``y = x @ W.T`` (x: T x K, W: N x K, dy: T x N) take these operands:

- Fprop ``y = x @ W.T``: a = x, 1x128 (groups along K); b = W, 128x128.
- Dgrad ``dx = dy @ W``: a = dy, 1x128 (groups along N); b = W^T (K, N) row-major, 128x128 (the
  block grid is transpose-symmetric: the same scale values on the transposed grid, padded for N).
- Wgrad ``dW = dy^T @ x`` (reduction over tokens T): a = dy^T (N, T), b = x^T (K, T), both 1x128
  along T = the 128x1 quantization of dy and x, transposed. T is padded with zeros to a multiple of
  128 (``pad_k_to``): zero rows change no amax, so the scales stay the reference's and the product
  is unchanged. A 128-group made only of padding gets the scale of an all-zero group.

``to_gemm_layout`` turns a reference ``QTensor`` into this layout (for backends that quantize with
the reference); the Triton quantizers of ``kernels/fp8.py`` write it directly. ``pad_rows`` pads a
1x128 operand a's rows to a multiple of 4 for ``scaled_mm`` (a decode step's or a prefill's M can be
any number; the strides torch checks are then (1, round_up(M, 4))). ``scaled_mm_scale``
gives the tensor to pass as ``scale_a`` / ``scale_b`` to ``scaled_mm`` or to the older
``torch._scaled_mm``. scaled_mm itself wants K (and N for 128x128 b) to be multiples of 128.
"""

from __future__ import annotations

import torch

from jetrl_cli.precision.formats import Block
from jetrl_cli.precision.quant import CastSpec, QTensor, compute_scale

GROUP = 128
ROW_GROUP = Block(1, GROUP)
SQUARE = Block(GROUP, GROUP)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def padded_groups(k: int) -> int:
    """``L4``: the K-groups of one row of a 128x128 scale buffer, padded to a multiple of 4."""
    return round_up(cdiv(k, GROUP), 4)


def zero_group_scale(spec: CastSpec) -> float:
    """The reference scale of an all-zero group (amax floored): that of groups made of padding."""
    return float(compute_scale(torch.zeros(1, 1), spec))


def _check_k_major(q: QTensor, where: str) -> None:
    if q.data.dim() != 2 or q.spec.block not in (ROW_GROUP, SQUARE):
        raise ValueError(f"{where}: takes a 2-D QTensor with 1x128 or 128x128 scales along its last dim, got "
                         f"{q.spec.block.name} of shape {tuple(q.data.shape)} (a 128x1 operand is q.t())")


def is_gemm_layout(q: QTensor) -> bool:
    """True if ``q`` is laid out as the blockwise GEMM consumes it (module docstring)."""
    if q.data.dim() != 2 or q.spec.block not in (ROW_GROUP, SQUARE):
        return False
    r, k = q.data.shape
    if not q.data.is_contiguous():
        return False
    s = q.scale
    if q.spec.block == ROW_GROUP:  # torch's own rule: row stride 1 even for one row
        return tuple(s.shape) == (r, cdiv(k, GROUP)) and s.stride(0) == 1 and (
            s.stride(1) == r or (s.shape[1] == 1 and s.stride(1) == 1))
    gr, l4 = cdiv(r, GROUP), padded_groups(k)
    room = s.untyped_storage().nbytes() // s.element_size() - s.storage_offset()
    return tuple(s.shape) == (gr, cdiv(k, GROUP)) and (s.stride(1) == 1 or s.shape[1] == 1) and (
        s.stride(0) == l4 or gr == 1) and room >= gr * l4


def scale_buffer(q: QTensor) -> torch.Tensor:
    """The whole contiguous (ceil(R/128), L4) buffer a 128x128 GEMM-layout scale is a view into."""
    if q.spec.block != SQUARE or not is_gemm_layout(q):
        raise ValueError("scale_buffer: takes a 128x128 QTensor in the GEMM layout (see to_gemm_layout)")
    return _scale_buffer(q)


def _scale_buffer(q: QTensor) -> torch.Tensor:
    """``scale_buffer`` of a ``q`` known to be a 128x128 QTensor in the GEMM layout."""
    gr, l4 = q.scale.shape[0], padded_groups(q.data.shape[1])
    return q.scale.as_strided((gr, l4), (l4, 1))


def to_gemm_layout(q: QTensor, pad_k_to: int = 1) -> QTensor:
    """``q`` (1x128 or 128x128 along its last dim K) with data K-major and scales in the GEMM layout.

    The last dim is padded with zeros to a multiple of ``pad_k_to`` (Wgrad's token dim: 128); a group
    made only of padding gets the scale of an all-zero group. Values are ``q``'s, bit for bit."""
    _check_k_major(q, "to_gemm_layout")
    if pad_k_to < 1:
        raise ValueError(f"to_gemm_layout: pad_k_to must be >= 1, got {pad_k_to}")
    r, k = q.data.shape
    kp = round_up(k, pad_k_to)
    data = q.data.contiguous()
    if kp != k:
        data = torch.cat([data.view(torch.uint8), torch.zeros((r, kp - k), dtype=torch.uint8, device=data.device)],
                         dim=1).view(q.data.dtype)
    gk, gkp = cdiv(k, GROUP), cdiv(kp, GROUP)
    fill = zero_group_scale(q.spec)
    if q.spec.block == ROW_GROUP:
        buf = torch.full((gkp, r), fill, dtype=torch.float32, device=q.scale.device)
        buf[:gk] = q.scale.t()
        return QTensor(data, buf.t(), q.spec)
    gr = cdiv(r, GROUP)
    buf = torch.ones((gr, padded_groups(kp)), dtype=torch.float32, device=q.scale.device)
    buf[:, gk:gkp] = fill  # groups made only of padding
    buf[:, :gk] = q.scale
    return QTensor(data, buf[:, :gkp], q.spec)


ROW_ALIGN = 4  # the rows of a 1x128 operand a scaled_mm is given: a multiple of this (16-byte scale columns)


def pad_rows(q: QTensor, multiple: int = ROW_ALIGN) -> QTensor:
    """A 1x128 GEMM-layout ``q`` with its rows padded to a multiple of ``multiple``: zero rows with
    scale 1 (the rows of a product are independent, so the first rows' results are unchanged and
    the caller slices them off). A scale grid whose columns (one per K-group, R values each) start
    on 16-byte boundaries -- what a Hopper GEMM that loads them with TMA needs, and what vLLM pads
    a decode step's M for before cuBLASLt's blockwise FP8 GEMM. ``q`` itself when aligned."""
    if q.spec.block != ROW_GROUP or not is_gemm_layout(q):
        raise ValueError("pad_rows: takes a 1x128 QTensor in the GEMM layout (see to_gemm_layout)")
    return _pad_rows(q, multiple)


def _pad_rows(q: QTensor, multiple: int = ROW_ALIGN) -> QTensor:
    """``pad_rows`` of a ``q`` known to be a 1x128 QTensor in the GEMM layout."""
    r = q.data.shape[0]
    rp = round_up(r, multiple)
    if rp == r:
        return q
    data = torch.nn.functional.pad(q.data.view(torch.uint8), (0, 0, 0, rp - r)).view(q.data.dtype)
    scale = torch.nn.functional.pad(q.scale.t(), (0, rp - r), value=1.0).t()  # (rp, K/128), strides (1, rp)
    return QTensor(data, scale, q.spec)


def scaled_mm_scale(q: QTensor, operand: str, api: str = "v2") -> torch.Tensor:
    """The tensor to pass as ``scale_a`` (operand "a") or ``scale_b`` ("b") for a GEMM-layout ``q``.

    ``api="v2"``: ``torch.nn.functional.scaled_mm`` (recipes BlockWise1x128 / BlockWise128x128).
    ``api="legacy"``: ``torch._scaled_mm`` (torch < 2.10), which wants ``scale_b`` as (K/128, N) or
    (K/128, N/128): the transposed grid (unpadded shape; strides (1, L4) for 128x128)."""
    if operand not in ("a", "b") or api not in ("v2", "legacy"):
        raise ValueError(f"scaled_mm_scale: operand is 'a' or 'b' and api 'v2' or 'legacy', got {operand!r}, {api!r}")
    if not is_gemm_layout(q):
        raise ValueError("scaled_mm_scale: the QTensor is not in the GEMM layout (use to_gemm_layout)")
    return _scaled_mm_scale(q, operand, api)


def _scaled_mm_scale(q: QTensor, operand: str, api: str) -> torch.Tensor:
    """``scaled_mm_scale`` of a ``q`` known to be in the GEMM layout, arguments known valid. A GEMM
    checks each operand's layout once and calls this (each check reads a dozen tensor attributes:
    on the H200's host, 1904 checks took 18 ms of a 1.5B-shape FP8 update, six per GEMM)."""
    if operand == "a":
        if q.spec.block == SQUARE and api == "v2":
            return _scale_buffer(q).t()  # (L4, M/128), strides (1, L4): BlockWise128x128 as a
        return q.scale
    if api == "legacy":
        return q.scale.t()
    return _scale_buffer(q).t() if q.spec.block == SQUARE else q.scale
