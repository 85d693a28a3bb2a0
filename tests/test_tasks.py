"""Tasks, answer checking, splits, user rewards, tokenizers."""

import json
import random

import pytest

from jetrl_cli.config import TaskConfig
from jetrl_cli.errors import JetrlError
from jetrl_cli.tasks import (Arith, Count, PromptSource, Sort, answers_match, build_task, extract_answer,
                             _is_eval)


@pytest.mark.parametrize("text,ans", [
    ("so 3+4=7 #### 7", "7"), ("The answer is \\boxed{42}.", "42"), ("\\boxed{\\frac{1}{2}} then #### 3", "\\frac{1}{2}"),
    ("#### 1,234\nmore", "1,234"), ("no answer here", None), ("\\boxed{a{b}c}", "a{b}c"),
])
def test_extract_answer(text, ans):
    assert extract_answer(text) == ans


@pytest.mark.parametrize("fmt,text,ans", [
    ("auto", "7", "7"), ("auto", " The answer is 1,234.", "1,234"), ("auto", "3+4=7, so 7.", "7"),
    ("auto", "12-3 gives -9? no: 9", "9"), ("auto", "half: .5", ".5"), ("auto", "x = 3/4", "3/4"),
    ("auto", "is it -5", "-5"), ("auto", "12-3", "3"), ("auto", "no digits", None),
    ("auto", "\\boxed{12} or 13", "12"), ("auto", "#### 8 then 9", "8 then 9"),
    ("last_number", "#### 8 then 9", "9"), ("boxed", "#### 8", None), ("boxed", "so \\boxed{8}", "8"),
    ("gsm8k", "\\boxed{8}", None), ("gsm8k", "#### 8", "8"), ("boxed_or_gsm8k", "the answer is 8", None),
    ("auto", "\\boxed{} 5", None), ("boxed_or_gsm8k", "####", None),
    # a box left empty or cut off is no answer, whatever number came before it; a completion with
    # neither a box nor #### falls back to its last number (auto)
    ("auto", "We get 18. \\boxed{}", None), ("auto", "6*3 = 18, so \\boxed{18", None),
    ("auto", "6*3 = 18. Then we", "18"), ("boxed_or_gsm8k", "\\boxed{18 #### 18", None),
    ("boxed", "\\boxed 18.", "18"), ("boxed", "\\boxed {18}", "18"), ("boxed", "\\fbox{18}", "18"),
    ("last_number", "The answer is \u22125.", "-5"),
])
def test_answer_formats(fmt, text, ans):
    assert extract_answer(text, fmt) == ans


def test_answer_format_defaults_and_what_a_plain_number_answer_scores(tmp_path):
    """SmolLM2-style: 'What is A plus B? Answer with just the number.' -> ' 7'."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"What is {i} plus 4? Answer with just the number.",
                                     "answer": str(i + 4)}) + "\n" for i in range(20)))
    jsonl = build_task(TaskConfig(name="jsonl", file=str(f)), 0)
    p = jsonl.problems(random.Random(0), 1, "train")[0]
    assert jsonl.answer_format == "auto" and jsonl.reward(p, f" {p.answer}") == 1.0
    assert jsonl.extract(" I think 9") == "9" and jsonl.reward(p, " no idea") == 0.0
    strict = build_task(TaskConfig(name="jsonl", file=str(f), answer_format="boxed_or_gsm8k"), 0)
    assert strict.reward(p, f" {p.answer}") == 0.0 and strict.extract(f" {p.answer}") is None
    arith = build_task(TaskConfig(name="arith", digits=2), 0)
    q = arith.problems(random.Random(0), 1, "train")[0]
    assert arith.answer_format == "boxed_or_gsm8k" and arith.reward(q, q.answer) == 0.0  # needs '#### '
    assert build_task(TaskConfig(name="arith", answer_format="last_number"), 0).reward(q, q.answer) == 1.0


@pytest.mark.parametrize("pred,ref,ok", [
    ("1,000", "1000", True), ("$1000.00", "1000", True), ("0.5", "\\frac{1}{2}", True), ("1/2", "0.5", True),
    ("72", "72.0", True), ("1e3", "1000", True), ("71", "72", False), ("1 2 3", "1  2 3", True), ("abc", "abd", False),
    (None, "1", False), ("50%", "50", True),
    # LaTeX that dresses a number (verl's math reward strips it too)
    ("\\$18", "18", True), ("\\$18.00", "18", True), ("\\$1,234.50", "1234.5", True), ("1{,}234", "1234", True),
    ("1\\,234", "1234", True), ("1 234", "1234", True), ("18 \\text{ dollars}", "18", True),
    ("18\\text{ apples}", "18", True), ("18 dollars", "18", True), ("x = 18", "18", True), ("\\textbf{18}", "18", True),
    ("18^\\circ", "18", True), ("10", "10^{\\circ}", True), ("\u22125", "-5", True), ("-\\frac{1}{2}", "-0.5", True),
    ("\\dfrac{1}{2}", "0.5", True), ("\\frac12", "\\frac{1}{2}", True), ("2\\frac{1}{2}", "2.5", True),
    ("1.8 \\times 10^{1}", "18", True), ("10^6", "1,000,000", True), (".5", "0.5", True), ("0.5", ".5", True),
    # text answers compared without whitespace and dressing
    ("(1, 2)", "(1,2)", True), ("x^2 + 1", "x^2+1", True), ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}", True),
    ("\\left( 3, \\frac{\\pi}{2}\\right)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\text{Evelyn}", "Evelyn", True), ("Evelyn.", "Evelyn", True), ("3, 5", "3,5", True),
    # never a wrong answer graded right: a comma is a thousands separator only in groups of three, a
    # leading dot is a decimal point, an exponent beyond 10^1000 is text (10^1e9 took minutes to build)
    (".5", "5", False), ("1,2", "12", False), ("35", "3,5", False), ("...18", "18", False), ("1,2,34", "1234", False),
    ("180", "18", False), ("1.8", "18", False), ("-18", "18", False), ("18x", "18", False), ("1e10000000", "18", False),
])
def test_answers_match(pred, ref, ok):
    assert answers_match(pred, ref) is ok
    assert pred is None or answers_match(ref, pred) is ok  # symmetric


def test_a_huge_exponent_is_text_not_a_number():
    from fractions import Fraction

    from jetrl_cli.tasks import normalize

    assert normalize("1e1000") == Fraction(10) ** 1000 and normalize("1e1001") == "1e1001"
    assert normalize("10^{1001}") == "10^{1001}" and normalize("2 \\times 10^{999999999}") == "2\\times10^{999999999}"


@pytest.mark.parametrize("task", [Arith(1), Arith(5), Sort(7), Count(9)])
def test_worked_solutions_earn_full_reward_and_length_grows(task):
    rng = random.Random(0)
    for p in task.problems(rng, 20, "train"):
        assert task.reward(p, " " + p.solution) == 1.0
        assert task.reward(p, " " + p.solution.replace(p.answer, p.answer + "1")) == 0.0
        assert not _is_eval(p.prompt)
    assert len(Arith(8).make(rng).solution) > 2 * len(Arith(3).make(rng).solution)


def test_train_and_eval_splits_are_disjoint_and_batches_deterministic():
    task = build_task(TaskConfig(name="mix", digits=2, length=4), seed=0)
    src = PromptSource(task, seed=0)
    ev = {p.prompt for p in src.eval_set(40)}
    tr = {p.prompt for s in range(20) for p in src.batch(s, 16)}
    assert ev and tr and not ev & tr
    assert src.batch(3, 8) == PromptSource(task, seed=0).batch(3, 8)
    assert src.batch(3, 8) != src.batch(4, 8)
    assert src.batch(3, 8, round_=1) != src.batch(3, 8)  # a refill round draws other problems


def test_the_eval_draws_different_problems_and_refuses_more_than_are_held_out(tmp_path):
    """A 20-row file holds out 2 rows: an eval of 64 prompts would be those 2, repeated; it is refused, naming
    eval.prompts and the held-out size. Up to that size every eval prompt is a different problem, and the
    built-in tasks' evals too (the shipped presets' 64-prompt eval drew 61 different problems)."""
    f = _jsonl(tmp_path / "d20.jsonl", [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(20)])
    src = PromptSource(build_task(TaskConfig(name="jsonl", file=f), 0), 0)
    assert len({p.prompt for p in src.eval_set(2)}) == 2
    with pytest.raises(JetrlError) as e:
        src.eval_set(64)
    assert str(e.value) == (f"eval.prompts 64: more than the 2 different problems of the held-out split of {f} "
                            "(task.eval_fraction 0.1 of 20 rows); each eval prompt is a different problem: set "
                            "eval.prompts <= 2, or hold out more rows (task.eval_file, or a larger task.eval_fraction)")
    big = PromptSource(build_task(TaskConfig(name="jsonl", file=f, eval_fraction=0.5), 0), 0)
    assert len({p.prompt for p in big.eval_set(10)}) == 10
    ev = _jsonl(tmp_path / "test.jsonl", [{"prompt": f"What is {i}+2?", "answer": str(i + 2)} for i in range(3)])
    with pytest.raises(JetrlError, match=r"^eval.prompts 4: more than the 3 different problems of task.eval_file "):
        PromptSource(build_task(TaskConfig(name="jsonl", file=f, eval_file=ev), 0), 0).eval_set(4)
    arith = PromptSource(build_task(TaskConfig(name="arith", digits=2), 0), 0)
    assert len({p.prompt for p in arith.eval_set(64)}) == 64
    assert arith.eval_set(8) == arith.eval_set(64)[:8]  # the first draws kept: a shorter eval is a prefix
    with pytest.raises(JetrlError, match=r"^eval.prompts 64: more than the \d+ different problems of task arith's "
                                         r"eval split at this size .*make the task larger \(task.digits, task.length\)$"):
        PromptSource(build_task(TaskConfig(name="arith", digits=1), 0), 0).eval_set(64)


def test_jsonl_train_draws_beyond_the_epoch_walk_take_every_row_before_repeating_one(tmp_path):
    """Dynamic sampling's refill rounds draw from the train split: without replacement, so a refill does not
    repeat a row while others wait, and every row once per pass when more are asked for than the split holds."""
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(11)])
    src = PromptSource(build_task(TaskConfig(name="jsonl", file=f), 0), 0)  # 10 train rows
    refill = [p.prompt for p in src.batch(0, 10, round_=1)]
    assert len(set(refill)) == 10
    more = [p.prompt for p in src.batch(0, 25, round_=1)]
    assert len(set(more[:10])) == len(set(more[10:20])) == 10 and len(set(more[20:])) == 5


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_task_gsm8k_style(tmp_path):
    rows = [{"question": f"What is {i}+{i}?", "answer": f"Think. #### {2 * i}"} for i in range(30)]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    task = build_task(TaskConfig(name="jsonl", file=f, prompt_key="question", prompt_template="Q: {prompt}\nA:"), 0)
    src = PromptSource(task, 0)
    ev, tr = src.eval_set(3), src.batch(0, 27)
    assert len(task.split["eval"]) == 3 and len(task.split["train"]) == 27
    assert not {p.prompt for p in ev} & {p.prompt for p in tr}  # one epoch walks the train split once
    p = tr[0]
    assert p.prompt.startswith("Q: What is ") and p.prompt.endswith("\nA:")
    assert task.reward(p, f"so \\boxed{{{p.answer}}}") == 1.0
    assert task.reward(p, "#### 9999") == 0.0


@pytest.mark.parametrize("rows,msg", [
    ([], "empty dataset"),
    ([{"prompt": "a", "answer": ""}], "no answer in field 'answer'"),
    ([{"prompt": "a"}], "no answer in field 'answer'"),
    ([{"question": "a", "answer": "1"}], "no 'prompt' field"),
])
def test_jsonl_task_bad_input(tmp_path, rows, msg):
    f = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(JetrlError, match=msg):
        build_task(TaskConfig(name="jsonl", file=f), 0)
    with pytest.raises(JetrlError, match="no such dataset file"):
        build_task(TaskConfig(name="jsonl", file=str(tmp_path / "missing.jsonl")), 0)


def test_user_reward_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text("def score(prompt, completion, answer):\n    return len(completion) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task(TaskConfig(name="arith", digits=2, reward="myreward:score", answer_format="gsm8k"), 0)
    p = task.problems(random.Random(0), 1, "train")[0]
    assert task.reward(p, "x" * 5) == 0.5
    assert task.answer_format == "gsm8k" and task.extract("\\boxed{3} #### 4") == "4"
    assert task.correct(p, " " + p.solution)
    with pytest.raises(JetrlError, match="cannot import"):
        build_task(TaskConfig(reward="no_such_module_xyz:f"), 0)
    with pytest.raises(JetrlError, match="has no function"):
        build_task(TaskConfig(reward="myreward:nope"), 0)
    with pytest.raises(JetrlError, match="must look like"):
        build_task(TaskConfig(reward="myreward"), 0)


def test_char_tokenizer_round_trip_and_transformers_agree(tmp_path):
    from jetrl_cli.models.tokenizer import Tokenizer, write_char_tokenizer
    from jetrl_cli.tasks import ALPHABET

    write_char_tokenizer(tmp_path, ALPHABET)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 1}')
    tok = Tokenizer.from_dir(tmp_path)
    text = "47+85= 7+5=12 4+8+1=13 #### 132\nsort 3 1:"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_ids == (1,) and tok.pad_id == 0
    assert tok.decode(ids + [1]) == text  # special tokens are skipped
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode(text) == ids and hf.eos_token_id == 1


def test_tokenizer_missing_is_a_clear_error(tmp_path):
    from jetrl_cli.models.tokenizer import Tokenizer

    with pytest.raises(JetrlError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
