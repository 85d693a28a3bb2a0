"""Precision flows as data: which format every GEMM operand, the KV cache and the weight sync use.

A flow is a frozen dataclass tree. YAML only chooses values; this module checks that they fit
together and names the key at fault when they don't.

The three GEMMs of a linear layer ``y = x @ W.T`` (x: tokens x K, W: N x K, dy: tokens x N)::

    fprop  y  = x  @ W.T    reduction over K       operands: input, weight
    dgrad  dx = dy @ W      reduction over N       operands: grad_output, weight
    wgrad  dW = dy.T @ x    reduction over tokens  operands: grad_output, input

Every block shape in a flow is written in the tensor's *natural* layout (input and grad_output
as tokens x features, weight as N x K), so the weight-gradient operands, whose reduction runs
along tokens, use the transposed ``128x1`` groups. ``out`` is the precision the GEMM writes: the
activations and the gradients passed between operators stay in high precision (bf16 or fp32).

Named flows (``NAMED_FLOWS``):

- ``bf16``          BF16 everywhere (emulated on CPU: bf16 operands, fp32 accumulation).
- ``fp8-rollout``   BF16 training, block-FP8 rollout: the common off-policy recipe.
- ``int8-rollout``  BF16 training, W8A8 INT8 rollout (per-token x per-channel).
- ``fp8-unified``   Jet-RL: training forward uses the rollout's quantizers exactly; Fprop, Dgrad
                    and Wgrad in FP8 E4M3 with 1x128 activations/gradients and 128x128 weights;
                    saved activations kept in FP8; master weights fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import PresetError
from .formats import Block, Format
from .quant import DEFAULT_AMAX_FLOOR, CastSpec

from ..choices import GEMM_BACKENDS  # noqa: E402  (the registry: precision/gemm.py)
DEFAULT_SKIP = ("embed_tokens", "lm_head", "*norm*")
SKIP_FORMATS = (Format.BF16, Format.FP32)  # what the linear layers on the skip list run in


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM: how each operand is cast, what precision it writes, which backend runs it."""

    a: CastSpec
    b: CastSpec
    out: Format = Format.BF16
    backend: str = "auto"

    def short_str(self) -> str:
        s = f"{self.a.short_str()}x{self.b.short_str()}->{self.out.short}"
        return s if self.backend == "auto" or not self.is_quantized else f"{s}@{self.backend}"

    @property
    def is_quantized(self) -> bool:
        return self.a.is_scaled or self.b.is_scaled


HIGH_PRECISION_GEMM = GemmSpec(CastSpec(Format.FP32), CastSpec(Format.FP32), Format.FP32)


@dataclass(frozen=True)
class LinearPrecision:
    """The three GEMMs of a linear layer (operand a / b per the module docstring)."""

    fprop: GemmSpec  # a = input, b = weight
    dgrad: GemmSpec  # a = grad_output, b = weight
    wgrad: GemmSpec  # a = grad_output, b = input
    save_fp8_activations: bool = False

    @classmethod
    def forward_only(cls, fprop: GemmSpec) -> "LinearPrecision":
        """A rollout-side linear: the backward GEMMs mirror fprop in high precision (never run)."""
        return cls(fprop=fprop, dgrad=HIGH_PRECISION_GEMM, wgrad=HIGH_PRECISION_GEMM)

    @classmethod
    def unquantized(cls, fmt: Format) -> "LinearPrecision":
        """A layer on the skip list: all three GEMMs with ``fmt`` operands and fp32 accumulation;
        the forward writes fp32 (``lm_head``'s logits), the input gradient ``fmt``, the weight
        gradient fp32."""
        c = CastSpec(fmt)
        return cls(GemmSpec(c, c, Format.FP32), GemmSpec(c, c, fmt), GemmSpec(c, c, Format.FP32))

    @property
    def is_quantized(self) -> bool:
        return self.fprop.is_quantized or self.dgrad.is_quantized or self.wgrad.is_quantized

    def short_str(self) -> str:
        s = f"fprop={self.fprop.short_str()} dgrad={self.dgrad.short_str()} wgrad={self.wgrad.short_str()}"
        return s + " saved=fp8" if self.save_fp8_activations else s


@dataclass(frozen=True)
class KVCacheSpec:
    format: Format = Format.BF16
    block: Block = Block(0, 0)  # fp8 KV: "row" (one scale per token and head), the only granularity allowed

    def short_str(self) -> str:
        return CastSpec(self.format, self.block).short_str()


@dataclass(frozen=True)
class RolloutPrecision:
    linear: GemmSpec
    kv_cache: KVCacheSpec = KVCacheSpec()


@dataclass(frozen=True)
class TrainPrecision:
    linear: LinearPrecision
    master_weights: Format = Format.FP32


@dataclass(frozen=True)
class WeightSyncSpec:
    """What the trainer sends the rollout side after an update.

    ``hp``: high-precision weights, which the rollout side quantizes with its own weight spec.
    ``quantized``: the trainer quantizes once with the rollout's weight spec and sends data+scales.
    Either way the rollout weights are bit-identical, since both run the same quantizer.
    """

    payload: str = "hp"


@dataclass(frozen=True)
class PrecisionFlow:
    name: str
    rollout: RolloutPrecision
    train: TrainPrecision
    weight_sync: WeightSyncSpec = WeightSyncSpec()
    skip: tuple[str, ...] = DEFAULT_SKIP
    unified: bool = False  # a promise, checked: training fprop == rollout linear
    skip_format: Format = Format.BF16  # the skipped linear layers' operands, on both sides
    batch_invariant: bool = False  # GPU: batch-invariant kernels for every forward op (a token's bits never depend on the batch)

    @property
    def is_on_policy(self) -> bool:
        """True when the trainer's forward runs exactly the rollout's numerics."""
        return self.train.linear.fprop == self.rollout.linear

    def rollout_linear(self) -> LinearPrecision:
        return LinearPrecision.forward_only(self.rollout.linear)

    def skipped_linear(self) -> LinearPrecision:
        """What a linear layer on the skip list runs, in rollout and training alike."""
        p = LinearPrecision.unquantized(self.skip_format)
        if self.batch_invariant:
            p = dataclasses.replace(p, fprop=dataclasses.replace(p.fprop, backend="invariant"))
        return p

    def kv_cast(self, side: str) -> CastSpec:
        """How keys/values are rounded: the rollout's KV-cache format; the trainer's forward
        reproduces it when the flow is unified and otherwise rounds to its own fprop output."""
        kv = CastSpec(self.rollout.kv_cache.format, self.rollout.kv_cache.block)
        if side == "rollout" or self.unified:
            return kv
        return CastSpec(self.train.linear.fprop.out)

    def short_str(self) -> str:
        kind = "on-policy" if self.is_on_policy else "off-policy"
        return (
            f"{self.name} [{kind}] rollout={self.rollout.linear.short_str()} "
            f"kv={self.rollout.kv_cache.short_str()} train: {self.train.linear.short_str()} "
            f"master={self.train.master_weights.short} sync={self.weight_sync.payload} "
            f"skipped={self.skip_format.short}" + (" batch-invariant" if self.batch_invariant else "")
        )

    def to_dict(self) -> dict:
        return _flow_to_dict(self)


# --------------------------------------------------------------------------- named flows

_HP_TRAIN = {
    "fprop": {"input": "bf16", "weight": "bf16", "out": "bf16"},
    "dgrad": {"grad_output": "bf16", "weight": "bf16", "out": "bf16"},
    "wgrad": {"grad_output": "bf16", "input": "bf16", "out": "fp32"},
    "save_fp8_activations": False,
    "master_weights": "fp32",
}
_FP8_BLOCK_FWD = {"input": "fp8_e4m3 1x128", "weight": "fp8_e4m3 128x128", "out": "bf16"}

NAMED_FLOWS: dict[str, dict] = {
    "bf16": {
        "rollout": {"linear": {"input": "bf16", "weight": "bf16", "out": "bf16"}, "kv_cache": "bf16"},
        "train": _HP_TRAIN,
        "weight_sync": "hp",
        "unified": True,
    },
    "fp8-rollout": {
        "rollout": {"linear": _FP8_BLOCK_FWD, "kv_cache": "bf16"},
        "train": _HP_TRAIN,
        "weight_sync": "hp",
        "unified": False,
    },
    "int8-rollout": {
        "rollout": {"linear": {"input": "int8 row", "weight": "int8 row", "out": "bf16"}, "kv_cache": "bf16"},
        "train": _HP_TRAIN,
        "weight_sync": "hp",
        "unified": False,
    },
    "fp8-unified": {
        "rollout": {"linear": _FP8_BLOCK_FWD, "kv_cache": "bf16"},
        "train": {
            "fprop": _FP8_BLOCK_FWD,
            "dgrad": {"grad_output": "fp8_e4m3 1x128", "weight": "fp8_e4m3 128x128", "out": "bf16"},
            "wgrad": {"grad_output": "fp8_e4m3 128x1", "input": "fp8_e4m3 128x1", "out": "fp32"},
            "save_fp8_activations": True,
            "master_weights": "fp32",
        },
        "weight_sync": "quantized",
        "unified": True,
    },
}


def named_flow(name: str) -> PrecisionFlow:
    if name not in NAMED_FLOWS:
        raise PresetError("precision", "", f"unknown flow {name!r} (allowed: {', '.join(NAMED_FLOWS)})")
    return parse_flow(name, source="<built-in>")


# --------------------------------------------------------------------------- parsing

OPERANDS = {  # per GEMM: the names of operands a and b
    "fprop": ("input", "weight"),
    "dgrad": ("grad_output", "weight"),
    "wgrad": ("grad_output", "input"),
    "rollout.linear": ("input", "weight"),
}


class _Ctx:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, message: str):
        raise PresetError(self.source, key, message)

    def mapping(self, value, key: str, allowed: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"expected a mapping with keys {', '.join(allowed)}, got {type(value).__name__}")
        for k in value:
            if k not in allowed:
                self.fail(f"{key}.{k}" if key else str(k), f"unknown key (allowed: {', '.join(allowed)})")
        return value

    def boolean(self, value, key: str) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {value!r}")
        return value


def _parse_cast(ctx: _Ctx, value, key: str, default_block: str = "tensor") -> CastSpec:
    if isinstance(value, str):
        parts = value.split()
        if not parts:
            ctx.fail(key, "empty cast spec (write e.g. 'fp8_e4m3 1x128' or 'bf16')")
        fields: dict[str, Any] = {"format": parts[0]}
        rest = parts[1:]
        if rest and rest[-1] == "pow2":
            fields["pow2_scale"] = True
            rest = rest[:-1]
        if len(rest) > 1:
            ctx.fail(key, f"cannot read {value!r}: write '<format> [<granularity>] [pow2]'")
        if rest:
            fields["block"] = rest[0]
    elif isinstance(value, dict):
        fields = dict(ctx.mapping(value, key, ("format", "block", "pow2_scale", "amax_floor")))
        if "format" not in fields:
            ctx.fail(f"{key}.format", "missing")
    else:
        ctx.fail(key, f"expected a cast spec such as 'fp8_e4m3 1x128', got {value!r}")
    try:
        fmt = Format.parse(fields["format"])
    except ValueError as e:
        ctx.fail(f"{key}.format" if isinstance(value, dict) else key, str(e))
    try:
        block = Block.parse(fields.get("block", default_block if fmt.is_scaled else "tensor"))
    except ValueError as e:
        ctx.fail(f"{key}.block" if isinstance(value, dict) else key, str(e))
    if not fmt.is_scaled and "block" in fields:
        ctx.fail(key, f"{fmt.value} is unscaled and takes no granularity")
    pow2 = fields.get("pow2_scale", False)
    ctx.boolean(pow2, f"{key}.pow2_scale")
    floor = fields.get("amax_floor", DEFAULT_AMAX_FLOOR)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < math.inf:
        ctx.fail(f"{key}.amax_floor", f"expected a finite positive number, got {floor!r}")
    return CastSpec(fmt, block, pow2, float(floor))


def _parse_format(ctx: _Ctx, value, key: str, allowed: tuple[Format, ...]) -> Format:
    try:
        fmt = Format.parse(value)
    except ValueError as e:
        ctx.fail(key, str(e))
    if fmt not in allowed:
        ctx.fail(key, f"{fmt.value} is not allowed here (allowed: {', '.join(f.value for f in allowed)})")
    return fmt


def _k_group(spec: CastSpec, reduction_on_rows: bool) -> int | None:
    """The size of the scale groups along the GEMM's reduction dim (None: one group)."""
    if not spec.is_scaled:
        return None
    size = spec.block.rows if reduction_on_rows else spec.block.cols
    return size or None


REDUCTION_ON_ROWS = {  # per GEMM: (operand a, operand b) reduce along their natural-layout rows?
    "fprop": (False, False),
    "rollout.linear": (False, False),
    "dgrad": (False, True),  # grad_output (tokens x N) over N; weight (N x K) over N
    "wgrad": (True, True),  # grad_output and input (tokens x ...) over tokens
}


def _parse_gemm(ctx: _Ctx, value, key: str, gemm: str) -> GemmSpec:
    left, right = OPERANDS[gemm]
    m = ctx.mapping(value, key, (left, right, "out", "backend"))
    for op in (left, right):
        if op not in m:
            ctx.fail(f"{key}.{op}", "missing")
    a = _parse_cast(ctx, m[left], f"{key}.{left}")
    b = _parse_cast(ctx, m[right], f"{key}.{right}")
    out = _parse_format(ctx, m.get("out", "bf16"), f"{key}.out", (Format.BF16, Format.FP32))
    backend = m.get("backend", "auto")
    if backend not in GEMM_BACKENDS:
        ctx.fail(f"{key}.backend", f"unknown backend {backend!r} (allowed: {', '.join(GEMM_BACKENDS)})")
    # Combinations no hardware GEMM runs.
    fa, fb = a.format, b.format
    if a.is_scaled != b.is_scaled and (fa is Format.INT8 or fb is Format.INT8):
        ctx.fail(key, f"int8 needs int8 on both operands ({left}={fa.value}, {right}={fb.value})")
    if {fa, fb} == {Format.INT8, Format.FP8_E4M3} or {fa, fb} == {Format.INT8, Format.FP8_E5M2}:
        ctx.fail(key, f"cannot mix int8 and fp8 in one GEMM ({left}={fa.value}, {right}={fb.value})")
    if fa is Format.FP8_E5M2 and fb is Format.FP8_E5M2:
        ctx.fail(key, "e5m2 x e5m2 has no FP8 tensor-core GEMM; make one operand fp8_e4m3")
    if a.is_scaled != b.is_scaled:
        ctx.fail(key, f"both operands must be 8-bit or neither ({left}={fa.value}, {right}={fb.value})")
    # Scale groups along the reduction dim must line up (the DeepSeek-V3 promotion rule).
    red_rows_a, red_rows_b = REDUCTION_ON_ROWS[gemm]
    ga, gb = _k_group(a, red_rows_a), _k_group(b, red_rows_b)
    if ga and gb and ga != gb:
        ctx.fail(key, f"scale groups along the reduction dim differ ({left}: {ga}, {right}: {gb}); they must match")
    spec = GemmSpec(a, b, out, backend)
    from .gemm import static_unsupported  # the registry knows what each backend runs

    why = static_unsupported(backend, spec, gemm)
    if why is not None:
        ctx.fail(f"{key}.backend", f"backend {backend} {why}")
    return spec


def _parse_flow_dict(ctx: _Ctx, name: str, d: dict, key: str) -> PrecisionFlow:  # noqa: C901
    top = ctx.mapping(d, key, ("base", "rollout", "train", "weight_sync", "skip", "skip_format", "unified",
                               "batch_invariant"))
    p = f"{key}." if key else ""
    for section in ("rollout", "train"):
        if section not in top:
            ctx.fail(f"{p}{section}", "missing")

    r = ctx.mapping(top["rollout"], f"{p}rollout", ("linear", "kv_cache"))
    if "linear" not in r:
        ctx.fail(f"{p}rollout.linear", "missing")
    r_lin = _parse_gemm(ctx, r["linear"], f"{p}rollout.linear", "rollout.linear")
    kv = r.get("kv_cache", "bf16")
    kv_cast = _parse_cast(ctx, kv, f"{p}rollout.kv_cache", default_block="row")  # fp8: its only granularity
    if kv_cast.format is Format.INT8:
        ctx.fail(f"{p}rollout.kv_cache", "int8 KV cache is not supported (allowed: fp32, bf16, fp8_e4m3, fp8_e5m2)")
    if kv_cast.is_scaled and kv_cast.block.name != "row":
        ctx.fail(f"{p}rollout.kv_cache", f"an fp8 KV cache takes 'row' scales (one per token and head), not "
                 f"{kv_cast.block.name}: a per-tensor scale would change as the cache grows")
    kv_spec = KVCacheSpec(kv_cast.format, kv_cast.block)

    t = ctx.mapping(top["train"], f"{p}train", ("fprop", "dgrad", "wgrad", "save_fp8_activations", "master_weights"))
    gemms = {}
    for g in ("fprop", "dgrad", "wgrad"):
        if g not in t:
            ctx.fail(f"{p}train.{g}", "missing")
        gemms[g] = _parse_gemm(ctx, t[g], f"{p}train.{g}", g)
    save = ctx.boolean(t.get("save_fp8_activations", False), f"{p}train.save_fp8_activations")
    if save and not gemms["wgrad"].b.format.is_fp8:
        ctx.fail(f"{p}train.save_fp8_activations",
                 "needs an fp8 wgrad.input: the saved FP8 copy is what the weight-gradient GEMM reads")
    master = _parse_format(ctx, t.get("master_weights", "fp32"), f"{p}train.master_weights", (Format.FP32, Format.BF16))
    if master is not Format.FP32:  # accepted by the schema, never implemented: refused rather than ignored
        ctx.fail(f"{p}train.master_weights", f"{master.value} master weights are not implemented: the trainer keeps "
                 "fp32 master weights and AdamW state (write fp32, or leave the key out)")
    train = TrainPrecision(LinearPrecision(gemms["fprop"], gemms["dgrad"], gemms["wgrad"], save), master)

    sync = top.get("weight_sync", "hp")
    if isinstance(sync, dict):
        sync = ctx.mapping(sync, f"{p}weight_sync", ("payload",)).get("payload", "hp")
    if sync not in ("hp", "quantized"):
        ctx.fail(f"{p}weight_sync", f"unknown payload {sync!r} (allowed: hp, quantized)")
    if sync == "quantized" and not r_lin.b.is_scaled:
        ctx.fail(f"{p}weight_sync", "'quantized' needs an 8-bit rollout weight format; use 'hp'")

    skip = top.get("skip", list(DEFAULT_SKIP))
    if not isinstance(skip, list) or not all(isinstance(s, str) and s for s in skip):
        ctx.fail(f"{p}skip", f"expected a list of module-name patterns, got {skip!r}")

    skip_format = _parse_format(ctx, top.get("skip_format", "bf16"), f"{p}skip_format", SKIP_FORMATS)
    unified = ctx.boolean(top.get("unified", False), f"{p}unified")
    invariant = ctx.boolean(top.get("batch_invariant", False), f"{p}batch_invariant")
    if invariant:  # every forward GEMM through the batch-invariant kernels (the backward need not be)
        for what, g in (("rollout.linear", r_lin), ("train.fprop", train.linear.fprop)):
            if g.backend not in ("auto", "invariant"):
                ctx.fail(f"{p}batch_invariant", f"is true but {what} names backend {g.backend}; drop that backend "
                         "(batch_invariant sets the forward GEMMs' backend to invariant)")
            from .gemm import static_unsupported

            why = static_unsupported("invariant", dataclasses.replace(g, backend="invariant"), "fprop")
            if why is not None:
                ctx.fail(f"{p}batch_invariant", f"the batch-invariant GEMM {why}")
        r_lin = dataclasses.replace(r_lin, backend="invariant")
        train = dataclasses.replace(train, linear=dataclasses.replace(
            train.linear, fprop=dataclasses.replace(train.linear.fprop, backend="invariant")))
    flow = PrecisionFlow(name, RolloutPrecision(r_lin, kv_spec), train, WeightSyncSpec(sync), tuple(skip), unified,
                         skip_format, invariant)
    if unified and not flow.is_on_policy:
        ctx.fail(f"{p}unified", "is true but train.fprop differs from rollout.linear "
                 f"({train.linear.fprop.short_str()} vs {r_lin.short_str()}); the trainer must run the rollout's quantizers")
    return flow


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_flow(value, source: str = "<flow>", key: str = "precision", name: str = "custom") -> PrecisionFlow:
    """A flow from a name (``"fp8-unified"``) or a mapping (optionally ``base:`` + overrides)."""
    ctx = _Ctx(source)
    if isinstance(value, str):
        if value not in NAMED_FLOWS:
            ctx.fail(key, f"unknown flow {value!r} (allowed: {', '.join(NAMED_FLOWS)}, or a mapping)")
        return _parse_flow_dict(ctx, value, NAMED_FLOWS[value], key)
    if not isinstance(value, dict):
        ctx.fail(key, f"expected a flow name or a mapping, got {value!r}")
    base_name = value.get("base")
    if base_name is not None:
        if not isinstance(base_name, str):  # a list or mapping is unhashable: `in NAMED_FLOWS` would raise
            ctx.fail(f"{key}.base", f"expected a flow name ({', '.join(NAMED_FLOWS)}), got {base_name!r}")
        if base_name not in NAMED_FLOWS:
            ctx.fail(f"{key}.base", f"unknown flow {base_name!r} (allowed: {', '.join(NAMED_FLOWS)})")
        merged = _deep_merge(NAMED_FLOWS[base_name], {k: v for k, v in value.items() if k != "base"})
        if len(value) > 1:
            name = name if name != "custom" else f"{base_name}+custom"
        else:
            name = base_name
        return _parse_flow_dict(ctx, name, merged, key)
    return _parse_flow_dict(ctx, name, value, key)


def _cast_to_yaml(c: CastSpec) -> str:
    if not c.is_scaled:
        return c.format.value
    return f"{c.format.value} {c.block.name}" + (" pow2" if c.pow2_scale else "")


def _flow_to_dict(flow: PrecisionFlow) -> dict:
    def gemm(g: GemmSpec, names: tuple[str, str]) -> dict:
        d = {names[0]: _cast_to_yaml(g.a), names[1]: _cast_to_yaml(g.b), "out": g.out.value}
        if g.backend != "auto":
            d["backend"] = g.backend
        return d

    lin = flow.train.linear
    return {
        "rollout": {
            "linear": gemm(flow.rollout.linear, OPERANDS["rollout.linear"]),
            "kv_cache": _cast_to_yaml(CastSpec(flow.rollout.kv_cache.format, flow.rollout.kv_cache.block)),
        },
        "train": {
            "fprop": gemm(lin.fprop, OPERANDS["fprop"]),
            "dgrad": gemm(lin.dgrad, OPERANDS["dgrad"]),
            "wgrad": gemm(lin.wgrad, OPERANDS["wgrad"]),
            "save_fp8_activations": lin.save_fp8_activations,
            "master_weights": flow.train.master_weights.value,
        },
        "weight_sync": flow.weight_sync.payload,
        "skip": list(flow.skip),
        "skip_format": flow.skip_format.value,
        "unified": flow.unified,
        "batch_invariant": flow.batch_invariant,
    }


__all__ = [
    "GEMM_BACKENDS",
    "GemmSpec",
    "KVCacheSpec",
    "LinearPrecision",
    "NAMED_FLOWS",
    "PrecisionFlow",
    "RolloutPrecision",
    "TrainPrecision",
    "WeightSyncSpec",
    "named_flow",
    "parse_flow",
]
