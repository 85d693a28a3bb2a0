"""A preset's values, its YAML, a user's reward function and JSONL data: each mistake is one line naming
the file, key or function -- never a traceback, never NaN numbers or a silently different prompt."""

import json
import random
import sys

import pytest

from jetrl_cli.config import TaskConfig, load_job_config
from jetrl_cli.errors import JetrlError, PresetError
from jetrl_cli.presets_io import load_yaml, resolve_preset_path
from jetrl_cli.tasks import build_task

from .test_run_output import invoke, sets
from .test_user_mistakes import one_line_error

P = str(resolve_preset_path("bf16"))
SMALL = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.n=2", "eval.prompts=2", "eval.every=0",
         "rollout.max_new_tokens=8", "rollout.max_len=24"]


def refused(overrides, preset="bf16") -> str:
    with pytest.raises(PresetError) as e:
        load_job_config(preset, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- 1. NaN and infinity


@pytest.mark.parametrize("key_value, message", [
    ("train.lr=inf", "train.lr: must be a finite number > 0, got inf"),
    ("rollout.temperature=nan", "rollout.temperature: must be a finite number >= 0.05, got nan"),
    ("train.clip_low=nan", "train.clip_low: must be a finite number >= 0, got nan"),
    ("train.kl_coef=.inf", "train.kl_coef: must be a finite number >= 0, got inf"),
    ("task.overlong_penalty=nan", "task.overlong_penalty: must be a finite number >= 0, got nan"),
    ("train.weight_decay=nan", "train.weight_decay: must be a finite number >= 0, got nan"),
    ("train.clip_high=.inf", "train.clip_high: must be a finite number >= 0, got inf"),
    ("train.dual_clip=inf", "train.dual_clip: must be a finite number, got inf"),
    ("correction.tis_cap=.inf", "correction.tis_cap: must be a finite number > 0, got inf"),
    ("correction.mis_high=inf", "correction.mis_high: must be a finite number > 0, got inf"),
    ("train.grad_clip=-inf", "train.grad_clip: must be a finite number > 0, got -inf"),
    ("train.betas=[0.9, .nan]", "train.betas[1]: must be a finite number, got nan"),
])
def test_nan_and_infinity_are_refused(key_value, message):
    assert refused([key_value]) == f"{P}: {message}"


def test_nan_in_a_preset_file_and_through_jetrl_flow(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("precision: bf16\ntrain:\n  lr: .nan\n")
    assert refused([], str(p)) == f"{p}: train.lr: must be a finite number > 0, got nan"
    msg = one_line_error(invoke("flow", "bf16", "--set", "rollout.temperature=inf"))
    assert f"{P}: rollout.temperature: must be a finite number >= 0.05, got inf" in msg


# ----------------------------------------------------------------------------- 2. temperature 0


def test_a_greedy_rollout_is_refused_saying_why():
    msg = refused(["rollout.temperature=0"])
    assert msg.startswith(f"{P}: rollout.temperature: must be >= 0.05, got 0: greedy rollouts make every sample")
    assert "every advantage is 0" in msg and "eval.n: 1" in msg
    assert load_job_config("bf16", ["rollout.temperature=0.6"]).rollout.temperature == 0.6


@pytest.mark.parametrize("t", ["1e-30", "1e-6", "0.01", "0.049"])
def test_a_temperature_so_low_it_is_greedy_in_effect_is_refused_as_0_is(t):
    msg = refused([f"rollout.temperature={t}"])
    assert msg.startswith(f"{P}: rollout.temperature: must be >= 0.05, got {float(t):g}: so low a temperature "
                          "samples greedily in effect")
    assert "every advantage is 0" in msg
    assert refused(["rollout.temperature=-1"]) == f"{P}: rollout.temperature: must be >= 0.05, got -1"
    assert load_job_config("bf16", ["rollout.temperature=0.05"]).rollout.temperature == 0.05


# ----------------------------------------------------------------------------- 3. duplicate YAML keys


@pytest.mark.parametrize("text, message", [
    ("precision: bf16\ntrain:\n  lr: 1.0e-5\nrollout:\n  n: 4\ntrain:\n  steps: 2\n",
     "train: set twice, on lines 2 and 6"),
    ("precision: bf16\ntrain:\n  lr: 1.0e-5\n  steps: 2\n  lr: 2.0e-5\n", "train.lr: set twice, on lines 3 and 5"),
    ("precision:\n  base: bf16\n  train:\n    wgrad: fp8\n    wgrad: bf16\n",
     "precision.train.wgrad: set twice, on lines 4 and 5"),
    ("precision: bf16\ntrain: {lr: 1.0e-5, lr: 2.0e-5}\n", "train.lr: set twice, on line 2"),
])
def test_duplicate_yaml_keys_are_refused_with_their_lines(tmp_path, text, message):
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    with pytest.raises(PresetError) as e:
        load_yaml(p)
    assert str(e.value).startswith(f"{p}: {message} (YAML would silently keep only the last; remove one)")


def test_a_yaml_merge_key_is_not_a_duplicate(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("precision: bf16\nrollout:\n  <<: {n: 4, max_new_tokens: 8}\n  n: 6\n")
    assert load_yaml(p)["rollout"] == {"n": 6, "max_new_tokens": 8}


# ----------------------------------------------------------------------------- 4. --set values read as YAML


def test_an_unquoted_set_value_for_a_string_key_says_how_to_quote_it():
    msg = refused(["task.prompt_template=Q: {prompt}"])
    assert msg == (f"{P}: task.prompt_template: expected a string, got a mapping {{'Q': {{'prompt': None}}}}: "
                   "--set reads the value as YAML; quote it: --set 'task.prompt_template=\"Q: {prompt}\"'")
    cfg = load_job_config("bf16", ["task.name=jsonl", "task.file=d.jsonl",
                                   'task.prompt_template="Q: {prompt}"'])  # the suggestion works
    assert cfg.task.prompt_template == "Q: {prompt}"
    assert "quote it: --set 'task.prompt_key=\"[q]\"'" in refused(["task.prompt_key=[q]"])


def test_a_mapping_for_a_string_key_in_a_preset_file_says_to_quote_it(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("precision: bf16\ntask:\n  prompt_template: {prompt}\n")
    assert refused([], str(p)) == (f"{p}: task.prompt_template: expected a string, got a mapping {{'prompt': None}} "
                                   "(YAML reads {...} as a mapping and [...] as a list: put the value in quotes)")


def test_numbers_only_yaml_1_1_reads_as_numbers_are_refused_not_converted(tmp_path):
    """``steps: 1:30`` is 90 in YAML 1.1 (base 60) and ``010`` is 8 (octal): the preset loads both as the text
    written, so a number key refuses them by name and a string key gets what was written."""
    p = tmp_path / "p.yaml"
    p.write_text("precision: bf16\ntrain:\n  steps: 1:30\n")
    assert refused([], str(p)) == (f"{p}: train.steps: expected an integer, got '1:30' (YAML 1.1 would read 1:30 "
                                   "in base 60, as 90; write a plain number)")
    assert refused(["train.steps=1:30"]).startswith(f"{P}: train.steps: expected an integer, got '1:30'")
    assert refused(["train.lr=1:30.5"]) == (f"{P}: train.lr: expected a number, got '1:30.5' (YAML 1.1 would read "
                                            "1:30.5 in base 60, as 90.5; write a plain number)")
    assert refused(["train.steps=010"]) == (f"{P}: train.steps: expected an integer, got '010' (YAML 1.1 would read "
                                            "a leading 0 as octal; write 10)")
    assert load_job_config("bf16", ["run.out_dir=1:30"]).run.out_dir == "1:30"
    cfg = load_job_config("bf16", ["train.steps=0", "train.lr=3e-5", "rollout.n=0x10", "train.warmup_steps=1_0"])
    assert (cfg.train.steps, cfg.train.lr, cfg.rollout.n, cfg.train.warmup_steps) == (0, 3e-5, 16, 10)


# ----------------------------------------------------------------------------- 5. the user's reward function

REWARDS = """\
import math
def raises(prompt, completion, answer):
    raise KeyError("no such field")
def none(prompt, completion, answer):
    return None
def high(prompt, completion, answer):
    return "high"
def nan(prompt, completion, answer):
    return math.nan
def inf(prompt, completion, answer):
    return -math.inf
def two(prompt, completion):
    return 1.0
def anything(*args):
    return 0.5
def flag(prompt, completion, answer, scale=1):
    return completion.strip() == answer
"""


@pytest.fixture
def myreward(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myreward", None)
    yield
    sys.modules.pop("myreward", None)


def _score(fn, completion="x"):
    task = build_task(TaskConfig(name="arith", digits=2, reward=f"myreward:{fn}"), 0)
    p = task.problems(random.Random(0), 1, "train")[0]
    return p, task.reward(p, completion)


@pytest.mark.parametrize("fn, what", [
    ("raises", "raised KeyError: 'no such field' for prompt '{p}'"),
    ("none", "returned None for prompt '{p}' (must return a finite float)"),
    ("high", "returned 'high' for prompt '{p}' (must return a finite float)"),
    ("nan", "returned nan for prompt '{p}' (must return a finite float)"),
    ("inf", "returned -inf for prompt '{p}' (must return a finite float)"),
])
def test_a_reward_function_that_fails_or_returns_no_number_is_one_line(myreward, fn, what):
    task = build_task(TaskConfig(name="arith", digits=2, reward=f"myreward:{fn}"), 0)
    p = task.problems(random.Random(0), 1, "train")[0]
    with pytest.raises(JetrlError) as e:
        task.reward(p, "x")
    assert str(e.value) == f"task.reward myreward:{fn} " + what.format(p=p.prompt)


def test_a_long_prompt_is_cut_in_the_reward_error(myreward, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": "line one\n" + "x" * 200 + str(i), "answer": "1"}) + "\n"
                         for i in range(4)))
    task = build_task(TaskConfig(name="jsonl", file=str(f), reward="myreward:none"), 0)
    with pytest.raises(JetrlError) as e:
        task.reward(task.problems(random.Random(0), 1, "train")[0], "1")
    assert "for prompt 'line one\\nxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' (must return" in str(e.value)


def test_a_reward_function_with_the_wrong_signature_is_refused_at_load(myreward):
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(reward="myreward:two"), 0)
    assert str(e.value) == ("task.reward myreward:two: takes (prompt, completion), but is called as "
                            "two(prompt, completion, answer) or, verl's, as compute_score(data_source=, solution_str=, "
                            "ground_truth=, extra_info=); it must return a number")
    assert _score("anything")[1] == 0.5  # *args takes the three
    p, r = _score("flag", completion="no")
    assert r == 0.0 and _score("flag", completion=p.answer)[1] == 1.0  # a bool counts as 1 / 0


def test_a_reward_module_in_the_current_directory_hints_at_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "localreward.py").write_text("def f(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(reward="localreward:f"), 0)
    assert str(e.value) == ("task.reward: cannot import 'localreward' (No module named 'localreward'); "
                            "localreward.py is in the current directory, which Python does not search: put it "
                            "on PYTHONPATH, e.g. PYTHONPATH=. jetrl run ...")
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(JetrlError, match=r"^task.reward: cannot import 'broken': SyntaxError: "):
        build_task(TaskConfig(reward="broken:f"), 0)


def test_a_run_whose_reward_returns_none_stops_with_one_line(myreward, tmp_path):
    msg = one_line_error(invoke("run", "bf16", "-o", tmp_path / "o", *sets(SMALL + ["task.reward=myreward:none"])))
    assert "task.reward myreward:none returned None for prompt '" in msg and "(must return a finite float)" in msg


# ----------------------------------------------------------------------------- 6. JSONL data and its template


def _data(tmp_path, rows, name="d.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(f)


GOOD = [{"prompt": f"{i}+1=", "answer": i + 1, "hint": "add"} for i in range(6)]


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "2+2=", "answer": [4]},
     "{f}:3: 'answer' must be a string or a finite number, got [4] (task.answer_key)"),
    ({"prompt": "2+2=", "answer": True}, "{f}:3: 'answer' must be a string or a finite number, got true"),
    ({"prompt": "2+2=", "answer": {"v": 4}}, "{f}:3: 'answer' must be a string or a finite number, got {\"v\": 4}"),
    ({"prompt": None, "answer": "4"}, "{f}:3: 'prompt' must be a string or a list of chat messages ([{\"role\": "
     "..., \"content\": ...}, ...]), got null (task.prompt_key)"),
    ({"prompt": ["2+2="], "answer": "4"}, "{f}:3: 'prompt'[0] must be a chat message {\"role\": <string>, "
     "\"content\": <string>}, got \"2+2=\""),
    ({"prompt": [], "answer": "4"}, "{f}:3: 'prompt' is an empty list of chat messages"),
    ({"prompt": [{"role": "user", "content": "2+2="}, {"role": "user"}], "answer": "4"},
     "{f}:3: 'prompt'[1] must be a chat message"),
    ({"prompt": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}], "answer": "4"},
     "{f}:3: 'prompt''s last message is the assistant's"),
    (7, "{f}:3: expected a JSON object per line, got 7"),
    ({"prompt": "2+2=", "answer": "4 ####"}, "{f}:3: nothing after '####' in field 'answer' (GSM8K-style answers "
     "end with '#### <answer>'; every row needs one)"),
    ({"prompt": "2+2=", "answer": "Think. ####  "}, "{f}:3: nothing after '####' in field 'answer'"),
])
def test_jsonl_rows_of_the_wrong_type_are_refused_with_file_line_and_key(tmp_path, bad, message):
    f = _data(tmp_path, GOOD[:2] + [bad] + GOOD[2:])
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=f), 0)
    assert str(e.value).startswith(message.replace("{f}", f))


@pytest.mark.parametrize("template, message", [
    ("{prompt.upper}", "{prompt.upper} reads an attribute or item of a field"),
    ("{hint[0]}: {prompt}", "{hint[0]} reads an attribute or item of a field"),
    ("Q: {prompt} (it is {answer})", "{answer} is the answer (task.answer_key): the prompt would give it away"),
    ("Q: {}", "{} is a positional field; name a field of the row, e.g. {prompt}"),
])
def test_a_prompt_template_is_checked_once_at_load(tmp_path, template, message):
    f = _data(tmp_path, GOOD)
    msg = refused(["task.name=jsonl", f"task.file={f}", f"task.prompt_template={json.dumps(template)}"])
    assert msg.startswith(f"{P}: task.prompt_template: {message}")
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=f, prompt_template=template), 0)
    assert str(e.value).startswith(f"task.prompt_template: {message}")


def test_a_prompt_template_that_cannot_format_a_row_names_the_key_and_the_row(tmp_path):
    f = _data(tmp_path, GOOD)
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=f, prompt_template="{prompt:d}"), 0)
    assert str(e.value) == (f"task.prompt_template: '{{prompt:d}}' cannot format {f}:1: ValueError: "
                            "Unknown format code 'd' for object of type 'str'")
    with pytest.raises(JetrlError, match=r"task.prompt_template: field \{level\} is not in .*:1 \(its fields: "
                                         r"'prompt', 'answer', 'hint'\)"):
        build_task(TaskConfig(name="jsonl", file=f, prompt_template="{level}: {prompt}"), 0)
    task = build_task(TaskConfig(name="jsonl", file=f, prompt_template="{hint}: {prompt} {{ok}}"), 0)
    assert task.split["train"][0].prompt.startswith("add: ") and task.split["train"][0].prompt.endswith(" {ok}")


def test_task_file_that_is_a_directory_or_missing_names_the_key_and_the_preset(tmp_path):
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=str(tmp_path)), 0)
    assert str(e.value) == f"task.file: {tmp_path}: is a directory, not a dataset file (one JSON object per line)"
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=str(tmp_path / "no.jsonl")), 0, source=P)
    assert str(e.value) == f"{P}: task.file: {tmp_path / 'no.jsonl'}: no such dataset file"
    with pytest.raises(JetrlError) as e:
        build_task(TaskConfig(name="jsonl", file=_data(tmp_path, GOOD), eval_file=str(tmp_path)), 0)
    assert str(e.value).startswith(f"task.eval_file: {tmp_path}: is a directory")
    assert refused(["task.name=jsonl"]) == (f"{P}: task.file: required for task.name: jsonl (the training data: "
                                            "one JSON object per line, or Parquet; a list of such files)")


@pytest.mark.parametrize("cmd, key, backend, allowed", [
    ("rollout", "precision.rollout.linear", "triton", "auto, emulated"),
    ("run", "precision.train.wgrad", "scaled_mm", "auto, emulated"),
])
def test_a_backend_that_cannot_run_a_gemm_here_names_its_key_before_the_run(tmp_path, monkeypatch, cmd, key,
                                                                           backend, allowed):
    """A preset naming a GEMM backend this device lacks (Triton's kernels or blockwise ``scaled_mm`` on
    a CPU) is refused before anything runs, with the preset key and the backends that can run it here:
    it used to surface at the GEMM's first call as "the fprop GEMM ...", without the key."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    preset = "fp8-rollout" if cmd == "rollout" else "fp8-unified"
    out = tmp_path / ("r.jsonl" if cmd == "rollout" else "run")
    msg = one_line_error(invoke(cmd, preset, "-o", out, *sets(SMALL + [f"{key}.backend={backend}"])))
    assert msg.startswith(f"error: {key}.backend: {backend} cannot run ") and f"(allowed here: {allowed})" in msg
    assert not out.exists()


# ----------------------------------------------------------------------------- 7. keys the chosen setting does not read


@pytest.mark.parametrize("preset, key_value, message", [
    ("bf16", 'task.prompt_template="Solve: {prompt}"', "task.prompt_template: read only by task.name: jsonl "
     "(this task is 'arith')"),
    ("bf16", "task.prompt_key=question", "task.prompt_key: read only by task.name: jsonl (this task is 'arith')"),
    ("bf16", "task.answer_key=solution", "task.answer_key: read only by task.name: jsonl (this task is 'arith')"),
    ("bf16", "task.eval_fraction=0.2", "task.eval_fraction: read only by task.name: jsonl (this task is 'arith')"),
    ("bf16", "task.eval_file=test.jsonl", "task.eval_file: read only by task.name: jsonl (this task is 'arith')"),
    ("gpu-qwen2.5-1.5b-gsm8k-fp8-unified", "task.eval_fraction=0.2", "task.eval_fraction: not read when "
     "task.eval_file is set (that file is the held-out split"),
    ("bf16", "rollout.vllm_dtype=bfloat16", "rollout.vllm_dtype: read only by rollout.backend: vllm (this one is "
     "'embedded')"),
    ("bf16", "rollout.vllm_gpu_memory_utilization=0.5", "rollout.vllm_gpu_memory_utilization: read only by "
     "rollout.backend: vllm"),
    ("bf16", "rollout.vllm_enforce_eager=true", "rollout.vllm_enforce_eager: read only by rollout.backend: vllm"),
    ("fp8-unified-vllm", "rollout.cuda_graphs=false", "rollout.cuda_graphs: read only by rollout.backend: embedded "
     "(this one is 'vllm', whose CUDA graphs rollout.vllm_enforce_eager turns off)"),
    ("bf16", "correction.mis_level=sequence", "correction.mis_level: applies to correction.type mis (this one is "
     "'none')"),
    ("fp8-rollout-tis", "correction.mis_level=token", "correction.mis_level: applies to correction.type mis (this "
     "one is 'tis')"),
    ("bf16", "correction.tis_level=token", "correction.tis_level: applies to correction.type tis or acr (this one "
     "is 'none')"),
    ("bf16", "train.dynamic_sampling_rounds=5", "train.dynamic_sampling_rounds: read only with "
     "train.dynamic_sampling: true"),
    ("bf16", "train.min_lr_ratio=0.1", "train.min_lr_ratio: read only by train.lr_schedule: cosine (this one is "
     "'constant')"),
    ("bf16", "train.kl_estimator=k1", "train.kl_estimator: read only with train.kl_coef > 0 (it is 0: no KL penalty)"),
    ("bf16", "task.overlong_penalty=0.5", "task.overlong_penalty: read only with task.overlong_buffer > 0"),
    ("bf16", "run.wandb_project=mine", "run.wandb_project: read only with wandb in run.loggers"),
])
def test_a_key_the_chosen_setting_does_not_read_is_refused_naming_that_setting(preset, key_value, message):
    """Written by --set or in the preset, a key that does nothing under the chosen task, backend or correction is
    refused, as ``task.file`` on a built-in task always was: ``prompt_template`` on ``arith`` left the prompt
    ``'96+83='``."""
    msg = refused([key_value], preset)
    assert msg == f"{resolve_preset_path(preset)}: {message}" or msg.startswith(f"{resolve_preset_path(preset)}: "
                                                                                  f"{message}"), msg


def test_a_key_written_in_the_preset_file_is_refused_too_and_the_defaults_never(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("precision: bf16\nrollout:\n  vllm_quantization: fp8\n")
    assert refused([], str(p)) == f"{p}: rollout.vllm_quantization: read only by rollout.backend: vllm (this one is 'embedded')"
    assert load_job_config(str(p), ["rollout.backend=vllm"]).rollout.vllm_quantization == "fp8"
    # the shipped vLLM preset's vllm_quantization is its own: with the embedded engine it is refused, not dropped
    assert refused(["rollout.backend=embedded"], "fp8-unified-vllm").endswith(
        "rollout.vllm_quantization: read only by rollout.backend: vllm (this one is 'embedded')")
    # null is no value; the keys each setting reads are accepted with it
    cfg = load_job_config("bf16", ["task.eval_file=null", "rollout.vllm_enforce_eager=null"])
    assert cfg.task.eval_file is None and cfg.rollout.vllm_enforce_eager is None
    cfg = load_job_config("bf16", ["task.name=jsonl", "task.file=d.jsonl", "task.prompt_key=q", "task.eval_fraction=0.2",
                                   'task.prompt_template="Q: {prompt}"', "rollout.backend=vllm",
                                   "rollout.vllm_dtype=bfloat16", "correction.type=mis", "correction.mis_level=sequence"])
    assert (cfg.task.prompt_key, cfg.rollout.vllm_dtype, cfg.correction.mis_level) == ("q", "bfloat16", "sequence")
    # the TIS cap and the MIS band are read under every correction: the thresholds of frac_above_tis_cap and
    # frac_outside_mis (metrics.jsonl, mismatch-report)
    cfg = load_job_config("bf16", ["correction.tis_cap=1.5", "correction.mis_low=0.8", "correction.mis_high=1.2"])
    assert (cfg.correction.type, cfg.correction.tis_cap, cfg.correction.mis_low) == ("none", 1.5, 0.8)
