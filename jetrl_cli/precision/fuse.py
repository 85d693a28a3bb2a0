"""Elementwise chains as one kernel each on a GPU: RMSNorm, SwiGLU, RoPE, an 8-bit KV cache's
dequantization, the token logprobs' backward (``torch.compile``).

In eager PyTorch every op of a chain is a kernel that reads and writes a whole tensor: an RMSNorm
is about seven kernels, a SwiGLU seven, RoPE on the queries and keys five, their backward passes
more. A rollout's decode step of a few rows is made of such small kernels -- about 50 per decoder
layer, 1400 per step for a 28-layer model (count them with ``jetrl bench rollout --profile``) --
and pays a launch for each even inside a CUDA graph; training pays their memory traffic over
activations of ``tokens x 2 x intermediate`` fp32 values. ``fused(fn)`` runs ``fn`` through
``torch.compile`` (Inductor: one generated Triton kernel per chain) when its first tensor is on a
GPU. Shapes are dynamic only where they change: a function is compiled first for the sizes it
meets, and again, once, with the dimensions that then changed (tokens, batch rows, key width) as
symbols; feature sizes (hidden, heads, head_dim, intermediate) stay constants. With every size a
symbol (``dynamic=True``, until 2026-11-27) each element's index took integer divisions by
run-time values, and on an H200 the fused RoPE backward ran at 0.13 TB/s (548 us a layer at
16 x 512 tokens of Qwen2.5-1.5B), the SwiGLU backward at under 1 TB/s, of 4.3. The GEMMs, attention and
jetrl's quantizers are not in these functions and do not change. Without autograd (the rollout) a
chain also takes in its neighbours: the residual add before an RMSNorm and the cast to the next
GEMM's input after it, RoPE's cast to what attention reads -- 12 kernels per bf16 decode layer.

What this keeps: the rollout and the trainer call the same compiled functions, so they compute the
same values as each other as before. Bitwise equality on a GPU is ``precision.batch_invariant``'s
job: a model in that mode runs its forward op by op (``suspended``), since a compiled forward and
its autograd twin (the trainer's) need not contract the same multiply-adds; there RoPE and SwiGLU
(``EXACT``) run as one hand-written kernel each whose every operation is the op-by-op one, no
multiply-add contracted (``kernels.invariant``), called alike by the rollout and the trainer (op by op
they were about 13 kernels a decoder layer). What it changes: the last bits of
these functions on a GPU (a fused kernel may contract ``a * b + c`` into one FMA); the CPU path
is untouched -- it stays op by op, as the bitwise CPU emulation needs.

A function is compiled once per variant of its call: which arguments are None, their dtypes, the
grad mode, and a batch or a length of 1 (dynamic shapes still specialise on 0 and 1), times two
where sizes change (the first, static, compilation and the one with those sizes symbolic). One flow's
rollout and training reach 12 variants of ``add_rms_norm``, and four flows in one process (``jetrl
bench``) reach 24, counted on CPU. Dynamo's default limit is 8 per function, and with
``fullgraph=True`` going over it is an error. So the limit is raised to ``RECOMPILE_LIMIT`` (it is
never lowered) when the first function compiles. A variant beyond the limit runs eagerly without
turning fusion off; its function is listed in the report (``eager_variants``).

If compiling fails (a torch build whose Inductor cannot generate code here, say), the functions run
eagerly from then on, and why is kept in ``disabled`` and reported with the GEMM backends
(``metrics.jsonl``'s ``gemm_backends``, bench rows). ``set_enabled(False)`` (``model.fuse: false``)
turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

BACKEND = "inductor"  # tests use "aot_eager": dynamo's tracing and autograd without code generation
RECOMPILE_LIMIT = 64  # compilations per fused function (dynamo's recompile_limit is raised to it)
# dynamo's automatic dynamic shapes: static first, then symbolic in the dimensions that changed
COMPILE_OPTIONS = {"dynamic": None, "fullgraph": True}
_enabled = True
_force = False  # tests: fuse CPU tensors too
disabled: str | None = None  # why fusion stopped (a compilation failed), or None
_compiled: dict = {}
_used: set = set()  # names of the functions that ran compiled
_limited: set = set()  # names of the functions with a variant past the recompile limit (run eagerly)
_local = threading.local()  # .off: this thread's forward runs op by op (``suspended``)


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def set_force(on: bool, backend: str = "inductor") -> None:
    """Tests: fuse CPU tensors too, compiling with ``backend``; resets what was compiled."""
    global _force, BACKEND, disabled
    _force, BACKEND, disabled = bool(on), backend, None
    _compiled.clear()
    _used.clear()
    _limited.clear()
    torch._dynamo.reset()


@contextlib.contextmanager
def suspended(on: bool = True):
    """Within: the fused functions run op by op on this thread (a batch-invariant forward). The
    backward, which autograd runs after the block (on another thread on a GPU), is not affected."""
    before = getattr(_local, "off", False)
    _local.off = before or on
    try:
        yield
    finally:
        _local.off = before


def is_suspended() -> bool:
    """Whether the fused functions run op by op on this thread (within ``suspended``)."""
    return getattr(_local, "off", False)


def report() -> dict | None:
    """What ran fused in this process since ``reset_report`` (``{"fused": [names]}``, with
    ``"eager_variants": [names]`` for functions that also ran eagerly past the recompile limit), or why
    it stopped; None if nothing did."""
    exact = {"exact": sorted(_used_exact)} if _used_exact else {}
    if disabled is not None:
        return {"disabled": disabled, **exact}
    if not _used:
        return exact or None
    return {"fused": sorted(_used), **({"eager_variants": sorted(_limited)} if _limited else {}), **exact}


def reset_report() -> None:
    """Forget which functions ran fused (not what was compiled, nor why fusion stopped), so the next
    ``report`` is of what runs from now on: a run's or a bench row's own (``gemm.reset_resolutions``).
    A run after a GPU test in one process recorded the test's fused functions as its own."""
    _used.clear()
    _limited.clear()
    _used_exact.clear()


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    if cfg.recompile_limit < RECOMPILE_LIMIT:
        cfg.recompile_limit = RECOMPILE_LIMIT


def _over_limit(e: Exception) -> bool:
    """A variant past dynamo's recompile limit (``FailOnRecompileLimitHit``, torch >= 2.5)."""
    return type(e).__name__ == "FailOnRecompileLimitHit"


def fused(fn):
    """``fn`` (pure, tensors in and out) compiled when its first argument is a CUDA tensor."""

    name = fn.__name__.lstrip("_")

    @functools.wraps(fn)
    def call(*args):
        global disabled
        if getattr(_local, "off", False):  # a batch-invariant forward: op by op, in one kernel where one is
            if name in EXACT and (args[0].is_cuda or _force_exact):  # the mode's kernels, as its norm's
                out = _exact(name)(*args)
                if out is not None:
                    _used_exact.add(name)
                    return out
            return fn(*args)
        if disabled is None and _enabled and (args[0].is_cuda or _force):
            compiled = _compiled.get(fn)
            if compiled is None:
                _raise_recompile_limit()
                compiled = _compiled[fn] = torch.compile(fn, backend=BACKEND, **COMPILE_OPTIONS)
            try:
                out = compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - a compilation that fails: eager from now on, and said
                if _over_limit(e):  # this variant only: eager, the compiled ones stay
                    _limited.add(name)
                    return fn(*args)
                disabled = f"{name}: {_why(e)}"
            else:
                _used.add(name)
                return out
        return fn(*args)

    return call


# Chains that a batch-invariant forward (``suspended``) runs as one Triton kernel of their own on a GPU,
# every operation the op-by-op one (``kernels.invariant``'s elementwise chains): the rollout and the
# trainer call the same kernel. The function's name -> the kernel's, in ``kernels.invariant``; it returns
# None where it does not apply, and the ops run.
EXACT = {"rope": "exact_rope", "swiglu_math": "exact_swiglu"}
_force_exact = False  # tests: CPU tensors too (Triton's interpreter)
_used_exact: set = set()  # names of the functions that ran as their exact kernel


def _exact(name: str):
    from jetrl_cli.kernels import invariant

    return getattr(invariant, EXACT[name])


def _why(e: Exception) -> str:
    """One line: the exception, and what caused it (dynamo wraps a backend's error)."""
    cause = getattr(e, "inner_exception", None) or e.__cause__
    text = f"{type(e).__name__}" + (f": {type(cause).__name__}: {cause}" if cause is not None else f": {e}")
    return " ".join(text.split())[:300]
