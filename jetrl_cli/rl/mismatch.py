"""``jetrl mismatch-report``: how far the rollout policy is from the trained one, where, and why.

For each flow the report samples completions with the flow's rollout precision (the embedded
engine), scores the same tokens with the flow's training precision (``score_logprobs``, what the
trainer computes its old-policy logprobs with) and with an fp32 reference, and compares them with
``mismatch_metrics`` -- the function behind the ``mismatch_*`` columns of ``metrics.jsonl``. So a
number in the report and the same number in a run's log are one computation on the same tensors.

On top of the summary it measures

- drift against position (buckets along the completion) and against rollout length;
- where the drift comes from: each quantized linear layer's output error under the rollout and the
  training precision on the same (fp32-reference) input, the hidden-state difference after every
  decoder layer, and the logprob drift when only one part runs the rollout precision (each decoder
  layer, then each linear of the worst decoder layers: coarse to fine, so a 30-layer model costs
  30 + 2 x 7 scoring passes, not 210);
- the first position where greedy decoding under the rollout and the training precision diverge;
- the tokens with the largest mismatch, with their context.

Offline (``rollouts=``) it reads samples written by ``jetrl rollout`` / ``jetrl run`` and reports on
those tokens without re-sampling.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import torch

from ..engine.embedded import EmbeddedEngine
from ..engine.sampling import SamplingParams
from ..errors import JetrlError
from ..models.llama import layer_output
from ..precision.flow import NAMED_FLOWS, KVCacheSpec, PrecisionFlow, RolloutPrecision, parse_flow
from ..precision.linear import JetLinear, apply_flow, matches_skip, separate_linears
from .algos import CorrectionConfig, mismatch_metrics
from .divergence import decode_divergence
from .trainer import Batch, Trainer, score_logprobs

DEFAULT_FLOWS = ("bf16", "fp8-rollout", "fp8-unified")
POSITION_BUCKETS = 8
TOP_TOKENS = 10
CONTEXT_TOKENS = 24
# Verdict thresholds on mismatch KL (k3, nats per token).
NEGLIGIBLE_KL = 1e-5
LARGE_KL = 1e-3
GATE_METRICS = ("mismatch_kl", "mismatch_k1", "abs_dlogp_mean", "abs_dlogp_max", "abs_dp_mean", "abs_dp_max",
                "prob_err", "chi2", "frac_above_tis_cap", "frac_outside_mis", "seq_log_ratio_abs_max",
                "greedy_diverged_frac")

_FP32_LINEAR = {"input": "fp32", "weight": "fp32", "out": "fp32"}


def reference_flow() -> PrecisionFlow:
    """fp32 everywhere: the high-precision reference every flow is compared with."""
    return parse_flow({
        "rollout": {"linear": _FP32_LINEAR, "kv_cache": "fp32"},
        "train": {"fprop": _FP32_LINEAR, "dgrad": {"grad_output": "fp32", "weight": "fp32", "out": "fp32"},
                  "wgrad": {"grad_output": "fp32", "input": "fp32", "out": "fp32"}},
        "unified": True,
    }, source="<reference>", name="fp32")


def trainer_view(flow: PrecisionFlow) -> PrecisionFlow:
    """``flow`` with its rollout side replaced by the trainer's forward (its fprop GEMM and the KV
    rounding the trainer applies): decoding with it is decoding under the training precision."""
    kv = flow.kv_cast("train")
    return dataclasses.replace(flow, name=f"{flow.name}/train",
                               rollout=RolloutPrecision(flow.train.linear.fprop, KVCacheSpec(kv.format, kv.block)),
                               unified=True)


def resolve_flows(names: list[str], preset_flow: PrecisionFlow, preset_name: str) -> list[tuple[str, PrecisionFlow]]:
    """``names`` (built-in flow names, or ``preset`` for the preset's own) -> labelled flows, de-duplicated."""
    out: list[tuple[str, PrecisionFlow]] = []
    seen = set()
    for n in names:
        n = n.strip()
        if not n:
            continue
        if n == "preset":
            label, flow = (preset_flow.name if preset_flow.name in NAMED_FLOWS else preset_name), preset_flow
        elif n in NAMED_FLOWS:
            label, flow = n, parse_flow(n, source="--flows")
        else:
            raise JetrlError(f"--flows: unknown flow {n!r} (allowed: preset, {', '.join(NAMED_FLOWS)})")
        key = (flow.rollout, flow.train, flow.skip, flow.unified)
        if key in seen:
            continue
        seen.add(key)
        out.append((label, flow))
    if not out:
        raise JetrlError("--flows: no flow given")
    return out


def parse_lengths(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in text.split(","):
        try:
            v = int(part)
        except ValueError:
            raise JetrlError(f"--lengths: {part.strip()!r} is not an integer (e.g. --lengths 64,256)") from None
        if v <= 0:
            raise JetrlError(f"--lengths: {v} must be > 0 (new tokens per rollout)")
        out.append(v)
    if not out:
        raise JetrlError("--lengths: give at least one length (e.g. --lengths 64,256)")
    return sorted(set(out))


def parse_gates(items: list[str]) -> dict[str, float]:
    gates = {}
    for it in items:
        key, sep, val = it.partition("=")
        key = key.strip()
        if not sep or key not in GATE_METRICS:
            raise JetrlError(f"--fail-above {it!r}: expected METRIC=VALUE with METRIC one of {', '.join(GATE_METRICS)}")
        try:
            gates[key] = float(val)
        except ValueError:
            raise JetrlError(f"--fail-above {it!r}: {val!r} is not a number") from None
        if not math.isfinite(gates[key]):
            raise JetrlError(f"--fail-above {it!r}: the limit must be a finite number")
    return gates


# --------------------------------------------------------------------------- statistics


def completion_positions(mask: torch.Tensor) -> torch.Tensor:
    """Index of each completion token within its completion (0, 1, ...); -1 off the mask."""
    m = mask.bool()
    return torch.where(m, m.long().cumsum(-1) - 1, torch.full_like(m, -1, dtype=torch.long))


def bucket_edges(longest: int, buckets: int = POSITION_BUCKETS) -> list[tuple[int, int]]:
    """``buckets`` contiguous ``[lo, hi)`` position ranges covering ``0 .. longest``."""
    n = max(1, min(buckets, longest))
    cuts = [round(i * longest / n) for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n) if cuts[i + 1] > cuts[i]]


def by_position(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                cfg: CorrectionConfig, buckets: int = POSITION_BUCKETS) -> list[dict]:
    """``mismatch_metrics`` restricted to the tokens in each position bucket of the completions."""
    pos = completion_positions(mask)
    longest = int(pos.max()) + 1 if mask.any() else 0
    rows = []
    for lo, hi in bucket_edges(longest, buckets):
        sub = mask.bool() & (pos >= lo) & (pos < hi)
        rows.append({"lo": lo, "hi": hi, **mismatch_metrics(logp_train, logp_rollout, sub, cfg)})
    return rows


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (or where one ends early); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_stats(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [first_divergence(x, y) for x, y in zip(a, b)]
    hit = sorted(f for f in firsts if f is not None)
    return {
        "sequences": len(firsts),
        "diverged_frac": len(hit) / max(1, len(firsts)),
        "first_min": hit[0] if hit else None,
        "first_median": hit[len(hit) // 2] if hit else None,
    }


def top_tokens(b: Batch, logp_train: torch.Tensor, logp_rollout: torch.Tensor, decode, k: int = TOP_TOKENS) -> list[dict]:
    """The ``k`` completion tokens with the largest |logp_train - logp_rollout| (ties: earliest)."""
    d = torch.where(b.mask, (logp_train.double() - logp_rollout.double()).abs(), 0.0)  # inf: beyond the cut
    flat = d.flatten()
    nz = int((flat > 0).sum())
    if nz == 0:
        return []
    vals, idx = torch.topk(flat, min(4 * k, nz))
    pos = completion_positions(b.mask)
    out, seen = [], set()
    for v, i in zip(vals.tolist(), idx.tolist()):
        r, c = divmod(i, d.shape[1])
        ids = b.ids[r].tolist()
        tok_at = c + 1  # mask column c scores token c + 1
        ctx = ids[max(0, tok_at - CONTEXT_TOKENS):tok_at]
        if (tuple(ctx), ids[tok_at]) in seen:  # identical samples of one prompt: show once
            continue
        seen.add((tuple(ctx), ids[tok_at]))
        if len(out) == k:
            break
        out.append({
            "sequence": r, "position": int(pos[r, c]), "token_id": ids[tok_at], "token": decode([ids[tok_at]]) or f"<id {ids[tok_at]}>",
            "context": decode(ctx), "logp_rollout": float(logp_rollout[r, c]),
            # None: the trainer's top-k/top-p cut leaves the token out (logprob -inf; JSON has no infinity)
            "logp_train": float(logp_train[r, c]) if math.isfinite(v) else None,
            "abs_dlogp": v if math.isfinite(v) else None,
        })
    return out


def verdict(m: dict) -> tuple[str, str]:
    """(status, one line) for a flow's train-vs-rollout summary."""
    if m.get("tokens", 0) == 0:
        return "empty", "no completion tokens to compare"
    kl = m["mismatch_kl"]
    if m["frac_bitwise_equal"] == 1.0:
        return "on-policy", "on-policy: rollout logprobs equal the trainer's bit for bit"
    if kl < NEGLIGIBLE_KL:
        return "near", f"near on-policy: mismatch KL {kl:.2e} < {NEGLIGIBLE_KL:g}; max |dlogp| {m['abs_dlogp_max']:.3g}"
    what = "large" if kl >= LARGE_KL else "moderate"
    return "drift", (f"off-policy ({what} drift): mismatch KL {kl:.2e}, max |dlogp| {m['abs_dlogp_max']:.3g}, "
                     f"{100 * m['frac_above_tis_cap']:.2f}% of tokens above the TIS cap -- correct it (tis/mis/acr) "
                     "or use a unified flow")


# --------------------------------------------------------------------------- attribution


def flow_linears(model: torch.nn.Module, flow: PrecisionFlow) -> list[tuple[str, JetLinear]]:
    """The linear layers a flow puts in its rollout / training precision (not those on its skip list,
    which run the flow's ``skip_format`` on both sides)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, JetLinear) and not matches_skip(n, flow.skip)]


def decoder_layer_of(name: str):
    """``model.layers.3.mlp.down_proj`` -> 3; a linear outside the decoder layers is its own group."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return name


def _valid_positions(ids: torch.Tensor, pad_lengths: torch.Tensor) -> torch.Tensor:
    t = ids.shape[1]
    return torch.arange(t)[None, :] < pad_lengths[:, None]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den > 0 else 0.0


@torch.no_grad()
def layer_attribution(ref_model, rollout_model, train_model, b: Batch, sampling: SamplingParams,
                      micro_batch: int, width: int, cfg: CorrectionConfig,
                      rollout_flow: PrecisionFlow, refine_layers: int = 2, on_pass=None) -> dict:
    """Per quantized linear: relative output error under the rollout and the training precision on
    the fp32 model's own input (``rel_err_rollout``, ``rel_err_train``) and rollout vs training
    output (``rel_diff``); the hidden-state difference (rollout vs training forward) after every
    decoder layer.

    Then the mismatch KL (against the full training-precision logprobs) when only part of the model
    runs the rollout precision. Each such number costs one scoring pass of the batch, so it goes
    coarse to fine: every decoder layer alone (``decoder_layers``: L passes), then every linear
    alone inside the ``refine_layers`` decoder layers with the largest KL (``kl_alone``; None for
    the linears of the other layers) -- 30 + 2 x 7 passes on a 30-layer model instead of 210.
    ``on_pass(what, done, total)`` is called after each pass (the CLI's progress bar)."""
    lengths = b.mask.shape[1] + 1 - (b.mask.flip(-1).long().cumsum(-1) == 0).sum(-1)  # prompt + completion
    valid = _valid_positions(b.ids, lengths)
    ids = b.ids
    # 1. Inputs and outputs of every linear layer of the fp32 reference.
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    roll_q = dict(flow_linears(rollout_model, rollout_flow))
    train_q = {n: m for n, m in train_model.named_modules() if isinstance(m, JetLinear) and n in roll_q}
    ref_mods = dict(ref_model.named_modules())
    for name in roll_q:
        def hook(mod, inp, out, name=name):
            captured[name] = (inp[0][valid].detach(), out[valid].detach())
        hooks.append(ref_mods[name].register_forward_hook(hook))
    try:
        with separate_linears():  # one forward per linear layer (no fused q/k/v), so every hook fires
            ref_model(ids)
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for name, mod in roll_q.items():
        x, y_ref = captured[name]
        y_roll = mod(x)
        y_train = train_q[name](x) if name in train_q else ref_mods[name](x)
        layers.append({"name": name, "rel_err_rollout": _rel(y_roll, y_ref), "rel_err_train": _rel(y_train, y_ref),
                       "rel_diff": _rel(y_roll, y_train)})
    # 2. The hidden state after each decoder layer, rollout forward vs training forward.
    def capture(model):
        outs = []
        hs = [layer.register_forward_hook(lambda m, i, o: outs.append(layer_output(o)[valid]))
              for layer in model.model.layers]
        try:
            model(ids)
        finally:
            for h in hs:
                h.remove()
        return outs
    hidden = [{"layer": i, "rel_diff": _rel(r, t)}
              for i, (r, t) in enumerate(zip(capture(rollout_model), capture(train_model)))]
    # 3. Parts of the model alone in the rollout precision, the rest as the trainer runs them: first
    #    each decoder layer (all its quantized linears), then each linear of the worst decoder layers.
    rprec = rollout_flow.rollout_linear()
    mask = b.mask
    # the baseline scored as each pass scores: this batch, these micro-batches (the caller's logprobs came
    # from the whole batch: on a GPU without batch-invariant kernels other rows can change a row's bits,
    # a noise floor under every kl_alone)
    logp_train = score_logprobs(train_model, b, sampling, micro_batch, width)
    groups: dict[object, list[str]] = {}
    for row in layers:
        row["kl_alone"] = None
        if row["name"] in train_q:
            groups.setdefault(decoder_layer_of(row["name"]), []).append(row["name"])
    kv_train, kv_roll = rollout_flow.kv_cast("train"), rollout_flow.kv_cast("rollout")
    widest = max((len(v) for v in groups.values()), default=0)
    total = len(groups) + min(refine_layers, len(groups)) * widest + (kv_train != kv_roll)  # until refined is known
    done = 0

    def kl_with_rollout_precision(names: list[str], what: str) -> float:
        nonlocal done
        saved = [(train_q[n], train_q[n].precision) for n in names]
        for mod, _ in saved:
            mod.set_precision(rprec)
        try:
            lp = score_logprobs(train_model, b, sampling, micro_batch, width)
        finally:
            for mod, prec in saved:
                mod.set_precision(prec)
        done += 1
        if on_pass:
            on_pass(what, done, total)
        return mismatch_metrics(lp, logp_train, mask, cfg)["mismatch_kl"]

    decoder = [{"layer": key, "kl_alone": kl_with_rollout_precision(
                   names, f"decoder layer {key}" if isinstance(key, int) else short_name(key))}
               for key, names in groups.items()]
    ranked = sorted((d for d in decoder if d["kl_alone"] > 0), key=lambda d: -d["kl_alone"])
    refined = [d["layer"] for d in ranked[:refine_layers]]
    total = len(groups) + sum(len(groups[k]) for k in refined) + (kv_train != kv_roll)
    if on_pass:  # the passes left are known now
        on_pass(f"decoder layers {', '.join(map(str, refined)) or '(none drift)'} linear by linear", done, total)
    by_name = {row["name"]: row for row in layers}
    for key in refined:
        for name in groups[key]:
            by_name[name]["kl_alone"] = kl_with_rollout_precision([name], short_name(name))
    kv_alone = None
    if kv_train != kv_roll:
        train_model.set_kv_spec(kv_roll)
        try:
            lp = score_logprobs(train_model, b, sampling, micro_batch, width)
        finally:
            train_model.set_kv_spec(kv_train)
        kv_alone = mismatch_metrics(lp, logp_train, mask, cfg)["mismatch_kl"]
        done += 1
        if on_pass:
            on_pass("KV cache", done, total)
    return {"layers": layers, "hidden": hidden, "decoder_layers": decoder, "refined_layers": refined,
            "kv_cache_kl_alone": kv_alone}


# --------------------------------------------------------------------------- the report


@dataclasses.dataclass
class ReportInputs:
    """Everything flow-independent: the policy (fp32), its tokenizer, the prompts."""

    model: torch.nn.Module
    decode: object
    prompts: list[list[int]]
    sampling: SamplingParams  # temperature / top-p / top-k / n from the preset
    tcfg: object
    ccfg: CorrectionConfig
    max_batch: int
    seed: int = 0
    greedy_cache: dict = dataclasses.field(default_factory=dict)  # decodes shared between flows
    # (flow, width) -> a rollout engine with the policy's weights loaded; None: the embedded engine.
    # Greedy divergence and per-layer attribution always run on jetrl's own model.
    engine_factory: object = None
    engine_name: str = "embedded"
    attribution_layers: int = 2  # decoder layers whose linears are attributed one by one
    on_pass: object = None  # (what, done, total) after each scoring pass of the attribution


def _batch(prompts: list[list[int]], groups, pad_id: int = 0) -> tuple[Batch, list[list[int]]]:
    p, c, lp, g = [], [], [], []
    for gi, (pr, comps) in enumerate(zip(prompts, groups)):
        for comp in comps:
            p.append(pr)
            c.append(comp.tokens)
            lp.append(comp.logprobs)
            g.append(gi)
    return Batch.build(p, c, lp, [0.0] * len(p), g, pad_id), c


def _train_model(base, flow, inp: ReportInputs, width: int):
    return Trainer(copy.deepcopy(base), flow, inp.tcfg, inp.ccfg, inp.sampling, width).model.eval()


def _score(model, b: Batch, inp: ReportInputs, width: int) -> torch.Tensor:
    return score_logprobs(model, b, inp.sampling, inp.tcfg.micro_batch, width)


def flow_report(label: str, flow: PrecisionFlow, inp: ReportInputs, lengths: list[int], *,
                attribution: bool = True, attribution_sequences: int = 32, greedy: bool = True,
                progress=lambda msg: None) -> dict:
    """Sample at each length with ``flow``'s rollout precision; compare with its training
    precision and with fp32 on the same tokens."""
    width = max(len(p) for p in inp.prompts) + max(lengths)
    ref = copy.deepcopy(inp.model).eval()
    ref.set_kv_spec(None)
    train_model = _train_model(inp.model, flow, inp, width)
    embedded = EmbeddedEngine(inp.model, flow, width, inp.max_batch)
    engine = embedded if inp.engine_factory is None else inp.engine_factory(flow, width)
    res: dict = {"flow": label, "description": flow.short_str(), "on_policy_by_design": flow.is_on_policy,
                 "engine": inp.engine_name, "by_length": []}
    last = None
    for L in lengths:
        progress(f"{label}: sampling {len(inp.prompts)} x {inp.sampling.n} completions of {L} tokens")
        sp = dataclasses.replace(inp.sampling, max_new_tokens=L, stop_token_ids=(), stop_sequences=())
        groups = engine.generate(inp.prompts, sp, inp.seed)
        b, _ = _batch(inp.prompts, groups)
        progress(f"{label}: scoring {L}-token completions (training precision, fp32)")
        lt = _score(train_model, b, inp, width)
        lr = _score(ref, b, inp, width)
        m = mismatch_metrics(lt, b.rollout_logp, b.mask, inp.ccfg)
        row = {"length": L, "sequences": len(b), **m,
               "rollout_vs_fp32_kl": mismatch_metrics(lr, b.rollout_logp, b.mask, inp.ccfg)["mismatch_kl"],
               "train_vs_fp32_kl": mismatch_metrics(lr, lt, b.mask, inp.ccfg)["mismatch_kl"]}
        if engine is not embedded:  # the other engine against jetrl's engine in the same rollout precision
            le = _score(embedded.model, b, inp, width)
            row["engine_vs_embedded_kl"] = mismatch_metrics(le, b.rollout_logp, b.mask, inp.ccfg)["mismatch_kl"]
        res["by_length"].append(row)
        last = (b, lt, lr)
    b, lt, lr = last
    _fill_token_stats(res, b, lt, lr, inp)
    progress(f"{label}: the rollout's decode steps against the trainer's forward, stage by stage")
    k = min(8, len(groups))
    res["decode_vs_forward"] = decode_divergence(embedded.model, train_model, inp.prompts[:k],
                                                 [g[0].tokens for g in groups[:k]], inp.sampling, width)
    if greedy:
        progress(f"{label}: greedy decoding under rollout, training and fp32 precision")
        res["greedy"] = greedy_divergence(inp, flow, max(lengths), width)
    if attribution:
        progress(f"{label}: per-layer attribution (each decoder layer, then the linears of the worst "
                 f"{inp.attribution_layers})")
        res.update(_attribution(inp, flow, embedded.model, train_model, ref, b, lt, width, attribution_sequences, label))
    if engine is not embedded and hasattr(engine, "close"):
        engine.close()
    return res


def _fill_token_stats(res: dict, b: Batch, lt, lr, inp: ReportInputs) -> None:
    res["summary"] = mismatch_metrics(lt, b.rollout_logp, b.mask, inp.ccfg)
    res["rollout_vs_fp32"] = mismatch_metrics(lr, b.rollout_logp, b.mask, inp.ccfg)
    res["train_vs_fp32"] = mismatch_metrics(lr, lt, b.mask, inp.ccfg)
    res["by_position"] = by_position(lt, b.rollout_logp, b.mask, inp.ccfg)
    res["top_tokens"] = top_tokens(b, lt, b.rollout_logp, inp.decode)
    res["status"], res["verdict"] = verdict(res["summary"])


def _attribution(inp, flow, rollout_model, train_model, ref, b: Batch, lt, width: int, nseq: int,
                 label: str = "") -> dict:
    idx = torch.arange(min(nseq, len(b)))
    sub = b.select(idx)
    on_pass = (lambda what, done, total: inp.on_pass(f"{label}: {what}", done, total)) if inp.on_pass else None
    att = layer_attribution(ref, rollout_model, train_model, sub, inp.sampling, inp.tcfg.micro_batch, width,
                            inp.ccfg, flow, inp.attribution_layers, on_pass)
    att["attribution_sequences"] = len(sub)
    ranked = [r for r in att["layers"] if r["kl_alone"] is not None]
    att["top_layer"] = max(ranked, key=lambda r: r["kl_alone"])["name"] if ranked and max(
        r["kl_alone"] for r in ranked) > 0 else None
    return att


def greedy_divergence(inp: ReportInputs, flow: PrecisionFlow, length: int, width: int) -> dict:
    """Greedy completions (stop tokens off) under the rollout, the training and the fp32 precision;
    where the rollout's first departs from each of the others."""
    sp = SamplingParams(max_new_tokens=length, temperature=0.0, n=1)

    def decode_with(f: PrecisionFlow) -> list[list[int]]:
        # everything of the flow the engine reads: two flows that differ in any of it decode differently
        key = (f.rollout, f.skip, f.skip_format, f.batch_invariant, f.weight_sync, length, width)
        if key not in inp.greedy_cache:
            eng = EmbeddedEngine(inp.model, f, width, inp.max_batch)
            inp.greedy_cache[key] = [g[0].tokens for g in eng.generate(inp.prompts, sp, 0)]
        return inp.greedy_cache[key]

    roll = decode_with(flow)
    return {"length": length, "vs_train": divergence_stats(roll, decode_with(trainer_view(flow))),
            "vs_fp32": divergence_stats(roll, decode_with(reference_flow()))}


def offline_report(label: str, flow: PrecisionFlow, inp: ReportInputs, rows: list[dict], *,
                   attribution: bool = True, attribution_sequences: int = 32) -> dict:
    """The report on saved samples: their rollout logprobs against this flow's training precision."""
    b = Batch.build([r["prompt_ids"] for r in rows], [r["tokens"] for r in rows], [r["logprobs"] for r in rows],
                    [float(r.get("reward", 0.0)) for r in rows], [int(r.get("group", 0)) for r in rows])
    width = b.ids.shape[1]
    ref = copy.deepcopy(inp.model).eval()
    ref.set_kv_spec(None)
    train_model = _train_model(inp.model, flow, inp, width)
    lt = _score(train_model, b, inp, width)
    lr = _score(ref, b, inp, width)
    res: dict = {"flow": label, "description": flow.short_str(), "on_policy_by_design": flow.is_on_policy,
                 "offline": True, "by_length": []}
    _fill_token_stats(res, b, lt, lr, inp)
    if attribution:
        rollout_model = copy.deepcopy(inp.model).eval()
        apply_flow(rollout_model, flow, "rollout")
        res.update(_attribution(inp, flow, rollout_model, train_model, ref, b, lt, width, attribution_sequences, label))
    return res


def gate_failures(flows: list[dict], gates: dict[str, float]) -> list[str]:
    """``METRIC=VALUE`` gates -> one message per (flow, metric) above its limit, NaN, or not measured (a gate
    passes only on a number at most its limit)."""
    bad = []
    for f in flows:
        vals = dict(f["summary"])
        if "greedy" in f:
            vals["greedy_diverged_frac"] = f["greedy"]["vs_train"]["diverged_frac"]
        for k, limit in gates.items():
            v = vals.get(k)
            if v is None:
                bad.append(f"{f['flow']}: {k} was not measured")
            elif math.isnan(v):
                bad.append(f"{f['flow']}: {k} is nan")
            elif v > limit:
                bad.append(f"{f['flow']}: {k} = {v:.4g} > {limit:g}")
    return bad


# --------------------------------------------------------------------------- output


def short_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``3.q_proj``."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers":
        return f"{parts[2]}.{parts[-1]}"
    return name


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if v == 0:
        return "0"
    if abs(v) < 1e-3 or abs(v) >= 1e4:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


SUMMARY_COLUMNS = (("mismatch_kl", "KL k3"), ("mismatch_k1", "KL k1"), ("abs_dlogp_mean", "|dlogp| mean"),
                   ("abs_dlogp_max", "|dlogp| max"), ("abs_dp_mean", "|dp| mean"), ("abs_dp_max", "|dp| max"),
                   ("prob_err", "prob err"), ("chi2", "chi2"), ("ess", "ESS"), ("frac_bitwise_equal", "bitwise eq"),
                   ("frac_above_tis_cap", ">TIS cap"), ("frac_outside_mis", "out MIS"),
                   ("seq_log_ratio_abs_max", "|seq log r| max"))


def render(report: dict, console) -> None:
    from rich.table import Table

    from rich.markup import escape

    from ..tables import print_table

    flows = report["flows"]
    engine = flows[0].get("engine", "embedded")
    t = Table(title=escape(f"rollout ({engine} engine) vs training precision, per token ({report['source']})"),
              title_justify="left")
    t.add_column("metric")
    for f in flows:
        t.add_column(f["flow"], justify="right")
    t.add_row("tokens", *[str(f["summary"].get("tokens", 0)) for f in flows])
    for k, head in SUMMARY_COLUMNS:
        t.add_row(head, *[_fmt(f["summary"].get(k)) for f in flows])
    t.add_row("rollout vs fp32 KL", *[_fmt(f["rollout_vs_fp32"].get("mismatch_kl")) for f in flows])
    t.add_row("train vs fp32 KL", *[_fmt(f["train_vs_fp32"].get("mismatch_kl")) for f in flows])
    if any("engine_vs_embedded_kl" in r for f in flows for r in f["by_length"]):
        t.add_row(f"{engine} vs embedded KL", *[_fmt(f["by_length"][-1].get("engine_vs_embedded_kl")) for f in flows])
    print_table(console, t)
    def kl_table(title: str, key: str, head) -> None:
        t = Table(title=escape(title), title_justify="left")
        t.add_column("flow", no_wrap=True)
        for r in flows[0][key]:
            t.add_column(head(r), justify="right")
        for f in flows:
            t.add_row(f["flow"], *[_fmt(r["mismatch_kl"]) for r in f[key]])
        print_table(console, t)

    if any(f["by_length"] for f in flows) and len(flows[0]["by_length"]) > 1:
        kl_table("mismatch KL by rollout length", "by_length", lambda r: f"{r['length']} tok")
    kl_table("mismatch KL by position in the completion", "by_position", lambda r: f"{r['lo']}-{r['hi'] - 1}")
    for f in flows:
        if "layers" not in f:
            continue
        n = f["attribution_sequences"]
        if f.get("decoder_layers"):
            hidden = {h["layer"]: h["rel_diff"] for h in f.get("hidden", [])}
            t = Table(title=escape(f"{f['flow']}: KL with only one decoder layer in rollout precision "
                                   f"(largest 8; {n} sequences)"), title_justify="left")
            for col in ("decoder layer", "KL alone", "hidden state rollout vs train"):
                t.add_column(col, justify="left" if col == "decoder layer" else "right")
            for d in sorted(f["decoder_layers"], key=lambda d: -d["kl_alone"])[:8]:
                t.add_row(str(d["layer"]), _fmt(d["kl_alone"]), _fmt(hidden.get(d["layer"])))
            if f.get("kv_cache_kl_alone") is not None:
                t.add_row("KV cache", _fmt(f["kv_cache_kl_alone"]), "")
            print_table(console, t)
        refined = f.get("refined_layers", [])
        where = f"decoder layers {', '.join(map(str, refined))}" if refined else "no decoder layer drifts: none"
        t = Table(title=escape(f"{f['flow']}: linears alone in rollout precision ({where} attributed linear by "
                               f"linear; largest 8)"), title_justify="left")
        t.add_column("linear", no_wrap=True)
        for col in ("rel err rollout", "rel err train", "rollout vs train", "KL alone"):
            t.add_column(col, justify="right")
        rows = sorted(f["layers"], key=lambda r: (-(r["kl_alone"] or 0), -r["rel_diff"]))[:8]
        for r in rows:
            t.add_row(short_name(r["name"]), _fmt(r["rel_err_rollout"]), _fmt(r["rel_err_train"]), _fmt(r["rel_diff"]),
                      _fmt(r["kl_alone"]))
        print_table(console, t)
    for f in flows:
        tops = f["top_tokens"][:5]
        if not tops:
            continue
        t = Table(title=escape(f"{f['flow']}: largest mismatches"), title_justify="left")
        for col in ("pos", "context", "token", "logp rollout", "logp train", "|dlogp|"):
            t.add_column(col, justify="right" if col not in ("context", "token") else "left", overflow="fold")
        for r in tops:
            beyond = r["logp_train"] is None  # the trainer's top-k/top-p cut leaves the token out
            t.add_row(str(r["position"]), repr(r["context"])[-40:], repr(r["token"]), f"{r['logp_rollout']:.4f}",
                      "-inf (cut)" if beyond else f"{r['logp_train']:.4f}", "inf" if beyond else _fmt(r["abs_dlogp"]))
        print_table(console, t)
    for f in flows:
        g = f.get("greedy")
        gl = ""
        if g:
            vt, vf = g["vs_train"], g["vs_fp32"]
            first = f" (first at token {vt['first_min']})" if vt["first_min"] is not None else ""
            gl = (f"; greedy decoding ({g['length']} tok) departs from the training precision's in "
                  f"{100 * vt['diverged_frac']:.0f}% of prompts{first}, from fp32's in {100 * vf['diverged_frac']:.0f}%")
        top = f"; largest single-layer contributor: {f['top_layer']}" if f.get("top_layer") else ""
        style = {"on-policy": "green", "near": "green", "drift": "yellow"}.get(f["status"], "white")
        console.print(f"[bold {style}]{escape(f['flow'])}[/]: " + escape(f"{f['verdict']}{top}{gl}{_breaks(f)}"),
                      highlight=False)


def _breaks(f: dict) -> str:
    """Where the rollout's decode steps first differ from the trainer's forward (``divergence``)."""
    d = f.get("decode_vs_forward")
    if not d or not d.get("positions"):
        return ""
    if d["first_divergent"] is None:
        return f"; decode steps equal the trainer's forward bit for bit at every stage ({d['positions']} positions)"
    s = next(x for x in d["stages"] if x["stage"] == d["first_divergent"])
    cut = (f", {100 * s['frac_cut_differs']:.0f}% with a token only one side's top-k/top-p cut"
           if s.get("frac_cut_differs") else "")
    return (f"; equality first breaks at {d['first_divergent']} (decode step vs trainer forward: "
            f"{100 * (1 - s['frac_equal']):.0f}% of positions differ, max |diff| {s['max_abs_diff']:.2e}{cut})")


def write_outputs(report: dict, out: Path) -> list[Path]:
    """report.json, report.md and the PNG plots (when matplotlib is installed) into ``out``."""
    import json
    import os

    out.mkdir(parents=True, exist_ok=True)
    written = []

    def atomic(path: Path, text: str):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        written.append(path)

    atomic(out / "report.json", json.dumps(report, indent=1))
    plots = []
    try:
        plots = _plots(report, out)
        written += plots
    except ImportError:  # said by the CLI (no .png among the files written)
        pass
    atomic(out / "report.md", markdown(report, [p.name for p in plots]))
    return written


def drift_figure(flows: list[dict]):
    """Mismatch KL and mean |dlogp| against position. KL is non-negative: its symlog axis starts at
    0 (left to itself, matplotlib mirrors a symlog axis below 0 and shows negative ticks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for f in flows:
        mid = [(r["lo"] + r["hi"] - 1) / 2 for r in f["by_position"]]
        axes[0].plot(mid, [r["mismatch_kl"] for r in f["by_position"]], marker="o", label=f["flow"])
        axes[1].plot(mid, [r.get("abs_dlogp_mean", 0.0) for r in f["by_position"]], marker="o", label=f["flow"])
    axes[0].set_yscale("symlog", linthresh=1e-7)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[0].set_title("mismatch KL (k3) vs position")
    axes[1].set_title("mean |logp_train - logp_rollout| vs position")
    for ax in axes:
        ax.set_xlabel("token position in the completion")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def _plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flows = report["flows"]
    paths = []
    fig = drift_figure(flows)
    p = out / "drift_vs_position.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    with_layers = [f for f in flows if f.get("layers")]
    if with_layers:
        names = [r["name"] for r in with_layers[0]["layers"]]
        fig, axes = plt.subplots(1, 2, figsize=(12, max(4, 0.22 * len(names) + 1)), sharey=True)
        h = 0.8 / len(with_layers)
        for k, f in enumerate(with_layers):
            rows = {r["name"]: r for r in f["layers"]}
            ys = [i + k * h for i in range(len(names))]
            axes[0].barh(ys, [rows[n]["rel_err_rollout"] if n in rows else 0 for n in names], height=h, label=f["flow"])
            axes[1].barh(ys, [(rows[n]["kl_alone"] or 0) if n in rows else 0 for n in names], height=h, label=f["flow"])
        axes[0].set_yticks([i + 0.4 - h / 2 for i in range(len(names))], [short_name(n) for n in names], fontsize=7)
        axes[0].invert_yaxis()
        axes[0].set_title("relative output error vs fp32 (rollout precision)")
        axes[1].set_xscale("symlog", linthresh=1e-8)
        axes[1].set_xlim(left=0)  # KL alone is non-negative
        axes[1].set_title("mismatch KL with only this layer in rollout precision")
        for ax in axes:
            ax.grid(alpha=0.3, axis="x")
            ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / "layer_error.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def markdown(report: dict, images: list[str]) -> str:
    flows = report["flows"]
    lines = [f"# jetrl mismatch report: {report['source']}", "",
             f"{report['date']} · jetrl {report['jetrl_version']} · torch {report['torch']} · "
             f"device {report['device']} · model `{report['model']}`", "",
             f"Command: `{report['command']}`", "",
             "Each flow's rollout-precision samples are scored with its training precision and with fp32; "
             "the numbers come from the same function as `metrics.jsonl`'s `mismatch_*` columns. "
             "KL is KL(rollout || train) by the k3 estimator, per token.", "", "## Verdicts", ""]
    for f in flows:
        extra = f"; largest single-layer contributor: `{f['top_layer']}`" if f.get("top_layer") else ""
        lines.append(f"- **{f['flow']}** ({f['description']}): {f['verdict']}{extra}{_breaks(f)}")
    lines += ["", "## Summary", "", "| flow | tokens | " + " | ".join(h for _, h in SUMMARY_COLUMNS) + " | rollout vs fp32 KL |",
              "|---" * (len(SUMMARY_COLUMNS) + 3) + "|"]
    for f in flows:
        s = f["summary"]
        lines.append(f"| {f['flow']} | {s.get('tokens', 0)} | " + " | ".join(_fmt(s.get(k)) for k, _ in SUMMARY_COLUMNS)
                     + f" | {_fmt(f['rollout_vs_fp32'].get('mismatch_kl'))} |")
    if flows[0]["by_length"]:
        lines += ["", "## Drift against rollout length", "", "| flow | " + " | ".join(
            f"{r['length']} tok" for r in flows[0]["by_length"]) + " |", "|---" * (len(flows[0]["by_length"]) + 1) + "|"]
        for f in flows:
            lines.append(f"| {f['flow']} | " + " | ".join(_fmt(r["mismatch_kl"]) for r in f["by_length"]) + " |")
    lines += ["", "## Drift against position (mismatch KL per bucket)", "",
              "| flow | " + " | ".join(f"{r['lo']}-{r['hi'] - 1}" for r in flows[0]["by_position"]) + " |",
              "|---" * (len(flows[0]["by_position"]) + 1) + "|"]
    for f in flows:
        lines.append(f"| {f['flow']} | " + " | ".join(_fmt(r["mismatch_kl"]) for r in f["by_position"]) + " |")
    if "drift_vs_position.png" in images:
        lines += ["", "![drift vs position](drift_vs_position.png)"]
    greedy = [f for f in flows if f.get("greedy")]
    if greedy:
        lines += ["", "## Greedy divergence", "", "| flow | length | vs training: diverged | first at (min / median) "
                  "| vs fp32: diverged | first at (min / median) |", "|---|---|---|---|---|---|"]
        for f in greedy:
            g = f["greedy"]
            vt, vf = g["vs_train"], g["vs_fp32"]
            lines.append(f"| {f['flow']} | {g['length']} | {100 * vt['diverged_frac']:.0f}% | {_fmt(vt['first_min'])} / "
                         f"{_fmt(vt['first_median'])} | {100 * vf['diverged_frac']:.0f}% | {_fmt(vf['first_min'])} / "
                         f"{_fmt(vf['first_median'])} |")
    for f in flows:
        if not f.get("layers"):
            continue
        lines += ["", f"## Where it comes from: {f['flow']}", "",
                  f"On {f['attribution_sequences']} sequences. `rel err`: relative output error vs fp32 on the fp32 "
                  "model's own input; `rollout vs train`: between the two precisions; `KL alone`: mismatch KL when "
                  "only this part runs the rollout precision -- each decoder layer, then each linear of the "
                  f"decoder layers with the largest KL ({', '.join(map(str, f.get('refined_layers', []))) or 'none'}; "
                  "`-`: not attributed alone).", ""]
        if f.get("decoder_layers"):
            lines += ["| decoder layer | KL alone |", "|---|---|"]
            lines += [f"| {d['layer']} | {_fmt(d['kl_alone'])} |" for d in f["decoder_layers"]]
            lines.append("")
        lines += ["| layer | rel err rollout | rel err train | rollout vs train | KL alone |", "|---|---|---|---|---|"]
        for r in f["layers"]:
            lines.append(f"| `{r['name']}` | {_fmt(r['rel_err_rollout'])} | {_fmt(r['rel_err_train'])} | "
                         f"{_fmt(r['rel_diff'])} | {_fmt(r['kl_alone'])} |")
        if f.get("kv_cache_kl_alone") is not None:
            lines.append(f"| KV cache | | | | {_fmt(f['kv_cache_kl_alone'])} |")
        lines += ["", "Hidden state after each decoder layer, rollout vs training forward (relative difference): "
                  + ", ".join(f"{h['layer']}: {_fmt(h['rel_diff'])}" for h in f["hidden"])]
    if "layer_error.png" in images:
        lines += ["", "![per-layer error](layer_error.png)"]
    for f in flows:
        if not f["top_tokens"]:
            continue
        lines += ["", f"## Largest mismatches: {f['flow']}", "", "| pos | context | token | logp rollout | logp train |",
                  "|---|---|---|---|---|"]
        for r in f["top_tokens"]:
            ctx = r["context"].replace("|", "\\|").replace("\n", "⏎")
            tok = r["token"].replace("|", "\\|").replace("\n", "⏎")
            lines.append(f"| {r['position']} | `…{ctx[-40:]}` | `{tok}` | {r['logp_rollout']:.4f} | "
                         f"{'-inf (cut)' if r['logp_train'] is None else format(r['logp_train'], '.4f')} |")
    return "\n".join(lines) + "\n"
