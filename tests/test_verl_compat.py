"""What users of verl bring to jetrl, taken as it is: chat templates (``task.chat_template``), rendered as
``transformers``' ``apply_chat_template`` renders a model directory's template and encoded as verl's dataset
encodes it (``tokenize=False``, then ``add_special_tokens=False``); prompts given as chat messages; Parquet
files and nested keys; verl's reward functions; prompts too long for the engine; per-source and sampled
evals. Every mistake is a one-line error."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.config import TaskConfig, load_job_config
from jetrl_cli.errors import JetrlError, PresetError
from jetrl_cli.models.tokenizer import Tokenizer
from jetrl_cli.rl.loop import sampling_params, tiny_policy_dir
from jetrl_cli.tasks import ChatSpec, Problem, PromptSource, build_task

from .conftest import fresh_seed

# Templates that use what Hub templates use: a default system message, bos_token, raise_exception,
# loop.last, break (loopcontrols), tojson, namespace, a template option (enable_thinking), strftime_now.
CHATML = (
    "{%- if messages[0].role != 'system' %}<|im_start|>system\nYou are a careful solver.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
LLAMA = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + m.role + ' is not supported') }}{% endif %}{% set ns.n = ns.n + 1 %}"
    "<|start|>{{ m.role }}<|sep|>{{ m.content | trim }}{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}"
    "<|eot|>{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant ({{ ns.n }} turns, {{ strftime_now('%Y') }})<|sep|>{% endif %}")

# written over several lines with indented tags, as most Hub templates are (trim_blocks, lstrip_blocks)
LINES = """{% for m in messages %}
    {% if m.role == 'system' %}
<|im_start|>system
{{ m.content }}<|im_end|>
    {% else %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def _bpe_dir(path, template, bos: bool):
    """A BPE tokenizer (built here) saved by transformers with ``template``; ``bos``: its post-processor
    adds ``<s>`` to every encoding, as Llama's does."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Tk
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start|>", "<|sep|>", "<|eot|>"]
    tk = Tk(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["What is 12 plus 30? The answer is \\boxed{42}. You are a careful solver."] * 50,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(path)
    return fast


def _problems(seed):
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(3):
        a, b = rng.randrange(100), rng.randrange(100)
        text = f"  What is {a} plus {b}?  "
        msgs = ({"role": "user", "content": f"Hi {a}"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": text, "meta": {"a": a, "tag": "é<&>"}})
        out += [Problem(text, str(a + b)), Problem(text, str(a + b), messages=msgs)]
    return out


@pytest.mark.parametrize("template, bos", [(CHATML, False), (LLAMA, True), (LINES, False)])
@pytest.mark.parametrize("system, kwargs", [(None, {}), ("Be brief.", {"enable_thinking": False})])
def test_prompts_render_and_encode_as_transformers_and_verl_do(tmp_path, template, bos, system, kwargs):
    fast = _bpe_dir(tmp_path / "m", template, bos)
    tok = Tokenizer.from_dir(tmp_path / "m")
    chat = ChatSpec(system, kwargs)
    probs = _problems(fresh_seed())
    texts, ids = tok.encode_prompts(probs, chat)
    for p, text, got in zip(probs, texts, ids):
        msgs = ([{"role": "system", "content": system}] if system else []) + (
            [dict(m) for m in p.messages] if p.messages else [{"role": "user", "content": p.prompt}])
        want = fast.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
        assert text == want
        assert got == fast(want, add_special_tokens=False)["input_ids"]
        assert got.count(1) == (1 if bos else 0)  # the template's BOS, not the post-processor's too
    # without a chat template the prompt is encoded as transformers' tokenizer(text) encodes it (with its BOS)
    texts, ids = tok.encode_prompts(probs[:1])
    assert texts == [probs[0].prompt] and ids == [fast(probs[0].prompt)["input_ids"]]


def test_the_template_is_read_from_each_file_transformers_reads_it_from(tmp_path):
    base = tmp_path / "m"
    _bpe_dir(base, CHATML, False)
    want = Tokenizer.from_dir(base).encode_prompts([Problem("What is 1 plus 2?", "3")], ChatSpec())[0]
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    jinja = (base / "chat_template.jinja").read_text() if (base / "chat_template.jinja").exists() else cfg["chat_template"]
    variants = {
        "jinja": lambda d: (d / "chat_template.jinja").write_text(jinja),
        "json": lambda d: (d / "chat_template.json").write_text(json.dumps({"chat_template": jinja})),
        "config": lambda d: None,
        "config-list": lambda d: None,
    }
    for name, write in variants.items():
        d = tmp_path / name
        shutil.copytree(base, d)
        (d / "chat_template.jinja").unlink(missing_ok=True)
        c = dict(cfg, chat_template=jinja if name == "config" else None)
        if name == "config-list":
            c["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not me') }}"},
                                  {"name": "default", "template": jinja}]
        if name in ("jinja", "json"):
            c.pop("chat_template")
        (d / "tokenizer_config.json").write_text(json.dumps(c))
        write(d)
        assert Tokenizer.from_dir(d).encode_prompts([Problem("What is 1 plus 2?", "3")], ChatSpec())[0] == want, name
    # which wins where several are there, as the tokenizer chooses: chat_template.jinja, then tokenizer_config.json;
    # a processor's chat_template.json last
    wrong = "{{ raise_exception('the wrong file') }}"
    d = tmp_path / "both"
    shutil.copytree(tmp_path / "config", d)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": wrong}))
    assert Tokenizer.from_dir(d).encode_prompts([Problem("What is 1 plus 2?", "3")], ChatSpec())[0] == want
    (d / "chat_template.jinja").write_text(wrong)
    with pytest.raises(JetrlError, match="the wrong file"):
        Tokenizer.from_dir(d).encode_prompts([Problem("What is 1 plus 2?", "3")], ChatSpec())


def _tiny_with_template(tmp_path, template):
    """The shipped tiny policy (a character tokenizer) with a chat template in its tokenizer_config.json."""
    d = tmp_path / "tiny-chat"
    shutil.copytree(tiny_policy_dir(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
    return d


# the tiny policy's alphabet is digits, lower-case letters and " +-*/=:#.,()\n"
TINY = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}answer:{% endif %}"


def _data(tmp_path, rows, name="d.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_a_rollout_of_chat_messages_gives_the_model_the_rendered_prompt(tmp_path):
    """``jetrl rollout`` on jsonl rows whose prompt is a list of messages: the chat template applies by itself
    (``task.chat_template`` left out), the rollout rows hold the rendered prompt and its ids, and the reward
    reads the answer."""
    model = _tiny_with_template(tmp_path, TINY)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)} for i in range(10, 30)]
    data = _data(tmp_path, rows)
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(app, ["rollout", "bf16", "-o", str(out), "--prompts", "2", "--set", f"model.path={model}",
                                   "--set", "task.name=jsonl", "--set", f"task.file={data}", "--set", "rollout.n=2",
                                   "--set", "rollout.max_new_tokens=8", "--set", "task.system_prompt=add"])
    assert res.exit_code == 0, res.output
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 4
    tok = Tokenizer.from_dir(model)
    for r in got:
        q = r["prompt"].split("user: ")[1].split("\n")[0]
        assert r["prompt"] == f"system: add\nuser: {q}\nanswer:"
        assert r["prompt_ids"] == tok.encode(r["prompt"], special=False)
        a, b = q.rstrip("=").split("+")
        assert r["answer"] == str(int(a) + int(b))


def test_the_run_loop_trains_on_chat_prompts(tmp_path):
    """One step of ``jetrl run`` with ``task.chat_template: true`` on string prompts: each becomes a user
    message; the step's samples (rollouts.jsonl) carry the rendered prompts."""
    model = _tiny_with_template(tmp_path, TINY)
    data = _data(tmp_path, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)])
    res = CliRunner().invoke(app, ["run", "bf16", "--set", f"run.out_dir={tmp_path / 'run'}", "--set", f"model.path={model}",
                                   "--set", "task.name=jsonl", "--set", f"task.file={data}",
                                   "--set", "task.chat_template=true", "--set", "train.steps=1",
                                   "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                                   "--set", "rollout.max_new_tokens=6", "--set", "eval.prompts=2", "--set",
                                   "eval.every=0"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"].startswith("user: ") and r["prompt"].endswith("=\nanswer:") for r in rows)


@pytest.mark.parametrize("rows, sets, msg", [
    ([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}, {"prompt": "2+2=", "answer": "4"}], [],
     "task.file: {f}:1's prompt is a list of chat messages but {f}:2's a string; set task.chat_template: true"),
    ([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}], ["task.chat_template=false"],
     "task.chat_template: false, but {f}:1's prompt is a list of chat messages"),
    ([{"prompt": "1+1=", "answer": "2"}], ["task.system_prompt=add"],
     "task.system_prompt: read only with a chat template, and {f}:1's prompts are strings"),
    ([{"prompt": "1+1=", "answer": "2"}], ["task.chat_template_kwargs={enable_thinking: false}"],
     "task.chat_template_kwargs: read only with a chat template"),
    ([{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}], "answer": "2"}],
     ["task.system_prompt=add"], "task.system_prompt: {f}:1's messages have a system message of their own"),
    ([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}], ["task.prompt_template='Q: {prompt}'"],
     "{f}:1: 'prompt' is a list of chat messages, which task.prompt_template 'Q: {prompt}' cannot format"),
])
def test_chat_prompt_mistakes_are_one_line_errors_naming_the_key_and_row(tmp_path, rows, sets, msg):
    f = _data(tmp_path, rows * 3)
    cfg = load_job_config("bf16", ["task.name=jsonl", f"task.file={f}", *sets])
    with pytest.raises(JetrlError) as e:
        build_task(cfg.task, 0, source=cfg.source)
    assert msg.replace("{f}", str(f)) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("sets, msg", [
    (["task.chat_template=false", "task.system_prompt=add"],
     "task.system_prompt: read only with a chat template (task.chat_template is false)"),
    (["task.chat_template_kwargs={add_generation_prompt: false}"],
     "task.chat_template_kwargs.add_generation_prompt: set by jetrl itself"),
    (["task.chat_template_kwargs=[1]"], "task.chat_template_kwargs: expected a mapping of names to values"),
    (["task.system_prompt=' '"], "task.system_prompt: empty"),
])
def test_chat_settings_are_checked_in_the_preset(sets, msg):
    with pytest.raises(PresetError) as e:
        load_job_config("bf16", sets)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("template, msg", [
    (None, "no chat template (chat_template.jinja, tokenizer_config.json's chat_template or chat_template.json)"),
    ("{% for m in messages %}{{ m.role }", "the chat template is not valid Jinja (line 1:"),
    ("{{ raise_exception('only user turns') }}", "the chat template refused the prompt: only user turns"),
    ([{"name": "tool_use", "template": "x"}], "chat_template holds named templates ('tool_use') but no 'default'"),
])
def test_a_missing_or_broken_template_is_a_one_line_error_naming_the_file(tmp_path, template, msg):
    model = _tiny_with_template(tmp_path, template)
    tok = Tokenizer.from_dir(model)
    with pytest.raises(JetrlError) as e:
        tok.encode_prompts([Problem("1+1=", "2")], ChatSpec())
    assert str(e.value).startswith(str(model)) and msg in str(e.value) and "\n" not in str(e.value)


def test_what_transformers_renders_from_other_files_keys_and_tags_is_rendered_the_same(tmp_path):
    """The special tokens where only ``special_tokens_map.json`` names them, messages with null-valued keys (a
    Parquet column of messages gives each message every key any has; transformers leaves the nulls out) and the
    ``{% generation %}`` tag: rendered as ``transformers`` renders them."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    transformers = pytest.importorskip("transformers")
    tpl = ("{{ bos_token }}{% for m in messages %}{% if 'tool_calls' in m %}<calls {{ m.tool_calls|length }}>"
           "{% elif m.role == 'assistant' %}{% generation %}[a]{{ m.content }}{{ eos_token }}{% endgeneration %}"
           "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}[assistant]")
    d = tmp_path / "m"
    _bpe_dir(d, tpl, True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    moved = {k: cfg.pop(k) for k in ("bos_token", "eos_token")}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "special_tokens_map.json").write_text(json.dumps(moved))
    rows = [{"prompt": [{"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "3."},
                        {"role": "user", "content": "And 12 plus 30?"}], "answer": "42"},
            {"prompt": [{"role": "user", "content": "What is 12 plus 30?", "tool_calls": [{"name": "add"}]}],
             "answer": "42"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    task = build_task(TaskConfig(name="jsonl", file=str(tmp_path / "d.parquet")), 0)
    probs = sorted(task.split["train"] + task.split["eval"], key=lambda p: p.where)
    assert probs[0].messages[0]["tool_calls"] is None  # as pyarrow reads it
    fast = transformers.AutoTokenizer.from_pretrained(d)
    texts, ids = Tokenizer.from_dir(d).encode_prompts(probs, task.chat)
    for p, text, got in zip(probs, texts, ids):
        want = fast.apply_chat_template([dict(m) for m in p.messages], add_generation_prompt=True, tokenize=False)
        assert text == want
        assert got == fast(want, add_special_tokens=False)["input_ids"]
    assert texts == ["<s>[user]What is 1 plus 2?[a]3.</s>[user]And 12 plus 30?[assistant]", "<s><calls 1>[assistant]"]


@pytest.mark.parametrize("kwargs, msg", [
    ({"n": 5}, "the chat template failed on the prompt (TypeError: can only concatenate str"),
    ({"n": "5", "items": 3}, "the chat template failed on the prompt (TypeError: 'int' object is not iterable"),
])
def test_a_template_failing_on_the_values_given_is_a_one_line_error(tmp_path, kwargs, msg):
    """A template that fails with an error of its own (not Jinja's) on the prompt or the options given: a
    one-line error naming the template's file, not a traceback."""
    model = _tiny_with_template(tmp_path, "{{ 'n' + n }}{% for i in items or [] %}{{ i }}{% endfor %}answer:")
    with pytest.raises(JetrlError) as e:
        Tokenizer.from_dir(model).encode_prompts([Problem("1+1=", "2")], ChatSpec(None, kwargs))
    assert str(e.value).startswith(str(model)) and msg in str(e.value) and "\n" not in str(e.value)


def test_the_built_in_tasks_take_the_chat_template_when_asked(tmp_path):
    model = _tiny_with_template(tmp_path, TINY)
    cfg = load_job_config("bf16", ["task.chat_template=true", "task.system_prompt=add"])
    task = build_task(cfg.task, 0, source=cfg.source)
    p = PromptSource(task, 0).batch(0, 1)[0]
    texts, _ = Tokenizer.from_dir(model).encode_prompts([p], task.chat)
    assert texts == [f"system: add\nuser: {p.prompt}\nanswer:"]
    assert build_task(load_job_config("bf16", []).task, 0).chat is None


def test_stop_strings_are_encoded_without_the_tokenizers_bos(tmp_path):
    """A tokenizer whose post-processor adds a BOS (Llama's) spelled ``rollout.stop: ["<|eot|>"]`` as
    ``[<s>, <|eot|>]``: a two-token stop sequence no completion ends with. It is one stop token."""
    _bpe_dir(tmp_path / "m", LLAMA, True)
    tok = Tokenizer.from_dir(tmp_path / "m")
    cfg = load_job_config("bf16", ['rollout.stop=["<|eot|>", "The answer"]'])
    sp = sampling_params(cfg, tok)
    assert tok.token_id("<|eot|>") in sp.stop_token_ids
    assert sp.stop_sequences == (tuple(tok.encode("The answer", special=False)),)
    assert 1 not in sp.stop_sequences[0]


def test_task_config_defaults_leave_prompts_as_they_are(tmp_path):
    f = _data(tmp_path, [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    assert build_task(TaskConfig(name="jsonl", file=str(f)), 0).chat is None


# ----------------------------------------------------------------------------- verl's dataset files

def _verl_gsm8k_rows(n, seed):
    """Rows laid out as verl's ``examples/data_preprocess/gsm8k.py`` writes them."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        q = f"{a}+{b}="
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i, "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                                    "question": q}})
    return rows


def test_verls_parquet_data_is_read_as_is(tmp_path):
    """A verl GSM8K Parquet file: ``task.file: train.parquet``, ``task.answer_key: reward_model.ground_truth``
    (a dotted key reads nested fields); its chat prompts go through the model's template by themselves; a
    rollout runs on it."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = _verl_gsm8k_rows(20, fresh_seed())
    f = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    cfg = TaskConfig(name="jsonl", file=str(f), answer_key="reward_model.ground_truth")
    task = build_task(cfg, 0)
    got = {p.prompt: p for p in task.split["train"] + task.split["eval"]}
    assert len(got) == len({r["prompt"][0]["content"] for r in rows})
    for r in rows:
        p = got[r["prompt"][0]["content"]]
        assert p.answer == r["reward_model"]["ground_truth"] and list(p.messages) == r["prompt"]
    assert task.chat is not None and task.chat.system_prompt is None
    # the same through the CLI, on the tiny policy with a chat template
    model = _tiny_with_template(tmp_path, TINY)
    out = tmp_path / "r.jsonl"
    res = CliRunner().invoke(app, ["rollout", "bf16", "-o", str(out), "--prompts", "2", "--set", f"model.path={model}",
                                   "--set", "task.name=jsonl", "--set", f"task.file={f}", "--set",
                                   "task.answer_key=reward_model.ground_truth", "--set", "rollout.n=2",
                                   "--set", "rollout.max_new_tokens=4"])
    assert res.exit_code == 0, res.output
    out_rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(out_rows) == 4 and all(r["prompt"].startswith("user: ") for r in out_rows)


def test_a_dotted_key_reads_nested_fields_and_a_literal_key_wins(tmp_path):
    f = _data(tmp_path, [{"q": {"text": f"{i}+1="}, "a.b": str(i + 1), "a": {"b": "nested"}} for i in range(6)])
    task = build_task(TaskConfig(name="jsonl", file=str(f), prompt_key="q.text", answer_key="a.b"), 0)
    p = task.split["train"][0]
    assert p.prompt.endswith("+1=") and p.answer == str(int(p.prompt.split("+")[0]) + 1)
    missing = _data(tmp_path, [{"q": {"text": "1+1="}, "a": {"c": "2"}}] * 3, "m.jsonl")
    with pytest.raises(JetrlError, match=r"m.jsonl:1: no answer in field 'a.b'"):
        build_task(TaskConfig(name="jsonl", file=str(missing), prompt_key="q.text", answer_key="a.b"), 0)
    with pytest.raises(JetrlError, match=r"m.jsonl:1: no 'q.x' field \(set task.prompt_key\)"):
        build_task(TaskConfig(name="jsonl", file=str(missing), prompt_key="q.x", answer_key="a.c"), 0)


def test_parquet_mistakes_are_one_line_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet\n")
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=str(bad)), 0)
    assert str(e.value).startswith(f"task.file: {bad}: cannot read as Parquet (") and "\n" not in str(e.value)
    with pytest.raises(JetrlError, match="no such dataset file"):
        build_task(TaskConfig(name="jsonl", file=str(tmp_path / "none.parquet")), 0)
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(JetrlError, match=r"reading Parquet needs pyarrow \(pip install 'jetrl\[parquet\]'\)"):
        build_task(TaskConfig(name="jsonl", file=str(bad)), 0)


VERL_REWARD = '''
CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(solution_str.strip() == ground_truth) + 0.25, "acc": solution_str.strip() == ground_truth}


def three(data_source, solution_str, ground_truth):
    return 1.5


def no_score(data_source, solution_str, ground_truth):
    return {"acc": 1.0}


def gsm8k_like(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    # the signature of verl's own verl.utils.reward_score.gsm8k.compute_score: no data_source, no extra_info
    return score if solution_str.strip() == ground_truth else format_score
'''


def test_a_verl_reward_file_is_called_as_verl_calls_it(tmp_path):
    """``task.reward: path/to/file.py:compute_score`` with verl's signature: called by keyword with the row's
    ``data_source`` and ``extra_info``, the completion and the answer; a dict's ``score`` is the reward."""
    import random

    rows = _verl_gsm8k_rows(12, fresh_seed())
    f = _data(tmp_path, rows)
    (tmp_path / "my_reward.py").write_text(VERL_REWARD)
    task = build_task(TaskConfig(name="jsonl", file=str(f), answer_key="reward_model.ground_truth",
                                 reward=f"{tmp_path / 'my_reward.py'}:compute_score"), 0)
    p = task.problems(random.Random(0), 1, "train")[0]
    row = next(r for r in rows if r["prompt"][0]["content"] == p.prompt)
    assert task.reward(p, f" {p.answer}") == 1.25 and task.reward(p, " 0") == 0.25
    import sys

    calls = next(m for n, m in sys.modules.items() if n.startswith("jetrl_reward_") and hasattr(m, "CALLS")).CALLS
    assert calls[-1] == ("openai/gsm8k", " 0", row["reward_model"]["ground_truth"], row["extra_info"])
    # a row without extra_info: verl passes {} (a reward reads extra_info.get(...)), never None
    bare = _data(tmp_path, [{k: v for k, v in r.items() if k != "extra_info"} for r in rows], "bare.jsonl")
    plain = build_task(TaskConfig(name="jsonl", file=str(bare), answer_key="reward_model.ground_truth",
                                  reward=f"{tmp_path / 'my_reward.py'}:compute_score"), 0)
    plain.reward(plain.problems(random.Random(0), 1, "train")[0], " 0")
    assert calls[-1][3] == {}
    three = build_task(TaskConfig(name="jsonl", file=str(f), answer_key="reward_model.ground_truth",
                                  reward=f"{tmp_path / 'my_reward.py'}:three"), 0)
    assert three.reward(p, "x") == 1.5  # verl's older three-parameter form
    own = build_task(TaskConfig(name="jsonl", file=str(f), answer_key="reward_model.ground_truth",
                                reward=f"{tmp_path / 'my_reward.py'}:gsm8k_like"), 0)
    assert own.reward(p, f" {p.answer}") == 1.0 and own.reward(p, " x") == 0.0  # verl's built-in scorers' form
    bad = build_task(TaskConfig(name="jsonl", file=str(f), answer_key="reward_model.ground_truth",
                                reward=f"{tmp_path / 'my_reward.py'}:no_score"), 0)
    with pytest.raises(JetrlError, match=r"returned a dict without 'score' \(keys: 'acc'\)"):
        bad.reward(p, "x")
    # the ground truth as the row holds it, as verl passes it: a number stays a number, "####" text whole
    odd = _data(tmp_path, [{**rows[0], "reward_model": {"ground_truth": 72}},
                           {**rows[1], "reward_model": {"ground_truth": "48 + 24 = 72 #### 72"}}], "odd.jsonl")
    raw = build_task(TaskConfig(name="jsonl", file=str(odd), answer_key="reward_model.ground_truth", eval_fraction=0.5,
                                reward=f"{tmp_path / 'my_reward.py'}:compute_score"), 0)
    for q in raw.inner.split["train"] + raw.inner.split["eval"]:
        assert q.answer == "72"  # jetrl's own answer check reads the text
        raw.reward(q, " 72")
        assert calls[-1][2] in (72, "48 + 24 = 72 #### 72") and type(calls[-1][2]) in (int, str)
    assert {type(c[2]) for c in calls[-2:]} == {int, str}
    # the file torchrun's ranks compare (its digest) is the one named, or the module's
    from jetrl_cli.tasks import reward_source_file

    assert reward_source_file(f"{tmp_path / 'my_reward.py'}:three") == tmp_path / "my_reward.py"
    assert reward_source_file("json:loads") == Path(json.__file__)
    assert reward_source_file(f"{tmp_path / 'none.py'}:f") is None


@pytest.mark.parametrize("body, spec, msg", [
    (None, "{d}/none.py:f", "task.reward: {d}/none.py: no such file"),
    ("def f(:\n", "{d}/r.py:f", "task.reward: cannot load {d}/r.py: SyntaxError"),
    ("def g(p, c, a):\n    return 1\n", "{d}/r.py:f", "task.reward: {d}/r.py has no function 'f'"),
    ("def f(solution_str, ground_truth, data_source, extra_info, more):\n    return 1\n", "{d}/r.py:f",
     "takes (solution_str, ground_truth, data_source, extra_info, more), but is called as f(prompt, completion, "
     "answer) or, verl's, as compute_score("),
])
def test_reward_file_mistakes_are_one_line_errors(tmp_path, body, spec, msg):
    if body is not None:
        (tmp_path / "r.py").write_text(body)
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(reward=spec.format(d=tmp_path)), 0)
    assert msg.format(d=tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_prompts_too_long_for_the_engine_fail_at_start_or_are_dropped(tmp_path):
    """A dataset prompt that leaves no room for its new tokens stopped the run at the step that drew it. It is
    found at start (naming the row), or with ``task.overlong_prompts: drop`` left out and counted."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(12)]
    rows.insert(2, {"prompt": "1+" * 30 + "1=", "answer": "31"})
    f = _data(tmp_path, rows)
    ev = _data(tmp_path, rows[:2] + rows[3:6], "ev.jsonl")
    sets = ["--set", "task.name=jsonl", "--set", f"task.file={f}", "--set", f"task.eval_file={ev}", "--set",
            "rollout.max_len=40", "--set", "rollout.max_new_tokens=8", "--set", "rollout.n=2", "--set",
            "rollout.prompts_per_step=2", "--set", "train.steps=1", "--set", "eval.every=0", "--set", "eval.prompts=2"]
    res = CliRunner().invoke(app, ["run", "bf16", "--set", f"run.out_dir={tmp_path / 'a'}", *sets])
    assert res.exit_code == 2 and not (tmp_path / "a").exists()
    assert res.output.strip().splitlines()[-1] == (
        f"error: {f}:3: prompt of 62 tokens; 1 of 13 train prompts are longer than the 32 that rollout.max_len 40 "
        "leaves beside rollout.max_new_tokens 8: raise rollout.max_len, or set task.overlong_prompts: drop to leave "
        "them out (verl's filter_overlong_prompts)")
    res = CliRunner().invoke(app, ["run", "bf16", "--set", f"run.out_dir={tmp_path / 'b'}", *sets,
                                   "--set", "task.overlong_prompts=drop"])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[1])  # step 1 (0: the first eval)
    assert m["prompts_dropped_train"] == 1 and "prompts_dropped_eval" not in m


@pytest.mark.parametrize("k", [1, 2])
def test_the_eval_reports_each_data_source_when_the_data_names_several(tmp_path, k):
    from jetrl_cli.rl.loop import evaluate, setup

    rows = [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), "data_source": "ab"[i % 2]} for i in range(10, 40)]
    f = _data(tmp_path, rows)
    src = {r["prompt"]: r["data_source"] for r in rows}
    cfg = load_job_config("bf16", ["task.name=jsonl", f"task.file={f}", "task.eval_fraction=0.5", "eval.prompts=12",
                                   f"eval.n={k}", "rollout.max_new_tokens=12"])
    job = setup(cfg, with_trainer=False)
    out, samples = evaluate(job, 12)
    by = {s: [x["correct"] for x in samples if src[x["prompt"]] == s] for s in "ab"}
    assert len(by["a"]) + len(by["b"]) == 12 * k and by["a"] and by["b"]
    for s in "ab":
        assert out[f"eval_accuracy/{s}"] == sum(by[s]) / len(by[s])
        if k > 1:
            groups = [any(x["correct"] for x in samples[i:i + k]) for i in range(0, len(samples), k)
                      if src[samples[i]["prompt"]] == s]
            assert out[f"eval_pass_at_n/{s}"] == sum(groups) / len(groups)
    assert out["eval_accuracy"] == sum(x["correct"] for x in samples) / len(samples)
    one = _data(tmp_path, [dict(r, data_source="a") for r in rows], "one.jsonl")
    job = setup(load_job_config("bf16", ["task.name=jsonl", f"task.file={one}", "task.eval_fraction=0.5",
                                         "eval.prompts=4", "rollout.max_new_tokens=8"]), with_trainer=False)
    assert set(evaluate(job, 4)[0]) == {"eval_accuracy"}  # one source: nothing more


def test_eval_sampling_settings_and_skipping_the_first_eval(tmp_path, monkeypatch):
    """``eval.temperature`` / ``top_p`` / ``top_k`` (verl's val_kwargs) sample the eval even with ``eval.n: 1``;
    unset, ``n: 1`` is greedy; ``eval.before_train: false`` leaves out step 0's eval (verl's val_before_train)."""
    from jetrl_cli.rl import loop

    seen = []
    real = loop.rollout_samples
    monkeypatch.setattr(loop, "rollout_samples", lambda job, probs, seed, sampling=None, **kw: (
        seen.append(sampling), real(job, probs, seed, sampling=sampling, **kw))[1])
    base = ["eval.prompts=2", "rollout.max_new_tokens=8", "rollout.temperature=0.9", "rollout.top_k=7"]
    for sets, want in ((["eval.temperature=0.6", "eval.top_p=0.8"], (0.6, 0.8, 7, 1)),
                       ([], (0.0, 1.0, 0, 1)),
                       (["eval.n=3"], (0.9, 1.0, 7, 3))):
        job = loop.setup(load_job_config("bf16", base + sets), with_trainer=False)
        seen.clear()
        loop.evaluate(job, 2)
        sp = seen[-1]
        assert (sp.temperature, sp.top_p, sp.top_k, sp.n) == want, sets
    res = CliRunner().invoke(app, ["run", "bf16", "--set", f"run.out_dir={tmp_path / 'r'}", "--set", "train.steps=1",
                                   "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2", "--set",
                                   "rollout.max_new_tokens=6", "--set", "eval.prompts=2", "--set",
                                   "eval.before_train=false"])
    assert res.exit_code == 0, res.output
    steps = [json.loads(x)["step"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # the last step's eval rides on its line


@pytest.mark.parametrize("sets, msg", [
    (["eval.temperature=0.01"], "eval.temperature: must be 0 (greedy) or >= 0.05, got 0.01"),
    (["eval.temperature=0", "eval.n=4"], "eval.n: 4 samples per prompt with eval.temperature 0 would all be"),
    (["eval.top_p=0.5"], "eval.top_p: read only by a sampled eval (eval.n > 1, or eval.temperature > 0)"),
    (["eval.n=2", "eval.top_p=1.5"], "eval.top_p: must be in (0, 1], got 1.5"),
    (["eval.before_train=false", "train.steps=0"], "eval.before_train: false with train.steps: 0 leaves the run "
     "nothing to do"),
])
def test_eval_sampling_mistakes_are_refused_in_the_preset(sets, msg):
    with pytest.raises(PresetError) as e:
        load_job_config("bf16", sets)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_several_data_files_are_read_in_turn_whatever_their_format(tmp_path):
    """``task.file`` / ``task.eval_file`` as lists (verl's ``data.train_files``): every file's rows, JSONL and
    Parquet alike; a bad row is named by its own file; an empty list is refused in the preset."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    a = _data(tmp_path, [{"prompt": f"{i}+1=", "answer": str(i + 1), "data_source": "a"} for i in range(5)])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{i}+2=", "answer": str(i + 2), "data_source": "b"}
                                         for i in range(7)]), b)
    ev = _data(tmp_path, [{"prompt": f"{i}+3=", "answer": str(i + 3)} for i in range(3)], "ev.jsonl")
    cfg = load_job_config("bf16", ["task.name=jsonl", f"task.file=[{a}, {b}]", f"task.eval_file=[{ev}]"])
    task = build_task(cfg.task, 0, source=cfg.source)
    train = task.split["train"]
    assert [p.prompt for p in train] == [f"{i}+1=" for i in range(5)] + [f"{i}+2=" for i in range(7)]
    assert [p.where for p in train][4:6] == [f"{a}:5", f"{b}:1"] and len(task.split["eval"]) == 3
    bad = _data(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1="}], "bad.jsonl")
    with pytest.raises(JetrlError, match=f"{bad}:2: no answer in field 'answer'"):
        build_task(load_job_config("bf16", ["task.name=jsonl", f"task.file=[{a}, {bad}]"]).task, 0)
    for sets, msg in ((["task.file=[]"], "task.file: required for task.name: jsonl"),
                      ([f"task.file=[{a}, '']"], "task.file: a list of files must name at least one, each non-empty")):
        with pytest.raises(PresetError, match=msg):
            load_job_config("bf16", ["task.name=jsonl", *sets])
    # torchrun's ranks compare every file's digest
    from jetrl_cli.cli import _run_identity

    ident = _run_identity(cfg, tmp_path / "out", False, False)
    assert {"task.file's contents [0]", "task.file's contents [1]", "task.eval_file's contents [0]"} <= set(ident)


def test_mismatch_report_draws_the_prompts_the_run_keeps_when_it_drops_long_ones(tmp_path, monkeypatch):
    """With ``task.overlong_prompts: drop`` the report measures the run's prompts, not the ones it leaves out."""
    from jetrl_cli.rl import mismatch as mm

    rows = [{"prompt": ("1+" * (20 if i % 2 else 1)) + "1=", "answer": "2"} for i in range(40)]
    f = _data(tmp_path, rows)
    seen = []

    class Stop(Exception):
        pass

    def capture(model, decode, prompts, *a, **k):
        seen.append(prompts)
        raise Stop

    monkeypatch.setattr(mm, "ReportInputs", capture)
    with pytest.raises(Stop):
        CliRunner().invoke(app, ["mismatch-report", "bf16", "--prompts", "12", "--out", str(tmp_path / "rep"),
                                 "--set", "task.name=jsonl", "--set", f"task.file={f}", "--set", "rollout.max_len=40",
                                 "--set", "rollout.max_new_tokens=8", "--set", "task.overlong_prompts=drop"],
                           catch_exceptions=False)
    assert len(seen[0]) == 12 and max(map(len, seen[0])) <= 32


def test_max_samples_keeps_a_seeded_subset_of_the_training_rows(tmp_path):
    """``task.max_samples`` (verl's ``train_max_samples``): at most that many training rows, a subset drawn with
    the run's seed, in the file's order; the held-out split is untouched."""
    f = _data(tmp_path, _verl_gsm8k_rows(40, fresh_seed()))

    def split(max_samples, seed):
        task = build_task(TaskConfig(name="jsonl", file=str(f), answer_key="reward_model.ground_truth",
                                     max_samples=max_samples), seed)
        return getattr(task, "inner", task).split

    full, cut = split(0, 3), split(10, 3)
    got = cut["train"]
    assert len(got) == 10 and got == [p for p in full["train"] if p in got] and cut["eval"] == full["eval"]
    assert got == split(10, 3)["train"] and got != split(10, 4)["train"]
    assert split(100, 3)["train"] == full["train"]
    with pytest.raises(PresetError, match="task.max_samples: read only by task.name: jsonl"):
        load_job_config("fp8-unified", ["task.max_samples=5"])
