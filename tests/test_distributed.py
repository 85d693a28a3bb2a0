"""`jetrl run` on torchrun (gloo, CPU): sharded runs reproduce the single-process run bit for bit,
survive `kill -9` of a rank, and resume across world sizes.

The runs use one micro-batch per rank and mini-batch (4 prompts x 4 samples, 2 ranks, micro_batch
8): then the sharded gradient is the single-process gradient summed in the same order (see
jetrl_cli/distributed/sharding.py), and every metric, sample and weight must come out equal.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.config import load_job_config
from jetrl_cli.errors import JetrlError
from jetrl_cli.distributed.launch import torchrun_command
from jetrl_cli.distributed.world import shard_range
from jetrl_cli.rl.loop import ENVIRONMENT_KEYS, run

SMALL = ["train.steps=5", "rollout.prompts_per_step=4", "rollout.n=4", "train.micro_batch=8", "eval.prompts=8",
         "eval.every=2", "run.checkpoint_every=2"]
LIMIT = 480  # seconds for one torchrun job on a busy 2-core machine


def sets(items):
    return [x for it in items for x in ("--set", it)]


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", **extra)  # one thread per rank: ranks share the cores
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(v, None)
    return e


def _ok(cmd, extra_env=None):
    res = subprocess.run(cmd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=LIMIT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def jetrl(*args, extra_env=None):
    return _ok([sys.executable, "-m", "jetrl_cli", *map(str, args)], extra_env)


def torchrun(nproc, *run_args, background=False):
    cmd = torchrun_command(nproc, [str(a) for a in run_args])
    if background:
        return subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _ok(cmd)


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in ENVIRONMENT_KEYS} for m in rows]


def samples(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain single-process run (fp8-unified), in this process."""
    out = tmp_path_factory.mktemp("single") / "run"
    run(load_job_config("fp8-unified", SMALL), out)
    return out


# ---------------------------------------------------------------------------------- fast


def test_shard_range_splits_contiguously_and_evenly():
    for n in range(0, 23):
        for size in range(1, 6):
            parts = [shard_range(n, r, size) for r in range(size)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_nproc_is_checked_and_not_nested(tmp_path, monkeypatch):
    runner = CliRunner()
    res = runner.invoke(app, ["run", "bf16", "-o", str(tmp_path / "r"), "--nproc", "0"])
    assert res.exit_code == 2 and "--nproc must be > 0" in res.output
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    res = runner.invoke(app, ["run", "bf16", "-o", str(tmp_path / "r"), "--nproc", "2"])
    assert res.exit_code == 2 and "already runs under torchrun" in res.output
    assert not (tmp_path / "r").exists()
    cmd = torchrun_command(2, ["bf16", "-o", "x"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert cmd[-5:] == ["jetrl_cli", "run", "bf16", "-o", "x"]


TORCHRUN_RANK_1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
TINY = ["train.steps=1", "rollout.prompts_per_step=2", "rollout.n=2", "eval.prompts=2", "rollout.max_new_tokens=8"]


def test_a_signal_to_the_launcher_is_one_line(monkeypatch, capsys):
    """SIGTERM to `jetrl run --nproc` (a timeout, scancel, docker stop): torch's agent stops the ranks and
    raises SignalException, which was a 120-line traceback."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api

    from jetrl_cli.distributed.launch import launch

    def launched(config, entrypoint):
        def start(*args):
            raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
        return start

    monkeypatch.setattr(api, "elastic_launch", launched)
    assert launch(2, ["bf16"]) == 143
    assert capsys.readouterr().err == ("error: jetrl run --nproc got signal 15; its ranks were stopped, the last "
                                       "complete checkpoint is kept (--resume continues from it)\n")


def test_only_run_is_distributed(tmp_path, monkeypatch):
    """Under torchrun every other command would run once per rank (N copies racing on one output)."""
    for k, v in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(k, v)
    runner = CliRunner()
    for args in (["train", "bf16", "--rollouts", "r.jsonl"], ["rollout", "bf16"], ["mismatch-report", "bf16"],
                 ["bench", "gemm"], ["quantize", "tiny", "-o", str(tmp_path / "q")], ["flow", "bf16"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and res.output == (f"error: rank 1: jetrl {args[0]} does not run under torchrun "
                                                     f"(WORLD_SIZE=2): only jetrl run is distributed; run jetrl "
                                                     f"{args[0]} as one process\n"), res.output
    assert not (tmp_path / "q").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process under torchrun: nothing to race
    assert runner.invoke(app, ["flow", "bf16", "--json"]).exit_code == 0


def test_run_errors_under_torchrun_name_the_rank_and_vllm_is_refused(tmp_path, monkeypatch):
    """Every rank prints its own error, rank N (N > 0) prefixed, World.from_env's included; vLLM as the
    per-rank engine is refused before a process group is joined (unrun: it would need vLLM's
    external_launcher executor); JETRL_DIST_TIMEOUT is checked."""
    import torch

    from jetrl_cli.engine.vllm_engine import VLLMEngine

    runner = CliRunner()
    out = tmp_path / "r"
    res = runner.invoke(app, ["run", "bf16", "-o", out, "--nproc", "2", *sets(TINY + ["rollout.backend=vllm"])])
    assert res.exit_code == 2 and res.output.startswith("error: rollout.backend: vllm does not run under torchrun")
    for k, v in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(k, v)
    res = runner.invoke(app, ["run", "bf16", "-o", out, *sets(TINY + ["rollout.backend=vllm"])])
    assert res.exit_code == 2 and res.output.startswith("error: rank 1: rollout.backend: vllm does not run under")
    monkeypatch.setenv("JETRL_DIST_TIMEOUT", "soon")
    res = runner.invoke(app, ["run", "bf16", "-o", out, *sets(TINY)])
    assert res.exit_code == 2 and res.output == ("error: rank 1: JETRL_DIST_TIMEOUT='soon': must be a number of "
                                                 "seconds > 0 (default 600)\n")
    monkeypatch.setenv("RANK", "one")
    res = runner.invoke(app, ["run", "bf16", "-o", out, *sets(TINY)])
    assert res.exit_code == 2 and res.output == "error: RANK='one' (set by torchrun): must be an integer >= 0\n"
    assert not out.exists()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # a library caller's process group
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(JetrlError, match="rollout.backend: vllm does not run under torchrun yet"):
        VLLMEngine("no-model", None, 16)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 1)  # vLLM's own group, in one process
    with pytest.raises(Exception) as e:  # past that check: what comes next (vLLM missing, or the flow None)
        VLLMEngine("no-model", None, 16)
    assert "torchrun" not in str(e.value)


def test_ranks_that_start_different_runs_are_refused_naming_the_first_difference(tmp_path, monkeypatch):
    """A rank started with another preset value, model or data would attach its samples to the other
    ranks' prompts and train one model on them, silently: start-up compares them, key by key."""
    from jetrl_cli.cli import _SAME_RUN, _run_identity
    from jetrl_cli.distributed.world import World, file_digest
    from jetrl_cli.rl import loop

    model = tmp_path / "m"
    shutil.copytree(loop.tiny_policy_dir(), model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    cfg = TINY + [f"model.path={model}", "task.name=jsonl", f"task.file={data}"]
    out = tmp_path / "r"
    mine = _run_identity(load_job_config("bf16", cfg), out, False, False)
    gathered = {}
    monkeypatch.setattr(World, "all_gather_object", lambda self, obj: [mine, obj, gathered.get(2, mine)])
    world = World(rank=1, size=3, distributed=True)
    world.check_same(mine, _SAME_RUN)

    def refused(other):
        with pytest.raises(JetrlError) as e:
            world.check_same(other, _SAME_RUN)
        return str(e.value)

    seeded = _run_identity(load_job_config("bf16", cfg + ["run.seed=1"]), out, False, False)
    assert refused(seeded) == f"the ranks disagree on run.seed (rank 0: 0; rank 1: 1); {_SAME_RUN}"
    assert refused(_run_identity(load_job_config("bf16", cfg), out, True, False)).startswith(
        "the ranks disagree on --resume (rank 0: False; rank 1: True)")
    gathered[2] = seeded  # the ranks that differ from rank 0, all of them
    assert refused(seeded).startswith("the ranks disagree on run.seed (rank 0: 0; rank 1: 1, rank 2: 1)")
    del gathered[2]
    weights = model / "model.safetensors"
    b = bytearray(weights.read_bytes())
    b[-1] ^= 1  # the same size, the same header, one weight's last bit
    weights.write_bytes(bytes(b))
    assert refused(_run_identity(load_job_config("bf16", cfg), out, False, False)).startswith(
        "the ranks disagree on model.path/model.safetensors (rank 0: '")
    with data.open("a") as f:
        f.write(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    b[-1] ^= 1
    weights.write_bytes(bytes(b))
    assert refused(_run_identity(load_job_config("bf16", cfg), out, False, False)).startswith(
        "the ranks disagree on task.file's contents")
    # a large file: its size, head and tail (a safetensors header and the weights on either side)
    big = file_digest(weights, whole_below=0, sample=64)
    b[-1] ^= 1
    weights.write_bytes(bytes(b))
    assert file_digest(weights, whole_below=0, sample=64) != big


# ---------------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_two_ranks_reproduce_the_single_process_run(tmp_path, reference):
    """The issue's CI target: 2 gloo processes, 5 steps, the same rewards and rollout tokens, losses
    within 1e-6 and mismatch_kl exactly 0 (fp8-unified); in fact every number and weight is equal."""
    out = tmp_path / "two"
    res = jetrl("run", "fp8-unified", "--nproc", 2, "-o", out, *sets(SMALL))
    assert res.stdout.count("step 5 ") + res.stderr.count("step 5 ") == 1  # rank 0 alone prints
    ref, got = metrics(reference), metrics(out)
    assert [m["step"] for m in got] == [0, 1, 2, 3, 4, 5]
    ref_s, got_s = samples(reference), samples(out)
    assert [(s["group"], s["tokens"], s["reward"]) for s in got_s] == [(s["group"], s["tokens"], s["reward"])
                                                                      for s in ref_s]
    for r, g in zip(ref[1:], got[1:]):
        assert g["reward_mean"] == r["reward_mean"]
        assert abs(g["loss"] - r["loss"]) <= 1e-6
        assert g["mismatch_kl"] == 0.0
    assert got == ref and got_s == ref_s  # stronger than asked: bit for bit
    ck = out / "checkpoints" / "step_000005"
    assert (ck / "dcp" / ".metadata").exists()
    assert (ck / "model.safetensors").read_bytes() == (reference / "checkpoints" / "step_000005" / "model.safetensors").read_bytes()
    assert (out / "curves.png").exists()


@pytest.mark.slow
def test_two_ranks_reproduce_the_single_process_lora_run(tmp_path):
    """LoRA under torchrun: the frozen base and the adapters sharded together, the adapters gathered whole
    for each sync, the base model (the adapters off) as the KL reference; metrics, samples and the
    checkpoint's merged model and PEFT adapters equal the single-process run's bit for bit, and a
    single-process LoRA checkpoint resumed on two ranks continues as the uninterrupted run."""
    lora = SMALL + ["train.steps=3", "model.lora_rank=8", "train.lr=1e-3", "train.kl_coef=0.01"]
    single, two = tmp_path / "single", tmp_path / "two"
    run(load_job_config("fp8-unified", lora), single)
    jetrl("run", "fp8-unified", "--nproc", 2, "-o", two, *sets(lora))
    assert metrics(two) == metrics(single) and samples(two) == samples(single)
    assert all(m["mismatch_kl"] == 0.0 and m["kl_ref"] > 0 for m in metrics(two)[2:])
    assert all(m["sync_bytes"] < 400_000 for m in metrics(two)[1:])  # the adapters alone, gathered whole
    for name in ("model.safetensors", "adapter_model.safetensors"):
        got = (two / "checkpoints" / "step_000003" / name).read_bytes()
        assert got == (single / "checkpoints" / "step_000003" / name).read_bytes(), name
    part = tmp_path / "part"  # a single-process LoRA checkpoint (step 2) resumed on two ranks
    run(load_job_config("fp8-unified", lora), part, stop_after=2)
    jetrl("run", "fp8-unified", "--nproc", 2, "-o", part, "--resume", *sets(lora))
    assert metrics(part) == metrics(single) and samples(part) == samples(single)


@pytest.mark.slow
def test_micro_batches_by_token_budget_on_two_ranks(tmp_path):
    """``train.micro_batch_tokens`` under torchrun: each rank packs its share by the budget (the ranks' counts
    differ: the one with fewer runs masked forwards, so every collective is matched); step 1, before any
    update, equals the single-process run, and every step stays on-policy."""
    budget = SMALL + ["train.steps=2", "train.micro_batch_tokens=100", "train.kl_coef=0.01"]
    single, two = tmp_path / "single", tmp_path / "two"
    run(load_job_config("fp8-unified", budget), single)
    jetrl("run", "fp8-unified", "--nproc", 2, "-o", two, *sets(budget))
    got, ref = metrics(two), metrics(single)
    assert [m["step"] for m in got] == [0, 1, 2] and all(m["mismatch_kl"] == 0.0 for m in got[1:])
    assert got[1]["reward_mean"] == ref[1]["reward_mean"] and got[1]["loss"] == pytest.approx(ref[1]["loss"], abs=1e-6)


@pytest.mark.slow
def test_kill_one_rank_then_resume_on_two_ranks_or_one_process(tmp_path, reference):
    """kill -9 of rank 1 mid-run; --resume (2 ranks, and the plain run: another world size) gives
    the uninterrupted run's metrics and samples."""
    out = tmp_path / "killed"
    job = torchrun(2, "fp8-unified", "-o", out, *sets(SMALL), background=True)
    try:
        t0 = time.time()
        while '"step": 3' not in ((out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""):
            assert job.poll() is None and time.time() - t0 < LIMIT, "the run ended before step 3"
            time.sleep(0.1)
        children = [int(c) for f in Path(f"/proc/{job.pid}/task").glob("*/children") for c in f.read_text().split()]
        rank1 = [c for c in children if b"RANK=1" in Path(f"/proc/{c}/environ").read_bytes().split(b"\0")]
        assert len(rank1) == 1, children
        os.kill(rank1[0], 9)
        assert job.wait(timeout=LIMIT) != 0
    finally:
        if job.poll() is None:
            job.kill()
    assert len(metrics(out)) < 6 and (out / "latest").exists()
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    torchrun(2, "fp8-unified", "-o", out, "--resume", *sets(SMALL))
    assert metrics(out) == metrics(reference) and samples(out) == samples(reference)
    run(load_job_config("fp8-unified", SMALL), plain, resume=True)  # DCP checkpoint, no process group
    assert metrics(plain) == metrics(reference) and samples(plain) == samples(reference)


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_one_torchrun_rank(tmp_path, reference):
    """A plain run's checkpoint (full optimizer state) resumed through torchrun --nproc 1 (FSDP over
    one rank, DCP checkpoints from then on) continues exactly as the plain run."""
    out = tmp_path / "r"
    run(load_job_config("fp8-unified", SMALL), out, stop_after=3)
    assert (out / "latest").read_text().strip() == "step_000002"
    jetrl("run", "fp8-unified", "--nproc", 1, "-o", out, "--resume", *sets(SMALL))
    assert metrics(out) == metrics(reference) and samples(out) == samples(reference)
    state = __import__("torch").load(out / "checkpoints" / "step_000005" / "trainer_state.pt", weights_only=False)
    assert state["sharded_state"] == "dcp" and state["world_size"] == 1


UNEVEN = ["train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4", "train.micro_batch=4", "train.minibatches=2",
          "train.kl_coef=0.01", "train.dynamic_sampling=true", "train.loss_agg=seq-mean-token-mean", "eval.prompts=4",
          "eval.every=0", "run.checkpoint_every=0", "train.entropy_coef=0.01",
          "train.adv_estimator=reinforce_plus_plus_baseline"]


@pytest.mark.slow
def test_three_ranks_uneven_shares_match_with_the_fixed_order_reduction(tmp_path):
    """3 ranks: 2/1/1 groups per rank, a mini-batch where one rank has no group (it runs a masked
    micro-batch), a sharded reference model (kl_coef), dynamic sampling, an off-policy flow with
    TIS, GRPO's per-sequence loss (each rank's sequences over the mini-batch's count), an entropy
    bonus (its gradient through the sharded lm_head) and REINFORCE++'s batch-whitened advantages.
    The fixed-order reduction gives the single-process numbers exactly; FSDP's own
    reduce-scatter (JETRL_EXACT_REDUCTION=0, the GPU default) only up to rounding."""
    single, exact, native = tmp_path / "single", tmp_path / "exact", tmp_path / "native"
    run(load_job_config("fp8-rollout-tis", UNEVEN), single)
    jetrl("run", "fp8-rollout-tis", "--nproc", 3, "-o", exact, *sets(UNEVEN))
    assert metrics(exact) == metrics(single) and samples(exact) == samples(single)
    jetrl("run", "fp8-rollout-tis", "--nproc", 3, "-o", native, *sets(UNEVEN), extra_env={"JETRL_EXACT_REDUCTION": "0"})
    for r, g in zip(metrics(single)[1:], metrics(native)[1:]):
        assert set(g) == set(r)
        for k in r:
            assert g[k] == pytest.approx(r[k], rel=1e-5, abs=1e-6), k
    first = [s["tokens"] for s in samples(single) if s["step"] == 1]
    assert [s["tokens"] for s in samples(native) if s["step"] == 1] == first  # same weights at step 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_started_with_different_seeds_refuse_to_run(tmp_path):
    """Two torchrun agents (two "nodes" of one rank each) whose presets differ in run.seed: both ranks
    stop at start-up with one line naming the key (they used to train on each other's samples, exit 0)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=seeds",
                               "-m", "jetrl_cli", "run", "fp8-unified", "-o", str(tmp_path / "r"),
                               *sets(SMALL + [f"run.seed={seed}"])],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=LIMIT)
        assert p.returncode != 0
        assert "the ranks disagree on run.seed (rank 0: " in err and "every rank must start the same run" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_stuck_rank_fails_the_others_after_jetrl_dist_timeout(tmp_path):
    """A rank that hangs (here in its reward function) no longer leaves the others waiting 30 minutes in
    a gloo collective: after JETRL_DIST_TIMEOUT seconds rank 0 stops with one line."""
    (tmp_path / "hang_rank1.py").write_text(
        "import os, time\n\n\ndef reward(prompt, completion, answer):\n"
        "    if os.environ.get('RANK') == '1':\n        time.sleep(3600)\n    return 0.0\n")
    cmd = [sys.executable, "-m", "jetrl_cli", "run", "fp8-unified", "--nproc", "2", "-o", str(tmp_path / "r"),
           *sets(SMALL + ["task.reward=hang_rank1:reward", "eval.every=0"])]
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env(JETRL_DIST_TIMEOUT="20", PYTHONPATH=str(tmp_path)), capture_output=True,
                         text=True, timeout=LIMIT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert ("error: the other ranks did not answer a collective within 20 s (JETRL_DIST_TIMEOUT): a rank is stuck "
            "or has died") in res.stderr, res.stderr
    assert time.monotonic() - t0 < 300


# ---------------------------------------------------------------------------------- GPU


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)  # two whole runs on a GPU, each compiling its kernels: the H200's 40 s limit cut them
@pytest.mark.parametrize("exact", ["0", "1"])
def test_one_nccl_rank_reproduces_the_plain_gpu_run(tmp_path, exact):
    """Issue 17's GPU target: ``jetrl run --nproc 1`` on a GPU (torchrun, NCCL for CUDA tensors, FSDP2
    over one rank; FSDP's own reduce-scatter and sharded norm by default, ``JETRL_EXACT_REDUCTION=1``
    the fixed-order sum) against the plain run on the same GPU with the same seed: the same rollout
    tokens and rewards, and every metric equal (one rank's reduce-scatter is its own gradient)."""
    cfg = ["model.device=cuda", "train.steps=3", "rollout.prompts_per_step=4", "rollout.n=4",
           "train.micro_batch=8", "eval.every=0", "run.checkpoint_every=0"]
    plain, ranked = tmp_path / "plain", tmp_path / "ranked"
    jetrl("run", "fp8-unified", "-o", plain, *sets(cfg))
    jetrl("run", "fp8-unified", "--nproc", 1, "-o", ranked, *sets(cfg), extra_env={"JETRL_EXACT_REDUCTION": exact})
    ref, got = metrics(plain), metrics(ranked)
    assert [m["step"] for m in got] == [m["step"] for m in ref] and len(ref) == 4
    picked = [(s["step"], s["group"], s["tokens"], s["reward"]) for s in samples(ranked)]
    want = [(s["step"], s["group"], s["tokens"], s["reward"]) for s in samples(plain)]
    if exact == "1":  # the fixed-order sum and the whole-gradient norm: the plain run's numbers
        assert picked == want and got == ref
        return
    # FSDP's sharded gradient norm may sum in another order: the first step (same weights, same
    # seeds) samples the same tokens; its loss and gradient norm agree to float rounding
    first = min(s[0] for s in want)
    assert [s for s in picked if s[0] == first] == [s for s in want if s[0] == first]
    for key in ("loss", "grad_norm", "reward_mean", "mismatch_kl"):
        a, b = got[1][key], ref[1][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (key, a, b)
