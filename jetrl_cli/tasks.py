"""Verifiable-reward tasks: built-in synthetic ones, JSONL math datasets, user reward functions.

A task yields ``Problem`` s (prompt text + reference answer) for a split (``train`` or ``eval``,
disjoint) and scores a completion with ``reward``. Batches are drawn by ``PromptSource.batch(step,
rank, world)``: a pure function of the seed, the step and the shard, so a resumed run and every
data-parallel rank see exactly the problems they would have seen.

Built-in tasks (the answer length is a knob, for short- vs long-rollout experiments), each
completion ends with ``#### <answer>``:

- ``arith``  add two ``digits``-digit numbers, column by column: ``47+85=`` -> ``7+5=12 4+8+1=13 #### 132``
- ``sort``   sort ``length`` digits: ``sort 3 9 1:`` -> ``#### 1 3 9``
- ``count``  count a letter in a ``length``-letter word, tallying: ``count a in abca:`` -> ``a1 a2 #### 2``
- ``mix``    all three (the tiny policy's warm-up data).
"""

from __future__ import annotations

import abc
import importlib
import json
import random
import re
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

from . import choices
from .choices import TASKS
from .errors import JetrlError

SPLITS = ("train", "eval")
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=:#.,()\n"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str = ""  # a worked completion, for supervised warm-up (synthetic tasks only)


def _is_eval(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 10 == 0


# ----------------------------------------------------------------------------- answer checking

_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 1, i + len("\\boxed{")
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start:j - 1].strip() if depth == 0 else None


def extract_gsm8k(text: str) -> str | None:
    """The text after the last ``####``, to the end of that line (GSM8K's answer marker), or None."""
    i = text.rfind("####")
    return text[i + 4:].strip().split("\n")[0].strip() if i >= 0 else None


# A number as people write it: 42, -3, 1,000, 2.5, .5, 3/4 (not the minus of "12-3").
_LAST_NUMBER = re.compile(r"(?<![\w.])-?(?:\d[\d,]*(?:\.\d+)?(?:/\d+)?|\.\d+)")


def extract_last_number(text: str) -> str | None:
    """The last number in the completion (``The answer is 1,234.`` -> ``1,234``), or None."""
    found = _LAST_NUMBER.findall(text)
    return found[-1].rstrip(",") if found else None


def _boxed_or_gsm8k(text: str) -> str | None:
    return extract_boxed(text) or extract_gsm8k(text)


def _auto(text: str) -> str | None:
    return _boxed_or_gsm8k(text) or extract_last_number(text)


# task.answer_format -> how the final answer is read from a completion.
ANSWER_FORMATS = {
    "auto": _auto,  # \boxed{}, else ####, else the last number
    "boxed_or_gsm8k": _boxed_or_gsm8k,  # \boxed{}, else ####; nothing else counts
    "boxed": extract_boxed,
    "gsm8k": extract_gsm8k,
    "last_number": extract_last_number,
}
assert tuple(ANSWER_FORMATS) == choices.ANSWER_FORMATS, "jetrl_cli/choices.py and tasks.ANSWER_FORMATS disagree"


def answer_format_of(task_cfg) -> str:
    """``task.answer_format``, or its default: ``auto`` for ``jsonl`` data (a plain-number answer
    counts), ``boxed_or_gsm8k`` for the built-in tasks (their completions end with ``#### answer``)."""
    fmt = getattr(task_cfg, "answer_format", None)
    return fmt or ("auto" if task_cfg.name == "jsonl" else "boxed_or_gsm8k")


def extract_answer(text: str, answer_format: str = "boxed_or_gsm8k") -> str | None:
    """The final answer of a completion as ``answer_format`` reads it (see ``ANSWER_FORMATS``), or
    None (an empty ``\\boxed{}`` or a bare ``####`` is no answer)."""
    return ANSWER_FORMATS[answer_format](text) or None


def normalize(ans: str) -> str | Fraction:
    """Numbers become exact fractions (``1,000`` / ``$1000.00`` / ``1e3`` / ``2000/2`` agree); other text
    is compared with whitespace collapsed."""
    s = ans.strip().strip(".").replace(",", "").replace("$", "").replace("\\%", "").rstrip("%").strip()
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    m = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?\d+)\s*/\s*(-?\d+)", s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    if _NUM.match(s):
        return Fraction(s)
    return " ".join(ans.split())


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    try:
        return normalize(predicted) == normalize(reference)
    except (ValueError, ZeroDivisionError):
        return " ".join(predicted.split()) == " ".join(reference.split())


def read_jsonl(path: Path, what: str):
    """``(line number, object)`` for each non-blank line; a one-line error for a bad file or line."""
    if not path.exists():
        raise JetrlError(f"{path}: no such {what}")
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise JetrlError(f"{path}:{i}: invalid JSON ({e.msg})") from None


# ----------------------------------------------------------------------------- tasks

class Task(abc.ABC):
    name = "task"
    answer_format = "boxed_or_gsm8k"

    @abc.abstractmethod
    def problems(self, rng: random.Random, n: int, split: str) -> list[Problem]:
        """``n`` problems of ``split`` drawn with ``rng``."""

    def extract(self, completion: str) -> str | None:
        """The completion's final answer as ``task.answer_format`` reads it; None if it has none."""
        return extract_answer(completion, self.answer_format)

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if self.correct(problem, completion) else 0.0

    def correct(self, problem: Problem, completion: str) -> bool:
        return answers_match(self.extract(completion), problem.answer)


class _Synthetic(Task):
    @abc.abstractmethod
    def make(self, rng: random.Random) -> Problem:
        """One random problem, with its worked solution."""

    def problems(self, rng, n, split):
        out = []
        for _ in range(200 * n + 1000):
            p = self.make(rng)
            if _is_eval(p.prompt) == (split == "eval"):
                out.append(p)
                if len(out) == n:
                    return out
        raise JetrlError(f"task {self.name}: cannot draw {n} distinct {split} problems at this size")


class Arith(_Synthetic):
    name = "arith"

    def __init__(self, digits: int):
        self.digits = digits

    def make(self, rng):
        d = self.digits
        a = rng.randrange(10 ** (d - 1) if d > 1 else 0, 10 ** d)
        b = rng.randrange(10 ** (d - 1) if d > 1 else 0, 10 ** d)
        steps, carry = [], 0
        for x, y in zip(reversed(str(a).zfill(d)), reversed(str(b).zfill(d))):
            s = int(x) + int(y) + carry
            steps.append(f"{x}+{y}+1={s}" if carry else f"{x}+{y}={s}")
            carry = s // 10
        return Problem(f"{a}+{b}=", str(a + b), " ".join(steps) + f" #### {a + b}")


class Sort(_Synthetic):
    name = "sort"

    def __init__(self, length: int):
        self.length = length

    def make(self, rng):
        xs = [rng.randrange(10) for _ in range(self.length)]
        ans = " ".join(map(str, sorted(xs)))
        return Problem(f"sort {' '.join(map(str, xs))}:", ans, f"#### {ans}")


class Count(_Synthetic):
    name = "count"

    def __init__(self, length: int):
        self.length = length

    def make(self, rng):
        letters = "abcd"
        word = "".join(rng.choice(letters) for _ in range(self.length))
        t = rng.choice(letters)
        tally = [f"{t}{i + 1}" for i in range(word.count(t))]
        return Problem(f"count {t} in {word}:", str(word.count(t)), " ".join(tally + [f"#### {word.count(t)}"]))


class Mix(_Synthetic):
    name = "mix"

    def __init__(self, tasks: list[_Synthetic]):
        self.tasks = tasks

    def make(self, rng):
        return rng.choice(self.tasks).make(rng)


class JsonlTask(Task):
    """Prompt/answer pairs from JSONL. GSM8K-style answers (``... #### 72``) are reduced to the part
    after ``####``; completions are read by ``task.answer_format`` (default ``auto``: ``\\boxed{}``,
    ``####``, else the last number) and compared with numeric normalisation."""

    name = "jsonl"
    answer_format = "auto"

    def __init__(self, file: str, eval_file: str | None, eval_fraction: float, prompt_key: str,
                 answer_key: str, template: str, seed: int):
        rows = self._read(file, prompt_key, answer_key, template)
        if eval_file:
            self.split = {"train": rows, "eval": self._read(eval_file, prompt_key, answer_key, template)}
        else:
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            n_eval = max(1, int(round(len(rows) * eval_fraction))) if len(rows) > 1 else 0
            self.split = {"eval": [rows[i] for i in order[:n_eval]], "train": [rows[i] for i in order[n_eval:]]}
        for s in SPLITS:
            if not self.split[s]:
                raise JetrlError(f"{file}: no {s} problems after the split (add rows or set task.eval_file)")

    @staticmethod
    def _read(file: str, pk: str, ak: str, template: str) -> list[Problem]:
        rows = []
        for i, d in read_jsonl(Path(file), "dataset file"):
            if not isinstance(d, dict) or pk not in d:
                raise JetrlError(f"{file}:{i}: no {pk!r} field (set task.prompt_key)")
            ans = d.get(ak)
            if ans is None or str(ans).strip() == "":
                raise JetrlError(f"{file}:{i}: no answer in field {ak!r} (every row needs one; set task.answer_key)")
            ans = str(ans)
            if "####" in ans:
                ans = ans.rsplit("####", 1)[1].strip()
            try:
                prompt = template.format(prompt=d[pk], **{k: v for k, v in d.items() if k != "prompt"})
            except (KeyError, IndexError) as e:
                raise JetrlError(f"task.prompt_template: unknown field {e} for {file}:{i}") from None
            rows.append(Problem(prompt, ans))
        if not rows:
            raise JetrlError(f"{file}: empty dataset")
        return rows

    def problems(self, rng, n, split):
        pool = self.split[split]
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def epoch_batch(self, step: int, n: int, seed: int) -> list[Problem]:
        """Walk the train split in a seeded order, epoch after epoch."""
        pool = self.split["train"]
        out = []
        for k in range(step * n, step * n + n):
            epoch, i = divmod(k, len(pool))
            order = list(range(len(pool)))
            random.Random(seed * 7919 + epoch).shuffle(order)
            out.append(pool[order[i]])
        return out


class UserReward(Task):
    """Wraps a task with a user reward ``fn(prompt, completion, answer) -> float`` from ``module:fn``."""

    def __init__(self, inner: Task, fn: Callable):
        self.inner, self.fn, self.name = inner, fn, inner.name
        self.answer_format = inner.answer_format

    def problems(self, rng, n, split):
        return self.inner.problems(rng, n, split)

    def reward(self, problem, completion):
        return float(self.fn(problem.prompt, completion, problem.answer))

    def correct(self, problem, completion):
        return self.inner.correct(problem, completion)


def load_reward_fn(spec: str) -> Callable:
    if ":" not in spec:
        raise JetrlError(f"task.reward: {spec!r} must look like 'package.module:function'")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise JetrlError(f"task.reward: cannot import {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise JetrlError(f"task.reward: {mod_name} has no function {fn_name!r}")
    return fn


# ----------------------------------------------------------------------------- prompt source

class PromptSource:
    """Problems for a step, deterministic in (seed, step, rank): the data-sharding interface."""

    def __init__(self, task: Task, seed: int):
        self.task, self.seed = task, seed

    def batch(self, step: int, n: int, rank: int = 0, world: int = 1, round_: int = 0) -> list[Problem]:
        inner = getattr(self.task, "inner", self.task)
        if isinstance(inner, JsonlTask) and round_ == 0:
            return inner.epoch_batch(step * world + rank, n, self.seed)
        rng = random.Random(f"{self.seed}/{step}/{rank}/{world}/{round_}")
        return self.task.problems(rng, n, "train")

    def eval_set(self, n: int) -> list[Problem]:
        return self.task.problems(random.Random(f"{self.seed}/eval"), n, "eval")


def build_task(cfg, seed: int) -> Task:
    """``cfg``: the preset's ``task`` section (``config.TaskConfig``)."""
    if cfg.name == "arith":
        task: Task = Arith(cfg.digits)
    elif cfg.name == "sort":
        task = Sort(cfg.length)
    elif cfg.name == "count":
        task = Count(cfg.length)
    elif cfg.name == "mix":
        task = Mix([Arith(cfg.digits), Sort(cfg.length), Count(cfg.length)])
    elif cfg.name == "jsonl":
        if not cfg.file:
            raise JetrlError("task.file: required for task jsonl")
        task = JsonlTask(cfg.file, cfg.eval_file, cfg.eval_fraction, cfg.prompt_key, cfg.answer_key,
                         cfg.prompt_template, seed)
    else:
        raise JetrlError(f"task.name: unknown task {cfg.name!r} (allowed: {', '.join(TASKS)})")
    task.answer_format = answer_format_of(cfg)
    if cfg.reward:
        task = UserReward(task, load_reward_fn(cfg.reward))
    return task
