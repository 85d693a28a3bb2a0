"""The preset schema: every section and key a preset may set, with defaults and checks.

``load_job_config(preset, overrides)`` reads a preset file (``presets_io``), applies ``key.sub=value``
overrides, and returns a ``JobConfig``; any unknown key, wrong type or out-of-range value is a
one-line ``PresetError`` naming the file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from . import choices
from .errors import PresetError
from .precision.flow import PrecisionFlow, parse_flow

LOGGERS = ("jsonl", "tensorboard", "wandb")  # run.loggers; jetrl_cli.rl.loggers writes them
# rollout.temperature's floor. Below it sampling is greedy in effect: the logits are multiplied by 20 or more, so a
# 0.25-nat gap between the two likeliest tokens is already 150:1 odds and a GRPO group's samples come out the same
# (every advantage 0), the case temperature 0 is refused for; the rollout-vs-trainer logit differences of an
# off-policy flow are multiplied as much. vLLM does not sample that low either (below 0.01 it samples at 0.01,
# below 1e-5 greedily), and RL recipes sample at 0.6 to 1.2.
MIN_TEMPERATURE = 0.05


@dataclass(frozen=True)
class ModelConfig:
    path: str = "tiny"  # a Hugging Face model directory, or "tiny": the policy shipped with jetrl
    device: str = "cpu"  # cpu | cuda
    fuse: bool = True  # on a GPU: RMSNorm, SwiGLU and RoPE as one compiled kernel each (precision/fuse.py)
    # LoRA (verl's lora_rank / lora_alpha / target_modules): rank-r adapters on these layers train, the rest is
    # frozen; 0: full fine-tuning. The adapters run in precision.skip_format, the frozen layers in the flow's
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
    lora_target_modules: str | list[str] = "all-linear"  # all-linear, or names among q_proj .. down_proj
    lora_path: str | None = None  # adapters to start from: a PEFT LoRA directory (adapter_model.safetensors)


@dataclass(frozen=True)
class TaskConfig:
    name: str = "arith"  # arith | sort | count | mix | jsonl
    digits: int = 3  # arith: digits per operand (completion length grows ~9 tokens per digit)
    length: int = 6  # sort / count: items in the problem
    file: str | list[str] | None = None  # jsonl: the training data (JSONL or Parquet; a list: their rows in turn)
    eval_file: str | list[str] | None = None  # jsonl: held-out data (default: eval_fraction of file)
    eval_fraction: float = 0.1
    max_samples: int = 0  # jsonl: at most this many training rows, a seeded subset (verl's train_max_samples; 0: all)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_template: str = "{prompt}"  # str.format over the row's fields
    # "package.module:function" or "path/to/file.py:function": (prompt, completion, answer) -> float, or
    # verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}
    reward: str | None = None
    # how a completion's final answer is read: auto (\boxed{}, ####, else the last number) | boxed_or_gsm8k
    # | boxed | gsm8k | last_number; default: auto for jsonl, boxed_or_gsm8k for the built-in tasks
    answer_format: str | None = None
    # DAPO's overlong reward shaping: a completion longer than rollout.max_new_tokens - overlong_buffer
    # tokens loses overlong_penalty x (excess / overlong_buffer), up to overlong_penalty at the limit (0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # the model directory's chat template around each prompt (as verl's datasets): null (auto) = on when the
    # jsonl rows' prompts are lists of {role, content} messages | true (a string prompt becomes one user
    # message) | false
    chat_template: bool | None = None
    system_prompt: str | None = None  # with a chat template: a system message before each prompt's messages
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to the template, e.g. {enable_thinking: false}
    # a dataset prompt too long for rollout.max_len with its new tokens: error (at start, naming the row) | drop
    # (left out at start, as verl's filter_overlong_prompts; counted in metrics.jsonl's prompts_dropped)
    overlong_prompts: str = "error"


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = "embedded"  # embedded | vllm (pip install 'jetrl[vllm]')
    prompts_per_step: int = 16
    n: int = 8  # samples per prompt (the GRPO group)
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)  # extra stop strings (one token, or a token sequence)
    max_len: int = 128  # engine width: the longest prompt + completion
    max_batch: int = 256  # sequences decoded together
    cuda_graphs: bool = True  # embedded engine on a GPU: replay decode steps as CUDA graphs
    # backend: vllm only
    vllm_quantization: str = "jetrl"  # jetrl (the flow's quantizers) | fp8 | fp8-block | none (vLLM's own)
    vllm_dtype: str = "float32"  # vLLM's activation dtype: float32 (as jetrl's model) | bfloat16 | float16
    vllm_gpu_memory_utilization: float = 0.4  # share of GPU memory vLLM may take (the trainer shares the GPU)
    vllm_enforce_eager: bool | None = None  # default: eager on CPU, CUDA graphs on GPU


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 40
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0  # linear warmup: step s of the first warmup_steps trains at lr * s / warmup_steps
    lr_schedule: str = "constant"  # after the warmup: constant | cosine (down to lr * min_lr_ratio at the last step)
    min_lr_ratio: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    policy_loss: str = "ppo"  # ppo (a ratio per token) | gspo (a ratio per sequence; clip at 3e-4 / 4e-4)
    dual_clip: float = 0.0  # > 1: dual-clip PPO, a negative advantage's term bounded at dual_clip * A (0: off)
    adv_estimator: str = "grpo"  # grpo | rloo | reinforce_plus_plus (per-token returns) | reinforce_plus_plus_baseline
    adv_norm: str = "std"  # grpo: std (GRPO) | none (Dr. GRPO)
    # token-mean (DAPO) | seq-mean-token-mean (GRPO) | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO)
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0  # entropy bonus: the loss minus entropy_coef x the policy's entropy (0: off)
    # of KL(pi || pi_ref) per token: k1 | k2 | k3 | abs | k1+ | k3+ (verl: kl, mse, low_var_kl, abs, k1+, k3+)
    kl_estimator: str = "k3"
    kl_in_reward: bool = False  # the kl_coef penalty in the reward, per token, not in the loss (verl's use_kl_in_reward)
    # the in-reward KL coefficient (verl's algorithm.kl_ctrl): fixed at kl_coef, or adaptive (Ziegler et al.: moved
    # each step toward kl_target, by at most 20% x sequences / kl_horizon)
    kl_ctrl: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = 3  # extra rollout rounds to refill dropped groups
    ppo_epochs: int = 1
    minibatches: int = 1
    micro_batch: int = 64  # sequences per forward/backward
    # > 0: also at most this many tokens per forward/backward (sequences x the longest's length), the sequences
    # grouped longest first (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu); 0: micro_batch alone
    micro_batch_tokens: int = 0
    cuda_graphs: bool = False  # on a GPU: replay the decoder layers' forward and backward as CUDA graphs
    # keep each decoder layer's input only; its backward recomputes the layer's forward (verl's
    # enable_gradient_checkpointing): activation memory of one layer instead of all, for ~1/3 more compute
    activation_checkpointing: bool = False
    invariant_scale: float = 1.0  # QuRL invariant scaling s (1: off)


@dataclass(frozen=True)
class CorrectionSection:
    type: str = "none"  # none | tis | mis | acr
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    mis_level: str = "token"  # token | sequence
    tis_level: str = "token"  # tis / acr weight: token | sequence (ratio product) | geometric (its geometric mean)


@dataclass(frozen=True)
class EvalConfig:
    every: int = 10  # steps between evaluations (0: never; the last step always)
    prompts: int = 64
    max_new_tokens: int | None = None  # default: rollout.max_new_tokens
    n: int = 1  # 1: one greedy answer per prompt; > 1: n sampled at the rollout's temperature/top-p/top-k (mean@n, pass@n)
    # the eval's own sampling (verl's val_kwargs); unset: greedy with n 1, the rollout's with n > 1. temperature 0
    # is greedy (n must be 1); top_p / top_k apply to sampled evals and default to the rollout's
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    before_train: bool = True  # evaluate at step 0, before the first update (verl's val_before_train)


@dataclass(frozen=True)
class RunConfig:
    out_dir: str | None = None  # default runs/<preset name>
    seed: int = 0
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    log_samples: int = 2  # completions printed per eval
    save_rollouts: bool = True  # append each step's samples to rollouts.jsonl (for mismatch-report)
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])  # jsonl | tensorboard | wandb (pip install 'jetrl[tensorboard]' / 'jetrl[wandb]')
    wandb_project: str = "jetrl"  # run.loggers wandb: the Weights & Biases project


@dataclass(frozen=True)
class JobConfig:
    name: str
    source: str
    flow: PrecisionFlow
    model: ModelConfig
    task: TaskConfig
    rollout: RolloutConfig
    train: TrainConfig
    correction: CorrectionSection
    eval: EvalConfig
    run: RunConfig
    raw: dict

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out_dir or f"runs/{self.name}")


SECTIONS = {
    "model": ModelConfig, "task": TaskConfig, "rollout": RolloutConfig, "train": TrainConfig,
    "correction": CorrectionSection, "eval": EvalConfig, "run": RunConfig,
}

CHOICES = {
    ("model", "device"): ("cpu", "cuda"),
    ("task", "name"): choices.TASKS,
    ("task", "answer_format"): choices.ANSWER_FORMATS,
    ("task", "overlong_prompts"): ("error", "drop"),
    ("rollout", "backend"): choices.ROLLOUT_BACKENDS,
    ("rollout", "vllm_quantization"): choices.VLLM_QUANTIZATIONS,
    ("rollout", "vllm_dtype"): ("float32", "bfloat16", "float16"),
    ("train", "adv_norm"): ("std", "none"),
    ("train", "loss_agg"): choices.LOSS_AGGREGATIONS,
    ("train", "policy_loss"): choices.POLICY_LOSSES,
    ("train", "adv_estimator"): choices.ADV_ESTIMATORS,
    ("train", "kl_estimator"): choices.KL_ESTIMATORS,
    ("train", "kl_ctrl"): ("fixed", "adaptive"),
    ("train", "lr_schedule"): choices.LR_SCHEDULES,
    ("correction", "type"): choices.CORRECTIONS,
    ("correction", "mis_level"): ("token", "sequence"),
    ("correction", "tis_level"): choices.TIS_LEVELS,
}
POSITIVE = {
    ("model", "lora_alpha"), ("train", "kl_target"), ("train", "kl_horizon"), ("task", "digits"), ("task", "length"),
    ("rollout", "prompts_per_step"), ("rollout", "n"), ("rollout", "max_new_tokens"), ("rollout", "max_len"),
    ("rollout", "max_batch"), ("train", "lr"), ("rollout", "vllm_gpu_memory_utilization"), ("train", "micro_batch"),
    ("train", "ppo_epochs"), ("train", "minibatches"), ("train", "invariant_scale"), ("correction", "tis_cap"),
    ("correction", "mis_high"), ("eval", "prompts"), ("eval", "n"), ("run", "keep_checkpoints"),
    ("train", "grad_clip"), ("train", "adam_eps"),
}
NON_NEGATIVE = {
    ("model", "lora_rank"), ("task", "max_samples"), ("train", "steps"), ("rollout", "top_k"),
    ("train", "weight_decay"), ("train", "warmup_steps"), ("train", "clip_low"), ("train", "clip_high"),
    ("train", "kl_coef"), ("train", "entropy_coef"), ("train", "dynamic_sampling_rounds"), ("correction", "mis_low"),
    ("task", "overlong_buffer"), ("train", "micro_batch_tokens"), ("task", "overlong_penalty"), ("eval", "every"),
    ("run", "checkpoint_every"), ("run", "log_samples"), ("run", "seed"),
}


def _check_type(src: str, key: str, value, tp):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        listed = next((a for a in kinds if typing.get_origin(a) is list), None)
        tp = listed if isinstance(value, list) and listed is not None else kinds[0]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        if not isinstance(value, list):
            raise PresetError(src, key, f"expected a list, got {value!r}")
        return [_check_type(src, f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise PresetError(src, key, f"expected a mapping of names to values, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise PresetError(src, key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PresetError(src, key, f"expected an integer, got {value!r}{_yaml11_hint(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and not _yaml11_hint(value):  # YAML 1.1 reads 3e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PresetError(src, key, f"expected a number, got {value!r}{_yaml11_hint(value)}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            kind = "a mapping" if isinstance(value, dict) else "a list"
            raise PresetError(src, key, f"expected a string, got {kind} {value!r} (YAML reads {{...}} as a mapping "
                              "and [...] as a list: put the value in quotes)")
        if not isinstance(value, str):
            raise PresetError(src, key, f"expected a string, got {value!r}")
        return value
    raise TypeError(tp)


def _yaml11_hint(value) -> str:
    """Why a number-like string is refused: ``presets_io`` loads the numbers only YAML 1.1 reads as numbers (base 60,
    ``1:30`` = 90; a leading-zero octal, ``010`` = 8) as the text written, so that they are refused here."""
    if not isinstance(value, str):
        return ""
    if re.fullmatch(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?", value):
        total = 0.0
        for part in value.lstrip("+-").replace("_", "").split(":"):
            total = total * 60 + float(part or 0)
        shown = f"{'-' if value.startswith('-') else ''}{total:g}"
        return f" (YAML 1.1 would read {value} in base 60, as {shown}; write a plain number)"
    if re.fullmatch(r"[-+]?0[0-9_]+", value):
        return f" (YAML 1.1 would read a leading 0 as octal; write {int(value.replace('_', ''))})"
    return ""


def _check_finite(src: str, key: str, value, where: tuple[str, str]) -> None:
    """NaN and infinity pass every ``<``/``>`` range check (NaN compares false with everything), so a float
    field is checked for them first (no preset key takes inf to mean "off" or "unbounded")."""
    if isinstance(value, list):
        for i, x in enumerate(value):
            _check_finite(src, f"{key}[{i}]", x, where)
        return
    if isinstance(value, float) and not math.isfinite(value):
        bound = " > 0" if where in POSITIVE else " >= 0" if where in NON_NEGATIVE else ""
        if where == ("rollout", "temperature"):  # its floor is checked in build_job_config
            bound = f" >= {MIN_TEMPERATURE}"
        raise PresetError(src, key, f"must be a finite number{bound}, got {value}")


def _section(src: str, name: str, cls, data) -> object:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PresetError(src, name, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in data.items():
        if k not in fields:
            raise PresetError(src, f"{name}.{k}", f"unknown key (allowed: {', '.join(sorted(fields))})")
        key = f"{name}.{k}"
        v = _check_type(src, key, v, hints[k])
        _check_finite(src, key, v, (name, k))
        if (name, k) in CHOICES and v is not None and v not in CHOICES[(name, k)]:
            raise PresetError(src, key, f"{v!r} is not allowed (allowed: {', '.join(CHOICES[(name, k)])})")
        if (name, k) in POSITIVE and v is not None and not v > 0:
            raise PresetError(src, key, f"must be > 0, got {v!r}")
        if (name, k) in NON_NEGATIVE and v is not None and v < 0:
            raise PresetError(src, key, f"must be >= 0, got {v!r}")
        kw[k] = v
    return cls(**kw)


def build_job_config(data: dict, source: str, name: str) -> JobConfig:
    allowed = ("precision", *SECTIONS)
    for k in data:
        if k not in allowed:
            raise PresetError(source, str(k), f"unknown key (allowed: {', '.join(allowed)})")
    if "precision" not in data:
        raise PresetError(source, "precision", "missing")
    flow = parse_flow(data["precision"], source=source, name=name)
    secs = {k: _section(source, k, cls, data.get(k)) for k, cls in SECTIONS.items()}
    r, t, c = secs["rollout"], secs["train"], secs["correction"]
    if not 0 < r.top_p <= 1:
        raise PresetError(source, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    if r.n < 2 and t.adv_estimator != "reinforce_plus_plus":
        raise PresetError(source, "rollout.n", f"adv_estimator {t.adv_estimator} compares a prompt's samples: it needs "
                          f"at least 2 per prompt, got {r.n} (reinforce_plus_plus alone takes 1)")
    if r.n < 2 and t.dynamic_sampling:
        raise PresetError(source, "train.dynamic_sampling", "drops the prompts whose samples all scored the same: "
                          "with rollout.n = 1 it would drop every prompt (set rollout.n >= 2)")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise PresetError(source, "train.betas", f"expected two numbers in [0, 1), got {t.betas}")
    if t.clip_low >= 1:
        raise PresetError(source, "train.clip_low", f"must be below 1 (the ratio's lower bound is 1 - clip_low), got {t.clip_low}")
    if t.adv_estimator != "grpo" and "adv_norm" in (data.get("train") or {}):
        raise PresetError(source, "train.adv_norm", f"applies to adv_estimator grpo only ({t.adv_estimator} "
                          "normalises its own way)")
    if t.kl_in_reward and not t.kl_coef > 0:
        raise PresetError(source, "train.kl_in_reward", "puts the kl_coef penalty in the reward: set train.kl_coef > 0 "
                          "(it is 0: the option would do nothing)")
    if t.dual_clip and not t.dual_clip > 1:
        raise PresetError(source, "train.dual_clip", f"must be 0 (off) or > 1 (verl uses 3), got {t.dual_clip}")
    if t.policy_loss == "gspo" and c.type == "acr":
        raise PresetError(source, "train.policy_loss", "gspo clips whole sequences; correction.type acr's per-token "
                          "clip bound does not apply to it (use tis or mis)")
    if t.policy_loss == "gspo" and t.loss_agg != "seq-mean-token-mean":
        raise PresetError(source, "train.loss_agg", f"gspo's objective is a mean over sequences: set "
                          f"train.loss_agg=seq-mean-token-mean (verl's GSPO loss forces it), got {t.loss_agg}")
    tk, ev = secs["task"], secs["eval"]
    if not 0 < tk.eval_fraction < 1:
        raise PresetError(source, "task.eval_fraction", f"must be in (0, 1), got {tk.eval_fraction}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(tk.prompt_template) if f is not None]
    except ValueError as e:
        raise PresetError(source, "task.prompt_template", f"{tk.prompt_template!r} is not a format string ({e})") from None
    if not fields:
        raise PresetError(source, "task.prompt_template", f"{tk.prompt_template!r} uses no field of the row "
                          "(every prompt would be the same); write e.g. \"Q: {prompt}\"")
    if tk.name == "jsonl":
        from .tasks import check_prompt_template

        if not tk.file:
            raise PresetError(source, "task.file", "required for task.name: jsonl (the training data: one JSON "
                              "object per line, or Parquet; a list of such files)")
        for key in ("file", "eval_file"):
            files = getattr(tk, key)
            if isinstance(files, list) and (not files or any(not f for f in files)):
                raise PresetError(source, f"task.{key}", f"a list of files must name at least one, each non-empty; "
                                  f"got {files!r}")
        try:
            check_prompt_template(tk.prompt_template, tk.answer_key)
        except ValueError as e:
            raise PresetError(source, "task.prompt_template", str(e)) from None
    reserved = sorted({"messages", "add_generation_prompt", "tools", "documents"} & set(tk.chat_template_kwargs))
    if reserved:
        raise PresetError(source, f"task.chat_template_kwargs.{reserved[0]}", "set by jetrl itself (the prompt's "
                          "messages, and the generation prompt always on); not a template option")
    if tk.system_prompt is not None and not tk.system_prompt.strip():
        raise PresetError(source, "task.system_prompt", "empty; leave it out for no system message")
    if tk.overlong_buffer > r.max_new_tokens:
        raise PresetError(source, "task.overlong_buffer", f"must be at most rollout.max_new_tokens ({r.max_new_tokens}), "
                          f"got {tk.overlong_buffer}")
    if ev.temperature is not None and ev.temperature != 0 and ev.temperature < MIN_TEMPERATURE:
        raise PresetError(source, "eval.temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got "
                          f"{ev.temperature:g}")
    if ev.temperature == 0 and ev.n > 1:
        raise PresetError(source, "eval.n", f"{ev.n} samples per prompt with eval.temperature 0 would all be the greedy "
                          "one; set eval.n: 1, or eval.temperature > 0")
    if ev.top_p is not None and not 0 < ev.top_p <= 1:
        raise PresetError(source, "eval.top_p", f"must be in (0, 1], got {ev.top_p}")
    if ev.top_k is not None and ev.top_k < 0:
        raise PresetError(source, "eval.top_k", f"must be >= 0 (0: off), got {ev.top_k}")
    if ev.n > 1 and ev.temperature is None and r.temperature == 0:
        raise PresetError(source, "eval.n", f"{ev.n} samples per prompt need rollout.temperature > 0 (it is 0: "
                          "every sample would be the greedy one)")
    if r.temperature < MIN_TEMPERATURE:
        greedy = "greedy rollouts make" if r.temperature == 0 else "so low a temperature samples greedily in effect: it makes"
        why = "" if r.temperature < 0 else (f": {greedy} every sample of a GRPO group the same, so every advantage is 0 "
                                            "and nothing is learned (use e.g. 1.0; evaluation is greedy already with "
                                            "eval.n: 1)")
        raise PresetError(source, "rollout.temperature", f"must be >= {MIN_TEMPERATURE}, got {r.temperature:g}{why}")
    if ev.max_new_tokens is not None and ev.max_new_tokens <= 0:
        raise PresetError(source, "eval.max_new_tokens", f"must be > 0, got {ev.max_new_tokens}")
    if not ev.before_train and t.steps == 0:
        raise PresetError(source, "eval.before_train", "false with train.steps: 0 leaves the run nothing to do (no "
                          "update, and no eval: step 0's is the only one); set train.steps > 0, or leave it out")
    if not 0 <= t.min_lr_ratio <= 1:
        raise PresetError(source, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    if r.vllm_gpu_memory_utilization > 1:
        raise PresetError(source, "rollout.vllm_gpu_memory_utilization", f"must be in (0, 1], got {r.vllm_gpu_memory_utilization}")
    if c.mis_low >= c.mis_high:
        raise PresetError(source, "correction.mis_low", f"must be below mis_high ({c.mis_low} >= {c.mis_high})")
    run = secs["run"]
    for lg in run.loggers:
        if lg not in LOGGERS:
            raise PresetError(source, "run.loggers", f"{lg!r} is not a logger (allowed: {', '.join(LOGGERS)})")
    if "jsonl" not in run.loggers:
        raise PresetError(source, "run.loggers", "must include jsonl: metrics.jsonl is what --resume, the display "
                          "and the plots read (add tensorboard next to it)")
    if t.activation_checkpointing and t.cuda_graphs:
        raise PresetError(source, "train.activation_checkpointing", "not with train.cuda_graphs (a captured "
                          "backward cannot run the layers' forward again); set one of them to false")
    _check_lora(source, secs["model"], t, r)
    if 0 < t.micro_batch_tokens < r.max_len:
        raise PresetError(source, "train.micro_batch_tokens", f"must be 0 (off) or at least rollout.max_len "
                          f"({r.max_len}), so that the longest sequence fits; got {t.micro_batch_tokens}")
    if t.minibatches > r.prompts_per_step:
        raise PresetError(source, "train.minibatches", f"more mini-batches ({t.minibatches}) than prompts per step")
    _refuse_unread_keys(source, data, secs)
    return JobConfig(name, source, flow, raw=data, **secs)


def _check_lora(source: str, m: ModelConfig, t: TrainConfig, r: RolloutConfig) -> None:
    """``model.lora_*``: target names jetrl's models have, and the settings LoRA does not combine with."""
    from .models.lora import ALL_LINEAR, TARGETS

    names = [m.lora_target_modules] if isinstance(m.lora_target_modules, str) else m.lora_target_modules
    if names != [ALL_LINEAR]:
        bad = [n for n in names if n not in TARGETS]
        if bad or not names:
            raise PresetError(source, "model.lora_target_modules", f"{bad[0] if bad else names!r} is not a layer "
                              f"name (allowed: {ALL_LINEAR}, or a list of {', '.join(TARGETS)})")
    if not m.lora_rank:
        return
    if t.invariant_scale != 1.0:
        raise PresetError(source, "train.invariant_scale", "QuRL's invariant scaling rescales the trained weights; "
                          "with model.lora_rank > 0 they are frozen (set it to 1, or model.lora_rank: 0)")


JSONL_TASK_KEYS = ("file", "eval_file", "eval_fraction", "prompt_key", "answer_key", "prompt_template",
                   "overlong_prompts", "max_samples")
VLLM_KEYS = tuple(f.name for f in dataclasses.fields(RolloutConfig) if f.name.startswith("vllm_"))


def _refuse_unread_keys(source: str, data: dict, secs: dict) -> None:
    """A key that the chosen setting does not read is refused, naming the setting that would read it: written
    in the preset or by ``--set`` (``data``: what the user wrote; the defaults are not in it), it would
    otherwise do nothing, silently. Checked after every value's own range, so a bad value is named as such.
    ``tis_cap``, ``mis_low`` and ``mis_high`` are read under every ``correction.type``: they are the
    thresholds of the ``frac_above_tis_cap`` / ``frac_outside_mis`` metrics (``metrics.jsonl``,
    ``jetrl mismatch-report``). ``task.digits`` / ``length`` are not checked: every shipped preset writes
    ``digits``, and ``--set task.name=jsonl`` on one of them is the documented way to bring a dataset."""
    tk, r, c, t, run = secs["task"], secs["rollout"], secs["correction"], secs["train"], secs["run"]
    rules = (
        ("model", ("lora_alpha", "lora_target_modules", "lora_path"), secs["model"].lora_rank > 0, "read only with "
         "model.lora_rank > 0 (it is 0: full fine-tuning, no adapters)"),
        ("task", JSONL_TASK_KEYS, tk.name == "jsonl", f"read only by task.name: jsonl (this task is {tk.name!r})"),
        ("task", ("eval_fraction",), tk.eval_file is None, "not read when task.eval_file is set (that file is the "
         "held-out split; eval_fraction splits task.file without one)"),
        ("rollout", VLLM_KEYS, r.backend == "vllm", f"read only by rollout.backend: vllm (this one is {r.backend!r})"),
        ("rollout", ("cuda_graphs",), r.backend == "embedded", f"read only by rollout.backend: embedded (this one "
         f"is {r.backend!r}, whose CUDA graphs rollout.vllm_enforce_eager turns off)"),
        ("correction", ("tis_level",), c.type in ("tis", "acr"), f"applies to correction.type tis or acr (this one is "
         f"{c.type!r})"),
        ("correction", ("mis_level",), c.type == "mis", f"applies to correction.type mis (this one is {c.type!r})"),
        ("train", ("dynamic_sampling_rounds",), t.dynamic_sampling, "read only with train.dynamic_sampling: true"),
        ("train", ("min_lr_ratio",), t.lr_schedule == "cosine", f"read only by train.lr_schedule: cosine (this one "
         f"is {t.lr_schedule!r})"),
        ("train", ("kl_estimator", "kl_in_reward"), t.kl_coef > 0, "read only with train.kl_coef > 0 (it is 0: no "
         "KL penalty)"),
        ("train", ("kl_ctrl",), t.kl_in_reward, "read only with train.kl_in_reward: true (verl's kl_ctrl sets the "
         "in-reward KL coefficient)"),
        ("train", ("kl_target", "kl_horizon"), t.kl_ctrl == "adaptive", "read only with train.kl_ctrl: adaptive"),
        ("task", ("system_prompt", "chat_template_kwargs"), tk.chat_template is not False,
         "read only with a chat template (task.chat_template is false)"),
        ("task", ("overlong_penalty",), tk.overlong_buffer > 0, "read only with task.overlong_buffer > 0 (it is 0: "
         "no overlong shaping)"),
        ("run", ("wandb_project",), "wandb" in run.loggers, "read only with wandb in run.loggers"),
        ("eval", ("top_p", "top_k"), secs["eval"].n > 1 or (secs["eval"].temperature or 0) > 0,
         "read only by a sampled eval (eval.n > 1, or eval.temperature > 0); this one is greedy"),
    )
    for section, keys, read, why in rules:
        written = data.get(section) or {}
        for k in keys:
            if not read and written.get(k) is not None:
                raise PresetError(source, f"{section}.{k}", why)


def load_job_config(preset: str, overrides: list[str] | None = None) -> JobConfig:
    from .presets_io import apply_overrides, load_yaml, resolve_preset_path

    path = resolve_preset_path(preset)
    data = load_yaml(path)
    src = str(path)
    if overrides:
        data = apply_overrides(data, overrides, src)
    return build_job_config(data, src, Path(src).stem)
