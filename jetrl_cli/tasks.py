"""Verifiable-reward tasks: built-in synthetic ones, JSONL math datasets, user reward functions.

A task yields ``Problem`` s (prompt text + reference answer) for a split (``train`` or ``eval``,
disjoint) and scores a completion with ``reward``. Batches are drawn by ``PromptSource.batch(step, n)``:
a pure function of the seed and the step, so a resumed run sees exactly the problems it would have
seen, and every data-parallel rank the whole step's problems (the rollout shards them:
``distributed.rollout.ShardedEngine`` samples a rank's contiguous block, so a sharded run draws what
one process draws).

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
import importlib.util
import inspect
import json
import math
import random
import re
import string
import zlib
from dataclasses import dataclass, field
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
    prompt: str  # the prompt text (of a chat prompt: its last message's)
    answer: str
    solution: str = ""  # a worked completion, for supervised warm-up (synthetic tasks only)
    # a jsonl row whose prompt is a list of chat messages: those messages ({"role", "content"} dicts)
    messages: tuple | None = field(default=None, hash=False)
    # a jsonl row's data_source and extra_info (verl's fields), and its answer field as it is where ``answer`` is
    # not (a number; text with "####"): ground_truth, for a verl-style task.reward
    meta: dict | None = field(default=None, hash=False, compare=False)
    where: str | None = field(default=None, hash=False, compare=False)  # a dataset row: "FILE:LINE"


@dataclass
class ChatSpec:
    """How a task's prompts go through the model's chat template (``task.chat_template`` on)."""

    system_prompt: str | None = None
    kwargs: dict = field(default_factory=dict)  # task.chat_template_kwargs

    def messages(self, p: Problem) -> list[dict]:
        """The conversation the template renders: the row's messages, or its prompt as one user message,
        after the system prompt if there is one."""
        msgs = [dict(m) for m in p.messages] if p.messages is not None else [{"role": "user", "content": p.prompt}]
        if self.system_prompt is not None:
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs


def _is_eval(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % 10 == 0


# ----------------------------------------------------------------------------- answer checking

_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")
_MAX_EXPONENT = 1000  # a number written with a larger power of ten is compared as text (10^1e9 would take minutes)
_BOX = re.compile(r"\\(?:boxed|fbox)\b")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces balanced; ``\\boxed 18``: the
    token after it), or None: also for an empty or unclosed box (a completion cut off inside it)."""
    found = list(_BOX.finditer(text))
    if not found:
        return None
    j = found[-1].end()
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] != "{":  # \boxed 18: the next token
        token = text[j:].split(maxsplit=1)[0].rstrip(".,;$") if text[j:].strip() else ""
        return token or None
    depth, j = 1, j + 1
    start = j
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return (text[start:j - 1].strip() or None) if depth == 0 else None


def extract_gsm8k(text: str) -> str | None:
    """The text after the last ``####``, to the end of that line (GSM8K's answer marker), or None."""
    i = text.rfind("####")
    return text[i + 4:].strip().split("\n")[0].strip() if i >= 0 else None


# A number as people write it: 42, -3, 1,000, 2.5, .5, 3/4 (not the minus of "12-3"; a Unicode minus too).
_LAST_NUMBER = re.compile(r"(?<![\w.])-?(?:\d[\d,]*(?:\.\d+)?(?:/\d+)?|\.\d+)")


def extract_last_number(text: str) -> str | None:
    """The last number in the completion (``The answer is 1,234.`` -> ``1,234``), or None."""
    found = _LAST_NUMBER.findall(text.replace("\u2212", "-"))
    return found[-1].rstrip(",") if found else None


def _boxed_or_gsm8k(text: str) -> str | None:
    """The box's answer where the completion has one (an empty or unclosed box: none), else ``####``'s."""
    return extract_boxed(text) if _BOX.search(text) else extract_gsm8k(text)


def _auto(text: str) -> str | None:
    """``_boxed_or_gsm8k``, and only where the completion has neither a box nor ``####``, its last number:
    a box left empty or cut off is no answer, whatever number came before it."""
    return _boxed_or_gsm8k(text) if _BOX.search(text) or "####" in text else extract_last_number(text)


# task.answer_format -> how the final answer is read from a completion.
ANSWER_FORMATS = {
    "auto": _auto,  # \boxed{}, else ####, else (neither written) the last number
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
    None (an empty or unclosed ``\\boxed{}`` or a bare ``####`` is no answer)."""
    return ANSWER_FORMATS[answer_format](text) or None


# LaTeX that dresses an answer without changing it, removed before comparing (as verl's math reward's
# strip_string does): money and percent signs, thin spaces, degrees, \left / \right, \dfrac
_LATEX_NOISE = (("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", " "), ("{,}", ","), ("\\$", ""), ("$", ""),
                ("\\%", "%"), ("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                ("\u2212", "-"))
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:([, ])\d{3})(?:\1\d{3})*(?:\.\d+)?")
_FRAC = re.compile(r"(-?)(\d+)?\s*\\frac\{(-?\d+)\}\{(-?\d+)\}")
_POWER_OF_TEN = re.compile(r"(?:(.+?)\s*(?:\\times|\\cdot|\*|x)\s*)?10\^\{?(-?\d+)\}?")  # [a \times] 10^e


def _clean(ans: str) -> str:
    """An answer without the LaTeX that only dresses it: the wrappers' text kept, a trailing unit word
    (``18 dollars``, ``18\\text{ cm}``) and a leading ``x =`` dropped, ``\\frac12`` braced, trailing dots
    and degree marks removed."""
    s = ans.strip()
    for a, b in _LATEX_NOISE:
        s = s.replace(a, b)
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _WRAPPER.sub(r"\1", s).strip()
    m = re.fullmatch(r"[A-Za-z]\s*=\s*(.+)", s)  # x = 18
    if m:
        s = m.group(1)
    m = re.fullmatch(r"([-+]?[\d.,/ ]*\d)\s+[A-Za-z]{2,}\.?", s)  # a number and one unit word
    if m:
        s = m.group(1)
    return s.strip().rstrip(".").strip()


def _number(s: str) -> Fraction | None:
    """``s`` as an exact number, or None: plain and scientific notation (``1e3``, ``1.8 \\times
    10^{1}``, ``10^6``), thousands grouped by commas or spaces (``1,234``, ``1 234``: not ``3,5``), a
    trailing ``%`` (``50%`` = 50), fractions ``3/4``, ``\\frac{3}{4}``, ``-\\frac{1}{2}``, ``2\\frac{1}{2}``."""
    s = s.rstrip("%").strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")
    m = _FRAC.fullmatch(s) or re.fullmatch(r"(-?)()(\d+)\s*/\s*(\d+)", s)
    if m:
        sign, whole, a, b = m.groups()
        if int(b) == 0:
            return None
        v = int(whole or 0) + Fraction(int(a), int(b))
        return -v if sign else v
    m = _POWER_OF_TEN.fullmatch(s)
    if m:
        base, e = (1 if m.group(1) is None else _number(m.group(1))), int(m.group(2))
        return None if base is None or abs(e) > _MAX_EXPONENT else base * Fraction(10) ** e
    m = _NUM.match(s)
    if m:
        e = int(m.group(3)[1:]) if m.group(3) else 0
        return Fraction(s) if abs(e) <= _MAX_EXPONENT else None
    return None


def normalize(ans: str) -> str | Fraction:
    """An answer as compared: a number as an exact fraction (``1,000`` / ``$1000.00`` / ``\\$1{,}000`` /
    ``1e3`` / ``2000/2`` / ``1000 dollars`` agree; ``_number``), other text without LaTeX dressing
    (``_clean``) and without whitespace (``(1, 2)`` = ``(1,2)``, ``\\frac12`` = ``\\frac{1}{2}``), as verl's
    math reward compares it."""
    s = _clean(ans)
    v = _number(s)
    return v if v is not None else "".join(s.split())


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    return normalize(predicted) == normalize(reference)


def read_jsonl(path: Path, what: str, key: str | None = None):
    """``(line number, object)`` for each non-blank line; a one-line error for a bad file or line
    (``key``: the preset key that named the file, e.g. ``task.file``, put in front of it)."""
    where = f"{key}: {path}" if key else str(path)
    if not path.exists():
        raise JetrlError(f"{where}: no such {what}")
    if path.is_dir():
        raise JetrlError(f"{where}: is a directory, not a {what} (one JSON object per line)")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise JetrlError(f"{where}: not a UTF-8 text file (byte {e.start}: {e.object[e.start]:#04x})") from None
    except OSError as e:
        raise JetrlError(f"{where}: cannot read: {e.strerror or e}") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise JetrlError(f"{path}:{i}: invalid JSON ({e.msg})") from None


def read_dataset(path: Path, key: str | None = None):
    """``(row number, row)`` of a dataset file: Parquet (``.parquet``, verl's data format; needs pyarrow),
    else JSONL (``read_jsonl``). A Parquet row is named ``FILE:N`` by its 1-based row number."""
    if path.suffix != ".parquet":
        yield from read_jsonl(path, "dataset file", key)
        return
    where = f"{key}: {path}" if key else str(path)
    if not path.is_file():
        raise JetrlError(f"{where}: no such dataset file" if not path.exists() else f"{where}: is a directory, "
                         "not a dataset file")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise JetrlError(f"{where}: reading Parquet needs pyarrow (pip install 'jetrl[parquet]')") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError for a file that is not Parquet
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise JetrlError(f"{where}: cannot read as Parquet ({msg[:200]})") from None
    yield from enumerate(rows, 1)


def row_field(d: dict, key: str):
    """``d[key]``; a dotted key not in ``d`` reads nested fields (verl's ``reward_model.ground_truth``).
    KeyError when absent."""
    if key in d:
        return d[key]
    v = d
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            raise KeyError(key)
        v = v[part]
    return v


# ----------------------------------------------------------------------------- tasks

class TooFewProblems(JetrlError):
    """``Task.problems(distinct=True)``: the split has fewer than ``n`` different problems."""

    def __init__(self, have: int, n: int, where: str, hint: str):
        self.have, self.n, self.where, self.hint = have, n, where, hint
        super().__init__(f"{n} different problems asked for, but {where} has {'only ' if have else ''}{have}")


class Task(abc.ABC):
    chat: ChatSpec | None = None  # set by build_task: the prompts go through the model's chat template
    name = "task"
    answer_format = "boxed_or_gsm8k"

    @abc.abstractmethod
    def problems(self, rng: random.Random, n: int, split: str, distinct: bool = False) -> list[Problem]:
        """``n`` problems of ``split`` drawn with ``rng``; ``distinct``: ``n`` different ones, or
        ``TooFewProblems``."""

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

    def problems(self, rng, n, split, distinct=False):
        out, seen = [], set()
        tries = 200 * n + 1000
        for _ in range(tries):
            p = self.make(rng)
            if _is_eval(p.prompt) == (split == "eval") and not (distinct and p.prompt in seen):
                seen.add(p.prompt)
                out.append(p)
                if len(out) == n:
                    return out
        if distinct:
            raise TooFewProblems(len(out), n, f"task {self.name}'s {split} split at this size (found in {tries} draws)",
                                 "make the task larger (task.digits, task.length)")
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


def _shown(value, width: int = 60) -> str:
    """A value as its JSON spelling (``null``, ``[4]``, ``true``), cut to ``width`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def check_prompt_template(template: str, answer_key: str = "answer") -> list[str]:
    """The row fields ``task.prompt_template`` reads; ValueError (the reason, one line) for a template
    that is not a format string, has a positional field (``{}``), reads an attribute or item of a field
    (``{prompt.upper}``, ``{meta[0]}``) or reads the answer (``{answer}``: the prompt would give it away)."""
    fields = []
    try:
        parsed = list(string.Formatter().parse(template))
        for _, f, spec, _ in parsed:  # a format spec may hold fields too: {prompt:>{width}}
            if f is not None:
                fields.append(f)
                fields += [g for _, g, _, _ in string.Formatter().parse(spec or "") if g is not None]
    except ValueError as e:
        raise ValueError(f"{template!r} is not a format string ({e})") from None
    for f in fields:
        if f == "" or f.isdigit():
            raise ValueError(f"{{{f}}} is a positional field; name a field of the row, e.g. {{prompt}}")
        if "." in f or "[" in f:
            raise ValueError(f"{{{f}}} reads an attribute or item of a field; only plain fields of the row are "
                             "allowed, e.g. {prompt}")
        if f == answer_key and f != "prompt":
            raise ValueError(f"{{{f}}} is the answer (task.answer_key): the prompt would give it away")
    return fields


def _chat_messages(value: list, where: str, pk: str) -> tuple:
    """A row's prompt given as chat messages, checked: a non-empty list of ``{"role": str, "content": str}``
    objects (other keys are kept for the template), the last not the assistant's (jetrl generates the
    assistant's next turn)."""
    if not value:
        raise JetrlError(f"{where}: {pk!r} is an empty list of chat messages")
    out = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise JetrlError(f"{where}: {pk!r}[{j}] must be a chat message {{\"role\": <string>, \"content\": "
                             f"<string>}}, got {_shown(m)}")
        out.append(dict(m))
    if out[-1]["role"] == "assistant":
        raise JetrlError(f"{where}: {pk!r}'s last message is the assistant's; the prompt ends before the turn "
                         "jetrl generates (end it with the user's message)")
    return tuple(out)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class JsonlTask(Task):
    """Prompt/answer pairs from JSONL. GSM8K-style answers (``... #### 72``) are reduced to the part
    after ``####``; completions are read by ``task.answer_format`` (default ``auto``: ``\\boxed{}``,
    ``####``, else the last number) and compared with numeric normalisation."""

    name = "jsonl"
    answer_format = "auto"

    def __init__(self, file: str, eval_file: str | None, eval_fraction: float, prompt_key: str,
                 answer_key: str, template: str, seed: int, source: str | None = None):
        try:
            check_prompt_template(template, answer_key)
        except ValueError as e:
            raise JetrlError(f"{source + ': ' if source else ''}task.prompt_template: {e}") from None
        files = [file] if isinstance(file, str) else list(file)
        eval_files = [eval_file] if isinstance(eval_file, str) else list(eval_file or [])
        self.file = file = ", ".join(files)  # as errors name it
        # where the first row of each kind of prompt is ("text" / "messages" -> "FILE:LINE"), and the first chat
        # prompt with its own system message: build_task decides from them whether the chat template applies
        self.prompt_kinds: dict[str, str] = {}
        self.system_row: str | None = None
        rows = [r for f in files for r in self._read(f, prompt_key, answer_key, template, "task.file", source, self)]
        if eval_files:
            self.split = {"train": rows, "eval": [r for f in eval_files for r in self._read(
                f, prompt_key, answer_key, template, "task.eval_file", source, self)]}
            self.held_out = f"task.eval_file {', '.join(eval_files)}"
        else:
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            n_eval = max(1, int(round(len(rows) * eval_fraction))) if len(rows) > 1 else 0
            self.split = {"eval": [rows[i] for i in order[:n_eval]], "train": [rows[i] for i in order[n_eval:]]}
            self.held_out = f"the held-out split of {file} (task.eval_fraction {eval_fraction:g} of {len(rows)} rows)"
        for s in SPLITS:
            if not self.split[s]:
                raise JetrlError(f"{file}: no {s} problems after the split (add rows or set task.eval_file)")

    @staticmethod
    def _read(file: str, pk: str, ak: str, template: str, key: str = "task.file",
              source: str | None = None, seen: "JsonlTask | None" = None) -> list[Problem]:
        fields = check_prompt_template(template, ak)
        rows = []
        for i, d in read_dataset(Path(file), f"{source}: {key}" if source else key):
            if not isinstance(d, dict):
                raise JetrlError(f"{file}:{i}: expected a JSON object per line, got {_shown(d)}")
            try:
                prompt = row_field(d, pk)
            except KeyError:
                raise JetrlError(f"{file}:{i}: no {pk!r} field (set task.prompt_key)") from None
            messages = None
            if isinstance(prompt, list):
                messages = _chat_messages(prompt, f"{file}:{i}", pk)
                if template != "{prompt}":
                    raise JetrlError(f"{file}:{i}: {pk!r} is a list of chat messages, which task.prompt_template "
                                     f"{template!r} cannot format (it formats string prompts; leave it out)")
                if seen is not None and seen.system_row is None and any(m["role"] == "system" for m in messages):
                    seen.system_row = f"{file}:{i}"
            elif not isinstance(prompt, str):
                raise JetrlError(f"{file}:{i}: {pk!r} must be a string or a list of chat messages "
                                 f"([{{\"role\": ..., \"content\": ...}}, ...]), got {_shown(prompt)} "
                                 "(task.prompt_key)")
            if seen is not None:
                seen.prompt_kinds.setdefault("messages" if messages else "text", f"{file}:{i}")
            try:
                ans = row_field(d, ak)
            except KeyError:
                ans = None
            if ans is None or (isinstance(ans, str) and ans.strip() == ""):
                raise JetrlError(f"{file}:{i}: no answer in field {ak!r} (every row needs one; set task.answer_key)")
            if not (isinstance(ans, str) or _is_number(ans)):
                raise JetrlError(f"{file}:{i}: {ak!r} must be a string or a finite number, got {_shown(ans)} "
                                 "(task.answer_key)")
            raw, ans = ans, str(ans)
            if "####" in ans:
                ans = ans.rsplit("####", 1)[1].strip()
                if not ans:  # "4 ####": no answer a completion could match
                    raise JetrlError(f"{file}:{i}: nothing after '####' in field {ak!r} (GSM8K-style answers end "
                                     "with '#### <answer>'; every row needs one)")
            meta = {k: d[k] for k in ("data_source", "extra_info") if k in d}
            if raw != ans:  # what verl's reward gets: the field as it is (a number, or text before "####")
                meta["ground_truth"] = raw
            meta = meta or None
            if messages is not None:
                rows.append(Problem(messages[-1]["content"], ans, messages=messages, meta=meta, where=f"{file}:{i}"))
                continue
            values = {k: v for k, v in d.items() if k != "prompt"}
            values["prompt"] = prompt
            for f in fields:
                if f not in values:
                    raise JetrlError(f"task.prompt_template: field {{{f}}} is not in {file}:{i} (its fields: "
                                     f"{', '.join(map(repr, d))})")
                if not (isinstance(values[f], str) or _is_number(values[f])):
                    raise JetrlError(f"task.prompt_template: field {{{f}}} of {file}:{i} must be a string or a "
                                     f"number, got {_shown(values[f])}")
            try:
                prompt = template.format(**values)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
                raise JetrlError(f"task.prompt_template: {template!r} cannot format {file}:{i}: "
                                 f"{type(e).__name__}: {e}") from None
            rows.append(Problem(prompt, ans, meta=meta, where=f"{file}:{i}"))
        if not rows:
            raise JetrlError(f"{file}: empty dataset")
        return rows

    def problems(self, rng, n, split, distinct=False):
        """Drawn without replacement: ``n`` different rows, or (``distinct`` false, more than the split holds) every
        row once in a shuffled pass before any row comes again."""
        pool = self.split[split]
        if distinct and n > len(pool):
            raise TooFewProblems(len(pool), n, self.held_out if split == "eval" else f"the train split of {self.file}",
                                 "hold out more rows (task.eval_file, or a larger task.eval_fraction)")
        out: list[Problem] = []
        while len(out) < n:
            out += rng.sample(pool, min(len(pool), n - len(out)))
        return out

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


def _short(text: str, width: int = 40) -> str:
    """``text`` as a one-line Python literal, cut to about ``width`` characters."""
    return repr(text if len(text) <= width else text[:width - 3] + "...")


class UserReward(Task):
    """Wraps a task with a user reward ``fn(prompt, completion, answer) -> float`` from ``module:fn``.

    Whatever the function does wrong (raises, returns None, text, NaN or infinity) is a one-line error
    naming ``task.reward``, the function and the prompt it was scoring: never a traceback, never a NaN loss."""

    def __init__(self, inner: Task, fn: Callable, spec: str | None = None):
        self.inner, self.fn, self.name = inner, fn, inner.name
        self.spec = spec or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        self.answer_format = inner.answer_format
        self.verl = reward_style(fn) == "verl"

    def problems(self, rng, n, split, distinct=False):
        return self.inner.problems(rng, n, split, distinct)

    def _call(self, problem, completion):
        if not self.verl:
            return self.fn(problem.prompt, completion, problem.answer)
        meta = problem.meta or {}
        kw = {"solution_str": completion, "ground_truth": meta.get("ground_truth", problem.answer)}
        for key in _VERL_OPTIONAL:  # those it takes: verl's own scorers, e.g. gsm8k's, take neither
            if _takes(self.fn, key):
                kw[key] = meta.get(key)
        if "extra_info" in kw:  # verl passes a dict, {} for a row without one; a copy per call, as it mutates it
            info = kw["extra_info"]
            kw["extra_info"] = {} if info is None else dict(info) if isinstance(info, dict) else info
        value = self.fn(**kw)
        if isinstance(value, dict):  # verl's reward managers take a dict's "score" (the rest are extra metrics)
            if "score" not in value:
                raise _NoScore(value)
            value = value["score"]
        return value

    def reward(self, problem, completion):
        where = f"task.reward {self.spec}"
        try:
            value = self._call(problem, completion)
        except _NoScore as e:
            raise JetrlError(f"{where} returned a dict without 'score' (keys: {', '.join(map(repr, e.args[0]))}) for "
                             f"prompt {_short(problem.prompt)}; verl-style reward functions return a number or "
                             "{'score': number, ...}") from None
        except Exception as e:  # the user's code: any error it raises is theirs to fix, in one line
            msg = (str(e).strip().splitlines() or [""])[0]
            msg = msg if len(msg) <= 200 else msg[:197] + "..."
            raise JetrlError(f"{where} raised {type(e).__name__}{': ' + msg if msg else ''} for prompt "
                             f"{_short(problem.prompt)}") from None
        number = None
        if not isinstance(value, (str, bytes)) and value is not None:
            try:
                number = float(value)
            except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
                pass
        if number is None or not math.isfinite(number):
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise JetrlError(f"{where} returned {shown} for prompt {_short(problem.prompt)} "
                             "(must return a finite float)")
        return number

    def correct(self, problem, completion):
        return self.inner.correct(problem, completion)


class _NoScore(Exception):
    pass


# verl's custom reward function: compute_score(data_source, solution_str, ground_truth, extra_info=None);
# its built-in scorers take solution_str and ground_truth (gsm8k.compute_score) and some of the other two
_VERL_OPTIONAL = ("data_source", "extra_info")


def _takes(fn: Callable, name: str) -> bool:
    try:
        ps = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in ps or any(p.kind is p.VAR_KEYWORD for p in ps.values())


def reward_style(fn: Callable) -> str:
    """``verl`` for a function with verl's parameter names (``solution_str``, ``ground_truth``), called by
    keyword as verl calls it; else ``jetrl``: ``fn(prompt, completion, answer)``."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "jetrl"
    return "verl" if {"solution_str", "ground_truth"} <= names else "jetrl"


def reward_source_file(spec: str) -> Path | None:
    """The source file ``task.reward`` names (``path/to/file.py:fn``, or a module's file), if it is found."""
    target = spec.rsplit(":", 1)[0]
    if target.endswith(".py"):
        return Path(target) if Path(target).is_file() else None
    try:
        found = importlib.util.find_spec(target)
    except Exception:  # noqa: BLE001 -- a module that cannot be found is reported when the task is built
        return None
    return Path(found.origin) if found is not None and found.origin and Path(found.origin).is_file() else None


def _load_file_module(path: str):
    """A reward function's module from its file (verl's ``custom_reward_function.path``)."""
    import sys

    p = Path(path)
    if not p.is_file():
        raise JetrlError(f"task.reward: {path}: no such file" if not p.exists() else f"task.reward: {path}: not a file")
    name = f"jetrl_reward_{zlib.crc32(str(p.resolve()).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the user's file fails: a syntax error, an import inside it, ...
        msg = (str(e).strip().splitlines() or [""])[0]
        raise JetrlError(f"task.reward: cannot load {path}: {type(e).__name__}: {msg}") from None
    sys.modules[name] = mod
    return mod


def load_reward_fn(spec: str) -> Callable:
    """The function ``task.reward`` names (``package.module:function``, or ``path/to/file.py:function``),
    checked to take ``(prompt, completion, answer)``, or verl's ``(data_source, solution_str, ground_truth,
    extra_info)`` by name."""
    if ":" not in spec:
        raise JetrlError(f"task.reward: {spec!r} must look like 'package.module:function' or "
                         "'path/to/file.py:function'")
    mod_name, fn_name = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        mod = _load_file_module(mod_name)
        fn = getattr(mod, fn_name, None)
        if not callable(fn):
            raise JetrlError(f"task.reward: {mod_name} has no function {fn_name!r}")
        return _checked_reward(fn, spec, fn_name)
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        top = mod_name.split(".")[0]
        hint = ""
        if e.name == top and (Path(f"{top}.py").is_file() or Path(top).is_dir()):
            found = f"{top}.py" if Path(f"{top}.py").is_file() else f"{top}/"
            hint = (f"; {found} is in the current directory, which Python does not search: put it on "
                    "PYTHONPATH, e.g. PYTHONPATH=. jetrl run ...")
        raise JetrlError(f"task.reward: cannot import {mod_name!r} ({e}){hint}") from None
    except Exception as e:  # the module itself fails: a syntax error, an import inside it, ...
        msg = (str(e).strip().splitlines() or [""])[0]
        raise JetrlError(f"task.reward: cannot import {mod_name!r}: {type(e).__name__}: {msg}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise JetrlError(f"task.reward: {mod_name} has no function {fn_name!r}")
    return _checked_reward(fn, spec, fn_name)


def _checked_reward(fn: Callable, spec: str, fn_name: str) -> Callable:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: checked when called
        return fn
    try:
        if reward_style(fn) == "verl":
            sig.bind(solution_str="", ground_truth="", **{k: None for k in _VERL_OPTIONAL if _takes(fn, k)})
        else:
            sig.bind("prompt", "completion", "answer")
    except TypeError:
        raise JetrlError(f"task.reward {spec}: takes {sig}, but is called as {fn_name}(prompt, completion, answer) "
                         "or, verl's, as compute_score(data_source=, solution_str=, ground_truth=, extra_info=); it "
                         "must return a number") from None
    return fn


# ----------------------------------------------------------------------------- prompt source

class PromptSource:
    """A step's problems, deterministic in (seed, step, round): the same on every rank."""

    def __init__(self, task: Task, seed: int):
        self.task, self.seed = task, seed

    def batch(self, step: int, n: int, round_: int = 0) -> list[Problem]:
        """The ``n`` problems of ``step`` (``round_`` > 0: dynamic sampling's refill rounds)."""
        inner = getattr(self.task, "inner", self.task)
        if isinstance(inner, JsonlTask) and round_ == 0:
            return inner.epoch_batch(step, n, self.seed)
        rng = random.Random(f"{self.seed}/{step}/0/1/{round_}")  # "/0/1": the draws of every earlier version
        return self.task.problems(rng, n, "train")

    def eval_set(self, n: int, key: str = "eval.prompts") -> list[Problem]:
        """``n`` different held-out problems, each evaluated once (``key``: the setting that asked for ``n``).
        Fewer held-out problems than ``n`` is a one-line error: repeating problems would report an eval of ``n``
        prompts on fewer problems, with the repeated ones counted twice, and capping silently would report a
        smaller eval than the one asked for."""
        try:
            return self.task.problems(random.Random(f"{self.seed}/eval"), n, "eval", distinct=True)
        except TooFewProblems as e:
            raise JetrlError(f"{key} {n}: more than the {e.have} different problems of {e.where}; each eval prompt "
                             f"is a different problem: set {key} <= {e.have}, or {e.hint}") from None


def build_task(cfg, seed: int, source: str | None = None) -> Task:
    """``cfg``: the preset's ``task`` section (``config.TaskConfig``); ``source``: the preset file, named
    in the errors about ``task.file``."""
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
            raise JetrlError(f"{source + ': ' if source else ''}task.file: required for task.name: jsonl")
        task = JsonlTask(cfg.file, cfg.eval_file, cfg.eval_fraction, cfg.prompt_key, cfg.answer_key,
                         cfg.prompt_template, seed, source)
        train = task.split["train"]
        if cfg.max_samples and len(train) > cfg.max_samples:  # a seeded subset, in the file's order
            keep = sorted(random.Random(f"{seed}/max_samples").sample(range(len(train)), cfg.max_samples))
            task.split["train"] = [train[i] for i in keep]
    else:
        raise JetrlError(f"task.name: unknown task {cfg.name!r} (allowed: {', '.join(TASKS)})")
    task.answer_format = answer_format_of(cfg)
    chat = chat_spec(cfg, task, source)
    if cfg.reward:
        task = UserReward(task, load_reward_fn(cfg.reward), cfg.reward)
    task.chat = chat
    return task


def chat_spec(cfg, task: Task, source: str | None = None) -> ChatSpec | None:
    """Whether ``task``'s prompts go through the model's chat template (``task.chat_template``: null = when
    the jsonl rows' prompts are lists of messages), and with what; None when they do not."""
    pre = f"{source}: " if source else ""
    kinds = getattr(task, "prompt_kinds", {"text": f"task.name {cfg.name}"})
    on = getattr(cfg, "chat_template", None)
    if on is None:
        if len(kinds) > 1:
            raise JetrlError(f"{pre}task.file: {kinds['messages']}'s prompt is a list of chat messages but "
                             f"{kinds['text']}'s a string; set task.chat_template: true to put the strings in the chat "
                             "template as a user message")
        on = "messages" in kinds
    elif not on and "messages" in kinds:
        raise JetrlError(f"{pre}task.chat_template: false, but {kinds['messages']}'s prompt is a list of chat "
                         "messages, which only a chat template turns into text (set it true, or leave it out)")
    if not on:
        for key in ("system_prompt", "chat_template_kwargs"):
            if getattr(cfg, key, None):
                raise JetrlError(f"{pre}task.{key}: read only with a chat template, and {kinds['text']}'s prompts are "
                                 "strings: set task.chat_template: true to put them in the model's chat template")
        return None
    row = getattr(task, "system_row", None)
    system = getattr(cfg, "system_prompt", None)
    if system is not None and row:
        raise JetrlError(f"{pre}task.system_prompt: {row}'s messages have a system message of their own; leave "
                         "task.system_prompt out, or the system message out of the data")
    return ChatSpec(system, dict(getattr(cfg, "chat_template_kwargs", None) or {}))
