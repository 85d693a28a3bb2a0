"""The RL loop behind ``jetrl rollout`` / ``train`` / ``run``.

One step: problems for the step -> rollout (engine, rollout precision) -> rewards -> optional
dynamic sampling -> old-policy logprobs (trainer, training precision) -> mismatch metrics ->
GRPO update -> weight sync -> periodic eval -> ``metrics.jsonl`` line -> periodic checkpoint.
Every random draw is a function of ``(run.seed, step)``, so ``--resume`` from a checkpoint
continues exactly as the uninterrupted run would have.

Under ``torchrun`` (``world``: see ``jetrl_cli.distributed``) the same loop runs on every rank:
the engine samples the rank's share of the prompts and gathers everyone's, the trainer is sharded
with FSDP2, the sync gathers full weights, checkpoints go through DCP, rank 0 alone writes files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import JobConfig
from ..distributed.world import SINGLE, World
from ..engine.base import RolloutEngine, make_payload
from ..engine.embedded import EmbeddedEngine
from ..engine.sampling import SamplingParams
from ..errors import JetrlError
from ..models.hf import load_model
from ..models.lora import LoraSpec, add_adapters, load_adapters, sync_parameters
from ..models.tokenizer import Tokenizer
from ..precision import fuse
from ..precision.gemm import backend_report, check_backends, reset_resolutions
from ..tasks import PromptSource, build_task
from .algos import (CorrectionConfig, adaptive_kl_coef, advantages, importance, kl_penalty, overlong_penalty,
                    supported, token_advantages)
from .checkpoint import atomic_write_text, latest_checkpoint, load_trainer_state, save_checkpoint
from .loggers import open_loggers
from .trainer import Batch, NonFiniteError, Trainer, fold_invariant_scale

TIMING_KEYS = ("rollout_s", "score_s", "train_s", "sync_s", "eval_s", "step_s", "rollout_tokens_per_s")
# What the machine ran, not what the run computed: a resumed process (perhaps on another machine)
# records its own, so these are compared like timings, never as results.
ENVIRONMENT_KEYS = TIMING_KEYS + ("gemm_backends", "train_graphs")


def tiny_policy_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "tiny-policy"


def resolve_model_dir(path: str) -> Path:
    if not str(path).strip():
        raise JetrlError("model.path: empty (a Hugging Face model directory, or 'tiny')")
    p = tiny_policy_dir() if path == "tiny" else Path(path).expanduser()
    if not p.exists():
        raise JetrlError(f"model.path: {path}: no such directory (a Hugging Face model directory, or 'tiny')")
    if not p.is_dir():
        raise JetrlError(f"model.path: {path}: a file, not a directory (a Hugging Face model directory, or 'tiny')")
    return p


def _device(cfg: JobConfig) -> torch.device:
    """The job's device; also applies ``model.fuse`` (compiled elementwise chains on a GPU)."""
    if cfg.model.device == "cuda" and not torch.cuda.is_available():
        raise JetrlError("model.device: cuda, but torch sees no CUDA device (use model.device=cpu)")
    fuse.set_enabled(cfg.model.fuse)
    check_backends(cfg.flow, cfg.model.device)
    return torch.device(cfg.model.device)


def sampling_params(cfg: JobConfig, tok: Tokenizer, greedy: bool = False, evaluation: bool = False) -> SamplingParams:
    """The rollout's sampling (``greedy``: one greedy answer, eval's default; ``evaluation``: eval's
    ``eval.n`` samples per prompt at the rollout's temperature, top-p and top-k)."""
    stops, sequences = list(tok.eos_ids), []
    for s in cfg.rollout.stop:
        ids = tok.encode(s, special=False)  # the string as a completion spells it (no BOS)
        if not ids:
            raise JetrlError(f"rollout.stop: {s!r} encodes to no token")
        if len(ids) == 1:
            stops.append(ids[0])
        else:  # matched on these token ids: the tokenizer's own spelling of the string
            sequences.append(tuple(ids))
    r = cfg.rollout
    common = {"stop_token_ids": tuple(stops), "stop_sequences": tuple(sequences)}
    if greedy:
        return SamplingParams(cfg.eval.max_new_tokens or r.max_new_tokens, 0.0, 1.0, 0, 1, **common)
    if evaluation:  # sampled: at eval.temperature / top_p / top_k where set, else as the rollout samples
        ev = cfg.eval
        pick = lambda own, rollout: rollout if own is None else own  # noqa: E731
        return SamplingParams(ev.max_new_tokens or r.max_new_tokens, pick(ev.temperature, r.temperature),
                              pick(ev.top_p, r.top_p), pick(ev.top_k, r.top_k), ev.n, **common)
    return SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.n, **common)


def correction_config(cfg: JobConfig) -> CorrectionConfig:
    return CorrectionConfig(**dataclasses.asdict(cfg.correction))  # the preset's section, field for field


def build_engine(cfg: JobConfig, model: torch.nn.Module, model_dir: Path, flow=None, width: int | None = None):
    """The preset's rollout engine (``rollout.backend``), before its first weight sync."""
    flow = flow or cfg.flow
    r = cfg.rollout
    width = width or r.max_len
    if r.backend == "vllm":
        from ..engine.vllm_engine import VLLMEngine, VLLMSettings

        settings = VLLMSettings(r.vllm_quantization, r.vllm_dtype, r.vllm_gpu_memory_utilization,
                                r.vllm_enforce_eager, r.max_batch)
        return VLLMEngine(model_dir, flow, width, settings, device=cfg.model.device, seed=cfg.run.seed)
    return EmbeddedEngine(model, flow, width, r.max_batch, cuda_graphs=r.cuda_graphs)


@dataclass
class Job:
    cfg: JobConfig
    model_dir: Path
    tokenizer: Tokenizer
    source: PromptSource
    engine: RolloutEngine
    sampling: SamplingParams
    trainer: Trainer | None = None


def setup(cfg: JobConfig, with_trainer: bool, init_dir: Path | None = None, world: World = SINGLE) -> Job:
    """Load the policy (from ``init_dir`` when resuming), build task, engine and trainer, first sync."""
    model_dir = resolve_model_dir(cfg.model.path)
    tok = Tokenizer.from_dir(model_dir)
    dev = _device(cfg)
    task = fitted_task(cfg, tok, cfg.run.seed)  # before the model loads: a dataset that cannot run fails in seconds
    lora = LoraSpec.from_config(cfg.model)
    # a LoRA checkpoint's model.safetensors is the merged model: a resume loads the base and the adapters
    model = load_model(init_dir if init_dir is not None and lora is None else model_dir).to(dev)
    if lora is not None:
        add_adapters(model, lora, cfg.run.seed)
        if init_dir is not None or cfg.model.lora_path:  # a resume's own adapters, else the preset's to start from
            load_adapters(model, init_dir if init_dir is not None else Path(cfg.model.lora_path).expanduser())
    limit = model.config.max_position_embeddings
    if cfg.rollout.max_len > limit:  # vLLM refuses it too: positions past the table were never trained
        raise JetrlError(f"rollout.max_len: {cfg.rollout.max_len} is longer than the model's {limit} positions "
                         f"(max_position_embeddings in {model_dir}/config.json); set rollout.max_len <= {limit}")
    if tok.vocab_size > model.config.vocab_size:
        raise JetrlError(f"{model_dir}: tokenizer has {tok.vocab_size} tokens, the model only {model.config.vocab_size}")
    source = PromptSource(task, cfg.run.seed)
    s = cfg.train.invariant_scale
    ref = None
    if with_trainer and cfg.train.kl_coef > 0 and lora is not None:
        ref = model  # the base policy: the model with its adapters off (Trainer.score)
    elif with_trainer and cfg.train.kl_coef > 0:
        ref = load_model(model_dir).to(dev)
        if s != 1.0:
            fold_invariant_scale(ref, s)
    if s != 1.0 and init_dir is None:
        fold_invariant_scale(model, s)
    sampling = sampling_params(cfg, tok)
    engine = build_engine(cfg, model, model_dir)  # before the trainer, which may shard the model
    engine.load_weights(make_payload(model, cfg.flow, params=sync_parameters(model, engine, first=True)))
    trainer = None
    if with_trainer:
        args = (model, cfg.flow, cfg.train, correction_config(cfg), sampling, cfg.rollout.max_len, ref)
        if world.distributed:
            from ..distributed.trainer import ShardedTrainer

            trainer = ShardedTrainer(*args, world=world)
        else:  # a LoRA trainer holds its frozen layers' operands only, where the engine never needs the merged
            # weights (vLLM does, at every sync)
            trainer = Trainer(*args, hold_frozen=lora is not None and getattr(engine, "runs_adapters", False))
    if world.distributed:
        from ..distributed.rollout import ShardedEngine

        engine = ShardedEngine(engine, world)
    return Job(cfg, model_dir, tok, source, engine, sampling, trainer)


def fitted_task(cfg: JobConfig, tok: Tokenizer, seed: int, strict: bool = True):
    """The preset's task, its prompts fitted to the engine (``fit_prompts``). ``strict=False``, for a command
    that chooses its own lengths (``mismatch-report``, ``bench``): only what ``task.overlong_prompts: drop``
    leaves out of the run is left out, with no error for a prompt that does not fit."""
    task = build_task(cfg.task, seed, source=cfg.source)
    if strict or cfg.task.overlong_prompts == "drop":
        fit_prompts(cfg, task, tok)
    return task


def fit_prompts(cfg: JobConfig, task, tok: Tokenizer) -> None:
    """Every prompt of a dataset task (encoded as the rollout will encode it) leaves room in ``rollout.max_len``
    for its new tokens (the eval's ``eval.max_new_tokens`` for the held-out split); the ones that do not are
    an error naming the longest, or with ``task.overlong_prompts: drop`` are left out of their split
    (``task.prompts_dropped``). Checked once at start: otherwise the first step that drew one would stop."""
    inner = getattr(task, "inner", task)
    split = getattr(inner, "split", None)
    if split is None:  # the built-in tasks' prompts are a few tokens
        return
    r = cfg.rollout
    dropped = {}
    for name, new, key in (("train", r.max_new_tokens, "rollout.max_new_tokens"),
                           ("eval", cfg.eval.max_new_tokens or r.max_new_tokens,
                            "eval.max_new_tokens" if cfg.eval.max_new_tokens else "rollout.max_new_tokens")):
        probs = split[name]
        lengths = [len(x) for x in tok.encode_prompts(probs, task.chat)[1]]
        room = r.max_len - new
        long = [i for i, n in enumerate(lengths) if n > room]
        if not long:
            continue
        if cfg.task.overlong_prompts == "drop":
            keep = [p for p, n in zip(probs, lengths) if n <= room]
            if not keep:
                raise JetrlError(f"task.overlong_prompts: drop leaves no {name} prompt: every one is longer than "
                                 f"{room} tokens (rollout.max_len {r.max_len} - {key} {new}); raise rollout.max_len")
            split[name] = keep
            dropped[name] = len(long)
            continue
        worst = max(long, key=lambda i: lengths[i])
        raise JetrlError(f"{probs[worst].where or 'task.file'}: prompt of {lengths[worst]} tokens; {len(long)} of "
                         f"{len(probs)} {name} prompts are longer than the {room} that rollout.max_len {r.max_len} "
                         f"leaves beside {key} {new}: raise rollout.max_len, or set task.overlong_prompts: drop "
                         "to leave them out (verl's filter_overlong_prompts)")
    task.prompts_dropped = dropped


def rollout_samples(job: Job, problems, seed: int, sampling: SamplingParams | None = None,
                    step: int = 0, group_offset: int = 0) -> list[dict]:
    """Each problem's completions with their rewards. Training rollouts (the job's own sampling)
    get the task's overlong shaping (``task.overlong_buffer``) added to the reward, as
    ``overlong_penalty``; evaluation (other sampling) reports the task's reward alone."""
    sp = sampling or job.sampling
    tok = job.tokenizer
    task_cfg = job.cfg.task
    buffer = task_cfg.overlong_buffer if sampling is None else 0
    texts, prompt_ids = tok.encode_prompts(problems, job.source.task.chat)
    groups = job.engine.generate(prompt_ids, sp, seed)
    out = []
    for gi, (prob, ptext, pids, comps) in enumerate(zip(problems, texts, prompt_ids, groups)):
        for c in comps:
            text = tok.decode(c.tokens)
            s = {
                "step": step, "group": group_offset + gi, "prompt": ptext, "answer": prob.answer,
                "completion": text, "extracted": job.source.task.extract(text), "prompt_ids": pids, "tokens": c.tokens, "logprobs": c.logprobs,
                "reward": job.source.task.reward(prob, text), "correct": job.source.task.correct(prob, text),
                "finish_reason": c.finish_reason,
            }
            if buffer:
                s["task_reward"] = s["reward"]
                s["overlong_penalty"] = overlong_penalty(len(c.tokens), sp.max_new_tokens, buffer,
                                                         task_cfg.overlong_penalty)
                s["reward"] += s["overlong_penalty"]
            out.append(s)
    return out


def evaluate(job: Job, n: int) -> tuple[dict, list[dict]]:
    """The held-out split's metrics on ``n`` prompts: ``eval_accuracy`` (the share of correct
    answers: greedy, or with ``eval.n`` > 1 the mean over each prompt's samples, mean@n) and with
    ``eval.n`` > 1 ``eval_pass_at_n`` (the share of prompts with a correct sample). A dataset whose rows
    name more than one ``data_source`` (verl's field) gets the same metrics per source too, as
    ``eval_accuracy/<source>`` (and ``eval_pass_at_n/<source>``)."""
    probs = job.source.eval_set(n)
    k = job.cfg.eval.n
    t = job.cfg.eval.temperature
    sampled = k > 1 or (t is not None and t > 0)  # greedy: n 1 with eval.temperature unset or 0
    sp = sampling_params(job.cfg, job.tokenizer, greedy=not sampled, evaluation=sampled)
    samples = rollout_samples(job, probs, seed=0, sampling=sp)
    out = _eval_metrics(samples, k, "")
    sources = [(p.meta or {}).get("data_source") for p in probs]
    named = sorted({str(x) for x in sources if x is not None})
    if len(named) > 1:
        for src in named:
            rows = [s for i, s in enumerate(samples) if str(sources[i // k]) == src and sources[i // k] is not None]
            out.update(_eval_metrics(rows, k, f"/{src}"))
    return out, samples


def _eval_metrics(samples: list[dict], k: int, suffix: str) -> dict:
    """``eval_accuracy`` (mean@k) and with k > 1 ``eval_pass_at_n`` of ``samples`` (k per prompt, in order)."""
    out = {f"eval_accuracy{suffix}": sum(s["correct"] for s in samples) / len(samples)}
    if k > 1:
        out[f"eval_pass_at_n{suffix}"] = sum(any(s["correct"] for s in samples[i:i + k])
                                             for i in range(0, len(samples), k)) / (len(samples) // k)
    return out


def batch_from_samples(samples: list[dict], pad_id: int) -> Batch:
    return Batch.build([s["prompt_ids"] for s in samples], [s["tokens"] for s in samples],
                       [s["logprobs"] for s in samples], [s["reward"] for s in samples],
                       [s["group"] for s in samples], pad_id)


def train_on_samples(job: Job, samples: list[dict], step: int) -> dict:
    """Score (training precision), mismatch metrics, advantages and the update, for one batch."""
    tr = job.trainer
    n = job.sampling.n
    b = batch_from_samples(samples, job.tokenizer.pad_id)
    t0 = time.perf_counter()
    old, entropy = tr.score(b, entropy=True)
    ref = tr.score(b, ref=True) if tr.ref is not None else None
    score_s = time.perf_counter() - t0
    imp = importance(old, b.rollout_logp, b.mask, tr.ccfg, tr.cfg.clip_high)
    adv, kl_stats = batch_advantages(b, old, ref, tr.cfg, n, tr.kl_coef)
    if tr.cfg.kl_in_reward and tr.cfg.kl_ctrl == "adaptive":  # the next step's coefficient
        tr.kl_coef = adaptive_kl_coef(tr.kl_coef, kl_stats["kl_reward"], len(b), tr.cfg.kl_target, tr.cfg.kl_horizon)
    t0 = time.perf_counter()
    stats = tr.update(b, adv, old, None if tr.cfg.kl_in_reward else ref, step)
    out = {**imp.metrics, **kl_stats, **stats, "entropy": float(entropy[b.mask].mean()) if b.mask.any() else None,
           "score_s": score_s, "train_s": time.perf_counter() - t0}
    return out


def batch_advantages(b: Batch, old: torch.Tensor, ref: torch.Tensor | None, cfg, n: int,
                     kl_coef: float | None = None) -> tuple[torch.Tensor, dict]:
    """The batch's advantages under ``cfg.adv_estimator`` -- one per sequence ``(N,)``, or one per token
    ``(N, T)`` for ``reinforce_plus_plus`` -- and, with ``cfg.kl_in_reward``, the KL statistics.

    ``kl_in_reward`` (verl's ``use_kl_in_reward`` with a fixed coefficient): each completion token's
    reward is ``-kl_coef * KL`` (``kl_estimator``'s estimate, from the trainer's scores ``old`` and the
    reference policy's ``ref``, as verl's from its old logprobs), besides the task's reward at the last
    token; the estimators that take one reward a sequence take the sum, ``reward - kl_coef * sum KL``. The
    loss then has no KL term. ``kl_coef``: the step's coefficient (``train.kl_ctrl: adaptive`` moves it), else
    ``cfg.kl_coef``."""
    coef = cfg.kl_coef if kl_coef is None else kl_coef
    rewards, token_rewards, stats = b.rewards, None, {}
    if cfg.kl_in_reward:  # not at tokens beyond the policy's top-k/top-p cut: they leave the loss (``supported``)
        kl = torch.where(supported(b.mask, old), kl_penalty(old, ref, cfg.kl_estimator), 0.0)
        token_rewards = -coef * kl
        rewards = rewards + token_rewards.sum(-1)
        per_seq = kl.sum(-1) / b.mask.sum(-1).clamp_min(1)
        stats = {"kl_reward": float(per_seq.mean()), "kl_reward_coef": coef}
    if cfg.adv_estimator == "reinforce_plus_plus":
        return token_advantages(b.rewards, b.mask, token_rewards), stats
    groups = b.group.unique()
    grouped = torch.stack([rewards[b.group == g] for g in groups])
    if grouped.shape[1] != n:
        raise JetrlError(f"every group needs {n} samples (rollout.n); got groups of {grouped.shape[1]}")
    lengths = torch.stack([b.mask[b.group == g].sum(-1) for g in groups])
    adv_g = advantages(grouped, lengths, cfg.adv_estimator, cfg.adv_norm)
    adv = torch.empty(len(b))
    for i, g in enumerate(groups):
        adv[b.group == g] = adv_g[i]
    return adv, stats


def _drop_flat_groups(samples: list[dict]) -> list[list[dict]]:
    """Dynamic sampling (DAPO): the groups whose samples' task rewards are not all equal (one with
    every answer right or every answer wrong teaches nothing). The task's reward, before overlong
    shaping: DAPO filters on accuracy, and shaping alone would keep an all-correct group whose
    lengths differ."""
    by: dict[int, list[dict]] = {}
    for s in samples:
        by.setdefault(s["group"], []).append(s)
    return [g for g in by.values() if len({x.get("task_reward", x["reward"]) for x in g}) > 1]


# What a resumed run may change (the rest would make it another run than the one it continues).
RESUMABLE = ("train.steps", "run.checkpoint_every", "run.keep_checkpoints", "run.log_samples", "run.loggers",
             "run.wandb_project", "run.out_dir")


def resume_differences(saved: JobConfig, cfg: JobConfig) -> list[str]:
    """The settings in which ``cfg`` differs from ``saved`` (the run's ``preset.yaml``) beyond
    ``RESUMABLE``, as ``key: saved -> new``."""
    import dataclasses

    diff = []
    if dataclasses.replace(saved.flow, name="") != dataclasses.replace(cfg.flow, name=""):
        diff.append(f"precision: {saved.flow.short_str()} -> {cfg.flow.short_str()}")
    for sec in ("model", "task", "rollout", "train", "correction", "eval", "run"):
        a, b = dataclasses.asdict(getattr(saved, sec)), dataclasses.asdict(getattr(cfg, sec))
        diff += [f"{sec}.{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k] and f"{sec}.{k}" not in RESUMABLE]
    return diff


def _check_resumable(cfg: JobConfig, out: Path) -> None:
    """A resumed run continues the run in ``out`` only with that run's settings (its ``preset.yaml``)."""
    from ..config import build_job_config
    from ..presets_io import load_yaml

    saved_file = out / "preset.yaml"
    if not saved_file.exists():
        return
    saved = build_job_config(load_yaml(saved_file), str(saved_file), cfg.name)
    if cfg.train.steps != saved.train.steps and "cosine" in (cfg.train.lr_schedule, saved.train.lr_schedule):
        raise JetrlError(f"train.steps: {saved.train.steps} -> {cfg.train.steps} would stretch this run's cosine "
                         "learning-rate schedule mid-run (the rate jumps at the next step); keep train.steps, or start "
                         "a new run from the checkpoint (--set model.path=OUT/checkpoints/step_N, -o NEW)")
    diff = resume_differences(saved, cfg)
    if diff:
        raise JetrlError(f"{out}: --resume continues this run with its own settings ({saved_file}), but "
                         f"{diff[0]}{f' (and {len(diff) - 1} more)' if len(diff) > 1 else ''}; only "
                         f"{', '.join(RESUMABLE)} may change (start a new run with -o or --force)")


def _read_steps(path: Path) -> list[tuple[int, str]]:
    """``(step, line)`` of each line of a run's ``metrics.jsonl`` or ``rollouts.jsonl``. A last line cut
    short (a run killed while writing it) is dropped: its step had no checkpoint yet, and the resumed
    run writes it again. Any other line that is not a JSON object with an integer ``step`` is damage
    the resumed run would carry on: a one-line error names it."""
    try:
        rows = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise JetrlError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for i, x in enumerate(rows, 1):
        if not x.strip():
            continue
        try:
            row = json.loads(x)
        except json.JSONDecodeError as e:
            if i == len(rows):
                break
            raise JetrlError(f"{path}:{i}: not a JSON line ({e.msg}); the file is damaged") from None
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise JetrlError(f"{path}:{i}: a line without an integer \"step\"; the file is damaged")
        out.append((step, x))
    return out


def _read_metrics(path: Path) -> list[dict]:
    """``metrics.jsonl``'s lines (``_read_steps``' rules)."""
    return [json.loads(x) for _, x in _read_steps(path)]


def _orphaned_runs(out: Path) -> list[Path]:
    """Runs that ``--force`` moved aside from ``out`` (``_Replaced``) and that no live process holds: the
    process was killed before its new run's first checkpoint, so nothing put them back."""
    found = []
    for p in out.parent.glob(f".{out.name}.replaced-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            found.append(p)
        except PermissionError:  # alive, another user's
            pass
    return sorted(found)


def _settle_orphans(out: Path, delete: bool = True) -> None:
    """Before a run starts in ``out``: a run ``--force`` moved aside is deleted if the run that replaced it
    wrote a checkpoint (as ``--force`` would have, had it not been killed in between); otherwise it is the
    only copy of the old run's checkpoints, and the user decides (a one-line error says how)."""
    import shutil

    for p in _orphaned_runs(out):
        if (out / "latest").exists():
            if delete:
                shutil.rmtree(p, ignore_errors=True)
        else:
            raise JetrlError(f"{p}: the run that --force replaced in {out}, kept because the new run was stopped "
                             f"before its first checkpoint; put it back (rm -r {out} && mv {p} {out}) or delete it, "
                             "then run again")


def _check_replaceable(cfg: JobConfig, out: Path) -> None:
    """``--force``: ``out`` is a run that may be deleted (checked before any work; deleted only once
    the new run has set up)."""
    if not out.exists():
        return
    if not ((out / "metrics.jsonl").exists() or (out / "preset.yaml").exists()):
        raise JetrlError(f"{out}: not a jetrl run directory (no metrics.jsonl); --force only replaces runs")
    model = resolve_model_dir(cfg.model.path).resolve()
    if model == out.resolve() or out.resolve() in model.parents:
        raise JetrlError(f"model.path: {cfg.model.path} lies inside {out}, which --force would delete; copy the "
                         "checkpoint out of the run first, or write the new run elsewhere (-o)")


def run(cfg: JobConfig, out: Path, resume: bool = False, on_step: Callable[[dict], None] | None = None,
        on_eval: Callable[[list[dict]], None] | None = None, stop_after: int | None = None,
        on_resume: Callable[[int, Path], None] | None = None, world: World = SINGLE,
        replace: bool = False) -> list[dict]:
    """The training loop. Returns the metrics lines written; ``stop_after`` (tests) stops early
    as a kill would, after that step's checkpoint (if any) is written. ``on_resume(step, checkpoint)``
    is told the first step a resumed run will run. ``out`` is created only once the model, task
    and engine are set up, so a run that fails to start leaves no directory behind; with
    ``replace`` (``--force``) a previous run there is deleted then, not before. Under torchrun
    every rank calls it (``world``); the metrics are global, and rank 0 writes them and calls the
    callbacks."""
    writer = world.is_writer
    metrics_file = out / "metrics.jsonl"
    rollouts_file = out / "rollouts.jsonl"
    if replace and resume:
        raise JetrlError("--force and --resume contradict each other")
    _settle_orphans(out, delete=writer)
    ckpt = latest_checkpoint(out) if resume else None
    if resume and ckpt is None and metrics_file.exists():
        raise JetrlError(f"{out}: --resume, but there is no complete checkpoint to resume from")
    if resume and ckpt is None:
        raise JetrlError(f"{out}: --resume, but there is no run here to resume (no checkpoint); "
                         "drop --resume to start a new run")
    if resume and not metrics_file.exists():
        raise JetrlError(f"{out}: holds checkpoints but no metrics.jsonl: not a run of jetrl run (jetrl train's "
                         f"output?); to start a run from its checkpoint: --set model.path={ckpt}")
    if resume:
        _check_resumable(cfg, out)
    if replace and cfg.train.steps == 0 and out.exists():
        raise JetrlError(f"{out}: --force with train.steps: 0 would replace this run with one that writes no "
                         "checkpoint; write the evaluation elsewhere (-o)")
    loggers = open_loggers(cfg.run.loggers, cfg.run.wandb_project)  # a missing optional package fails before any work
    if replace:
        _check_replaceable(cfg, out)
    elif not resume and (metrics_file.exists() or (out / "latest").exists()):
        raise JetrlError(f"{out}: already holds a run (--resume continues it, --force starts over, "
                         "-o picks another directory)")
    elif not resume and out.is_dir() and any(out.iterdir()):
        raise JetrlError(f"{out}: a directory with other files in it (not a jetrl run); -o names a new or empty "
                         "directory for the run")
    reset_resolutions()  # the backends recorded in metrics.jsonl are this run's
    world.barrier()  # every rank has checked the directory before rank 0 writes to it
    job = setup(cfg, with_trainer=True, init_dir=ckpt, world=world)
    replaced = None
    if replace and out.exists():
        world.barrier()  # every rank has set up before rank 0 moves the old run aside
        if writer:
            replaced = _Replaced(out)
        world.barrier()
    tr = job.trainer
    transport = world.transport()
    lines: list[dict] = []
    start = 1
    if ckpt is not None:
        from ..distributed.checkpoint import restore_trainer

        start = restore_trainer(tr, ckpt, world) + 1
        tr.kl_coef = load_trainer_state(ckpt).get("kl_coef", cfg.train.kl_coef)  # an adaptive one as it was
        if on_resume and writer:
            on_resume(start, ckpt)
        if start > cfg.train.steps:  # complete: nothing to run, nothing rewritten (on_resume said so)
            return _read_metrics(metrics_file)
        lines = [m for m in _read_metrics(metrics_file) if m["step"] < start]
        kept = [x for step, x in _read_steps(rollouts_file) if step < start] if rollouts_file.exists() else None
        world.barrier()  # every rank has read the metrics before rank 0 rewrites them
        if writer:  # each file replaced whole: a kill meanwhile leaves the old one, which the next resume cuts
            atomic_write_text(metrics_file, "".join(json.dumps(m) + "\n" for m in lines))
        if writer and kept is not None:
            atomic_write_text(rollouts_file, "".join(x + "\n" for x in kept))
    import yaml

    made = writer and not out.exists()
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "preset.yaml", yaml.safe_dump(cfg.raw, sort_keys=False))
        loggers.start(out, start, {**cfg.raw, "flow": cfg.flow.name})
    try:
        lines = _steps(job, cfg, out, start, ckpt, lines, loggers, transport, on_step, on_eval, stop_after, world,
                       replaced)
    except BaseException as e:
        if replaced is not None:
            loggers.close()
        if replaced is not None and replaced.restore():  # the new run wrote no checkpoint: the old one is back
            if isinstance(e, JetrlError) and e.args:
                e.args = (f"{e.args[0]}; the previous run in {out} is kept (--force replaces it only once the "
                          "new run has written a checkpoint)",)
        elif isinstance(e, JetrlError) and made and not metrics_file.exists():  # failed before its first line
            import shutil  # (the first eval's rollout): a run that cannot start leaves no directory

            loggers.close()
            shutil.rmtree(out, ignore_errors=True)
        raise
    if replaced is not None:
        replaced.settle()
    return lines


class _Replaced:
    """``--force``'s previous run, moved aside (beside ``out``, hidden) until the new run has written a
    checkpoint of its own; put back if it fails before that."""

    def __init__(self, out: Path):
        import os

        self.out, self.aside = out, out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(self.aside)

    def settle(self) -> None:
        """The new run has a checkpoint: the old run is deleted."""
        if self.aside is not None:
            import shutil

            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None

    def restore(self) -> bool:
        """The new run failed before its first checkpoint: its directory is deleted and the old run put back
        (False where the old run was deleted already)."""
        if self.aside is None:
            return False
        import shutil

        shutil.rmtree(self.out, ignore_errors=True)
        self.aside.rename(self.out)
        self.aside = None
        return True


def _steps(job: Job, cfg: JobConfig, out: Path, start: int, ckpt: Path | None, lines: list[dict], loggers, transport,
           on_step, on_eval, stop_after: int | None, world: World, replaced: _Replaced | None = None) -> list[dict]:
    """``run``'s steps from ``start`` on, in the directory it has set up (``replaced``: the run ``--force``
    replaces, deleted once the first checkpoint is written)."""
    writer = world.is_writer
    tr = job.trainer
    metrics_file = out / "metrics.jsonl"
    rollouts_file = out / "rollouts.jsonl"

    def emit(m: dict):
        lines.append(m)
        if not writer:
            return
        with metrics_file.open("a") as f:
            f.write(json.dumps(m) + "\n")
        loggers.log(m)
        if on_step:
            on_step(m)

    if start == 1 and cfg.eval.before_train:
        t0 = time.perf_counter()
        ev_metrics, samples = evaluate(job, cfg.eval.prompts)
        emit({"step": 0, **ev_metrics, "eval_s": time.perf_counter() - t0})
        if on_eval and writer:
            on_eval(samples)
    last_good = ckpt
    last_report = last_graphs = None
    steps = cfg.train.steps
    for step in range(start, steps + 1):
        t_step = time.perf_counter()
        seed = cfg.run.seed * 1_000_033 + step
        t0 = time.perf_counter()
        r = cfg.rollout
        samples = rollout_samples(job, job.source.batch(step, r.prompts_per_step), seed, step=step)
        all_samples = samples
        if cfg.train.dynamic_sampling:
            kept = _drop_flat_groups(samples)
            for rnd in range(1, cfg.train.dynamic_sampling_rounds + 1):
                if len(kept) >= r.prompts_per_step:
                    break
                more = rollout_samples(job, job.source.batch(step, r.prompts_per_step, round_=rnd), seed + 7919 * rnd,
                                       step=step, group_offset=rnd * r.prompts_per_step)
                all_samples = all_samples + more
                kept += _drop_flat_groups(more)
            train_samples = [s for g in kept[:r.prompts_per_step] for s in g]
        else:
            train_samples = samples
        rollout_s = time.perf_counter() - t0
        if cfg.run.save_rollouts and writer:
            with rollouts_file.open("a") as f:
                for s in all_samples:
                    f.write(json.dumps({**s, "model": str(job.model_dir), "flow": cfg.flow.name,
                                        "policy_updates": step - 1}) + "\n")
        gen_tokens = sum(len(s["tokens"]) for s in all_samples)
        m = {
            "step": step,
            "reward_mean": sum(s["reward"] for s in samples) / len(samples),
            "accuracy": sum(s["correct"] for s in samples) / len(samples),
            "answer_found": sum(s["extracted"] is not None for s in samples) / len(samples),
            "response_len": gen_tokens / len(all_samples),
            "truncated": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
            "groups_trained": len(train_samples) // r.n,
        }
        for name, n in (getattr(job.source.task, "prompts_dropped", None) or {}).items():
            m[f"prompts_dropped_{name}"] = n  # task.overlong_prompts: drop (constant over the run)
        if cfg.task.overlong_buffer:
            m["overlong_penalty"] = sum(s["overlong_penalty"] for s in samples) / len(samples)
        if train_samples:
            try:
                m.update(train_on_samples(job, train_samples, step))
            except NonFiniteError as e:
                where = f"; last good checkpoint: {last_good}" if last_good else "; no checkpoint was written"
                raise NonFiniteError(f"{e}{where}") from None
        else:
            m.update({"mismatch_kl": None, "skipped": True, "score_s": 0.0, "train_s": 0.0})
        t0 = time.perf_counter()
        payload = transport.payload(tr.model, cfg.flow, version=step, params=sync_parameters(tr.model, job.engine))
        job.engine.load_weights(payload)
        m["sync_s"] = time.perf_counter() - t0
        m["sync_bytes"] = payload.nbytes
        m["lr"] = tr.lr_at(step)
        m["rollout_s"] = rollout_s
        m["rollout_tokens_per_s"] = gen_tokens / max(rollout_s, 1e-9)
        m["step_s"] = time.perf_counter() - t_step  # the eval below is timed on its own (eval_s)
        if (cfg.eval.every and step % cfg.eval.every == 0) or step == steps:
            t0 = time.perf_counter()
            ev_metrics, ev = evaluate(job, cfg.eval.prompts)
            m.update(ev_metrics)
            m["eval_s"] = time.perf_counter() - t0
            if on_eval and writer:
                on_eval(ev)
        report = backend_report()
        if report != last_report and (report["resolved"] or report["fallbacks"] or "fused" in report
                                      or "kernels" in report):
            m["gemm_backends"] = report  # which backend runs each 8-bit GEMM (this process), and any fallbacks
            last_report = report
        if cfg.train.cuda_graphs:  # the trainer's CUDA graphs: shapes captured, or why they are off
            graphs = getattr(tr, "graphs", None)
            state = graphs.state() if graphs is not None else "off: not on a GPU"
            if state != last_graphs:
                m["train_graphs"] = last_graphs = state
        emit(m)  # before the checkpoint: a resume truncates metrics back to its checkpoint's step
        if (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0) or step == steps:
            extra = {"preset": cfg.name, "invariant_scale": cfg.train.invariant_scale, "kl_coef": tr.kl_coef}
            if world.distributed:
                from ..distributed.checkpoint import save_sharded_checkpoint

                last_good = save_sharded_checkpoint(out, step, tr, world, job.model_dir, extra,
                                                    cfg.run.keep_checkpoints)
            else:
                last_good = save_checkpoint(out, step, tr.model, tr.opt, job.model_dir, extra,
                                            cfg.run.keep_checkpoints)
            if replaced is not None:
                replaced.settle()
        if stop_after is not None and step >= stop_after:
            break
    if writer:
        loggers.close()
    if lines and writer:
        try:
            from .plots import plot_curves

            plot_curves([(cfg.name, lines)], out / "curves.png")
        except ImportError:
            pass
    return lines
