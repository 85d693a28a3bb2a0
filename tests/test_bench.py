"""`jetrl bench`: every mode at a tiny size on CPU gives well-formed JSON; accuracy columns are real."""

import json
import time

import pytest
import torch
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.errors import JetrlError
from jetrl_cli.precision import gemm as gemm_mod
from jetrl_cli.precision.flow import GemmSpec
from jetrl_cli.precision.quant import CastSpec

from .conftest import fresh_seed

runner = CliRunner()
FAST = ["--repeats", "1", "--warmup", "0", "--json", "--no-history"]
# Where the Triton kernels run: a GPU machine's GPU, else CPU tensors in Triton's interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 there). A CPU bench on a GPU machine has no interpreter:
# its Triton rows are skipped, so the tests about them bench on the GPU there.
TRITON_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def bench(*args, device="cpu"):
    res = runner.invoke(app, ["bench", *[str(a) for a in args], "--device", device], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert {"date", "jetrl", "torch", "device", "threads"} <= set(out["env"]) and out["env"]["device"] == device
    return out


def test_gemm_rows_carry_time_and_accuracy():
    out = bench("gemm", "--shapes", "16x256x256,8x384x128", *FAST)
    every = out["results"]["gemm"]
    rows = [r for r in every if "skipped" not in r]
    # what cannot run here is listed with the reason, not dropped: blockwise scaled_mm is GPU-only, and
    # row-wise fp8 runs on CPU only where this torch's CPU scaled_mm takes row-wise scales (2.13 does, 2.11 not)
    skipped = {(r["variant"], r["backend"]): r["skipped"] for r in every if "skipped" in r}
    row_spec = CastSpec("fp8_e4m3", "row")
    fp8_row_why = gemm_mod.get_backend("scaled_mm").unsupported(GemmSpec(row_spec, row_spec), "fprop", torch.device("cpu"))
    expected = {"bf16 (emulated)", "fp8 1x128 x 128x128", "int8 row"} | ({"fp8 row"} if fp8_row_why is None else set())
    assert {r["variant"] for r in rows} >= expected
    if fp8_row_why is not None:
        assert skipped[("fp8 row", "scaled_mm")] == fp8_row_why
    assert "runs on CUDA GPUs only" in skipped[("fp8 1x128 x 128x128", "scaled_mm")]
    assert "runs on CUDA GPUs only" in skipped[("fp8 1x128 x 1x128 (wgrad)", "scaled_mm")]
    for r in rows:
        assert {"shape", "M", "N", "K", "backend", "s", "spread_s", "tflops", "vs_bf16", "rel_err", "sqnr_db",
                "kernel_rel_err", "accuracy_ok", "emulated"} <= set(r)
        assert r["s"] > 0 and r["tflops"] > 0 and r["accuracy_ok"] and r["emulated"]
        assert r["tflops"] == pytest.approx(2 * r["M"] * r["N"] * r["K"] / r["s"] / 1e12)
    by = {(r["shape"], r["variant"]): r for r in rows}
    # quantization error is what the formats predict: fp8 e4m3 ~ 3 mantissa bits, int8 / bf16 finer
    fp8 = by[("16x256x256", "fp8 1x128 x 128x128")]["sqnr_db"]
    assert 20 < fp8 < 40
    assert by[("16x256x256", "int8 row")]["sqnr_db"] > fp8 and by[("16x256x256", "bf16 (emulated)")]["sqnr_db"] > 45


def test_a_broken_backend_is_caught(monkeypatch):
    class Broken(gemm_mod.EmulatedBackend):
        name = "scaled_mm"

        def mm(self, a, b, out):  # right shape, plausible values, 2% off
            return super().mm(a, b, out) * 1.02

    monkeypatch.setitem(gemm_mod._BACKENDS, "scaled_mm", Broken())
    rows = [r for r in bench("gemm", "--shapes", "16x256x256", *FAST)["results"]["gemm"] if "skipped" not in r]
    broken = [r for r in rows if r["backend"] == "scaled_mm"]
    assert broken and all(not r["accuracy_ok"] and r["kernel_rel_err"] > 0.015 for r in broken)
    assert all(r["accuracy_ok"] for r in rows if r["backend"] != "scaled_mm")


@pytest.mark.slow  # 11 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_quantize_rows_against_copy():
    from .triton_interp_fix import fixed_fp8_conversion

    with fixed_fp8_conversion():  # Triton rows (interpreter on CPU) need the test-only cast fix
        rows = bench("quantize", "--shapes", "132x256", *FAST)["results"]["quantize"]
    assert rows[0]["quantizer"] == "copy (ceiling)" and rows[0]["vs_copy"] == 1.0
    ref = [r for r in rows if r.get("backend") == "torch (reference)"]
    assert len(ref) == 6
    transposes = [r for r in rows if r.get("kind") == "transpose"]  # W^T's bytes: kernel (3 orders), torch's copy
    assert [r["backend"] for r in transposes] == (["triton", "triton-n-first", "triton-diagonal", "torch"]
                                                  if any(r.get("backend") == "triton" for r in rows) else [])
    for r in transposes:
        assert r["matches_reference"] and r["bytes"] == 2 * 132 * 256
    wt = [r for r in rows if r.get("kind") == "W^T"]  # a weight with W^T: transposed after the quantizer, or by it
    assert [r["backend"] for r in wt] == (["after", "quantizer"] if transposes else [])
    assert all(r["matches_reference"] and r["bytes"] > 132 * 256 * (4 + 2) for r in wt)  # fp32 in; W, W^T out
    for r in (r for r in rows[1:] if r.get("kind") != "transpose"):
        assert r["gb_per_s"] > 0 and r["vs_copy"] > 0 and r["sqnr_db"] > 20
        assert r["bytes"] > 130 * 256 * 4  # read the fp32 input, write data + scales
        assert r["matches_reference"] is not False
    tri = [r for r in rows if r.get("backend") == "triton"]
    if tri:  # a GPU, or TRITON_INTERPRET=1 (tests/conftest.py on CPU)
        assert {r["quantizer"] for r in tri} >= {"fp8 1x128 (activations)", "fp8 128x128 (weights)",
                                                 "fp8 1x128 + 128x1 fused", "fp8 1x128 + 128x1 as two kernels",
                                                 "fp8 SwiGLU backward (d[g,u] 1x128 + 128x1, h^T)",
                                                 "fp8 SwiGLU backward (d[g,u] 1x128 + 128x1, h^T) as two kernels"}
        assert all(r["matches_reference"] for r in tri if r["matches_reference"] is not None)


@pytest.mark.slow  # 25 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_quantize_times_the_tile_kernels_at_each_warp_count():
    """``--warps 8,16``: every 128x128-tile Triton row once per warp count (the same bits), the table
    naming them; the target takes each kernel at its faster setting."""
    import os

    from jetrl_cli.bench import targets

    from .triton_interp_fix import fixed_fp8_conversion

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or Triton's interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels in the interpreter
    with fixed_fp8_conversion():
        res = runner.invoke(app, ["bench", "quantize", "--shapes", "130x256", "--warps", "8,16", "--repeats", "1",
                                  "--warmup", "0", "--no-history", "--device", device])
    assert res.exit_code == 0, res.output
    assert "16 warps" in res.stdout and "8 warps" in res.stdout  # the rows say which
    with fixed_fp8_conversion():
        rows = bench("quantize", "--shapes", "132x256", "--warps", "8,16", *FAST, device=device)["results"]["quantize"]
    tri = [r for r in rows if r.get("backend") == "triton" and r.get("kind") != "transpose"]
    assert sorted({r["warps"] for r in tri if "warps" in r}) == [8, 16]
    by_kernel = {}
    for r in tri:
        by_kernel.setdefault(r["quantizer"], []).append(r)
        assert r["matches_reference"] is not False
    int8 = by_kernel["int8 row"]  # one kernel with its own warps: one row, no warps
    assert len(int8) == 1 and "warps" not in int8[0]
    for name, v in by_kernel.items():  # each 128x128-tile kernel once per warp count
        if name != "int8 row":
            assert sorted(r["warps"] for r in v) == [8, 16] and all("store" not in r for r in v), name
    worst = [t for t in targets({"quantize": rows}, "cuda") if t["target"].startswith("every Triton quantizer")][0]
    # on a GPU every row is also replayed from a CUDA graph, and the target takes that ratio
    key = "graph_vs_copy" if all("graph_vs_copy" in r for r in tri) else "vs_copy"
    assert (key == "graph_vs_copy") == torch.cuda.is_available()
    assert worst["value"] == min(max(r[key] for r in v) for v in by_kernel.values())


def test_quantizer_target_takes_the_kernels_replayed_time_where_every_row_has_it():
    """On a GPU each Triton quantizer row is also timed replayed from a CUDA graph (``graph_vs_copy``,
    against the copy replayed the same way): the kernels without the host's launches, which the
    back-to-back ``vs_copy`` includes. The target takes the replayed ratio when every row has one (and
    says so), each kernel at its best warps; else the back-to-back ratio."""
    from jetrl_cli.bench import targets

    rows = [{"shape": "8192x8192", "quantizer": "copy (ceiling)", "vs_copy": 1.0, "graph_vs_copy": 1.0},
            {"shape": "8192x8192", "quantizer": "fp8 1x128", "backend": "triton", "warps": 8, "vs_copy": 0.4,
             "graph_vs_copy": 0.85},
            {"shape": "8192x8192", "quantizer": "fp8 1x128", "backend": "triton", "warps": 16, "vs_copy": 0.5,
             "graph_vs_copy": 0.82},
            {"shape": "8192x8192", "quantizer": "fp8 128x128", "backend": "triton", "warps": 8, "vs_copy": 0.3,
             "graph_vs_copy": 0.81},
            {"shape": "8192x8192", "quantizer": "fp8 weight bytes transposed (W^T)", "backend": "triton",
             "kind": "transpose", "vs_copy": 0.1, "graph_vs_copy": 0.1}]

    def quantizer_target(rs):
        (t,) = [t for t in targets({"quantize": rs}, "cuda") if t["target"].startswith("every Triton quantizer")]
        return t

    t = quantizer_target(rows)
    assert t["value"] == 0.81 and t["met"] and "replayed from a CUDA graph" in t["target"]
    del rows[3]["graph_vs_copy"]  # one row that could not be captured: every row's back-to-back time
    t = quantizer_target(rows)
    assert t["value"] == 0.3 and not t["met"] and "replayed" not in t["target"]


def test_quantize_catches_a_wrong_triton_quantizer():
    """Without the interpreter fix the Triton casts round wrongly: the bench says so."""
    import os

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("about Triton's interpreter")
    rows = bench("quantize", "--shapes", "128x256", *FAST)["results"]["quantize"]
    tri = [r for r in rows if r.get("backend") == "triton" and r["matches_reference"] is not None]
    assert tri and not all(r["matches_reference"] for r in tri)


def test_attention_rows_time_every_decode_attention_with_its_error():
    """One decode step's attention over a bf16 and an FP8 cache; the Triton rows (interpreter on CPU)
    are there when the kernels can run, and each row's error is against float64 attention."""
    import os

    from .triton_interp_fix import fixed_fp8_conversion

    with fixed_fp8_conversion():  # the interpreter's fp32 -> fp8 cast (kv_store) needs the test-only fix
        out = bench("attention", "--shapes", "3x48", *FAST, device=TRITON_DEV)
    stores = [r for r in out["results"]["attention"] if r.get("kind") == "store"]
    rows = [r for r in out["results"]["attention"] if "skipped" not in r and r.get("kind") != "store"]
    assert [r["variant"].split(":")[0] for r in stores][:2] == ["bf16", "fp8"]
    assert all(r["s"] > 0 for r in stores)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        assert [r["matches_reference"] for r in stores if "kv_store" in r["variant"]] == [True]
    names = [r["variant"] for r in rows]
    assert names[:2] == ["bf16 cache, SDPA", "fp8 cache, dequantize + SDPA"] and rows[0]["vs_sdpa_bf16"] == 1.0
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        assert set(names) >= {"fp8 cache, read as stored", "bf16 cache, triton", "fp8 cache, batch-invariant",
                              "bf16 cache, batch-invariant"}
    for r in rows:
        assert r["s"] > 0 and r["gb_per_s"] > 0 and r["accuracy_ok"] and 0 < r["rel_err"] < 1e-2, r
        d = r["head_dim"]
        per_value = (d + 4) / d if r["cache"] == "fp8_e4m3" else 2  # FP8 bytes plus one fp32 scale per row
        assert r["kv_bytes"] == pytest.approx(2 * 3 * r["kv_heads"] * 48 * d * per_value)


def test_a_wrong_attention_kernel_is_caught(monkeypatch):
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli.kernels import attention

    right = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: right(*a, **k) * 1.02)
    rows = [r for r in bench("attention", "--shapes", "2x32", *FAST, device=TRITON_DEV)["results"]["attention"]
            if "skipped" not in r and r.get("kind") != "store"]
    assert {r["variant"] for r in rows if not r["accuracy_ok"]} == {"fp8 cache, read as stored", "bf16 cache, triton"}


def test_no_transformers_leaves_out_the_baseline_rows():
    """``--no-transformers``: the engines' rows alone (the baseline's ratios left empty), for a
    process that must not hold transformers beside the engines (see ``docs/benchmarks.md``)."""
    rows = bench("rollout", "--batch", 2, "--new-tokens", 4, "--flows", "bf16", "--no-transformers", *FAST)["results"]["rollout"]
    assert {r["workload"][:4] for r in rows} == {"fixe", "task"} and all(r["engine"] == "jetrl embedded" for r in rows)
    rows = bench("train", "--train-batch", 2, "--seq", 16, "--flows", "bf16", "--no-transformers", *FAST)["results"]["train"]
    assert [r["flow"] for r in rows] == ["bf16"]


@pytest.mark.slow  # 12 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_no_cuda_graphs_reaches_every_engine_the_rollout_bench_builds(monkeypatch):
    """``--no-cuda-graphs``: every embedded engine of ``bench rollout`` (the fixed workload's and the
    task's) is built to decode eagerly; by default with graphs (which only a GPU captures)."""
    from jetrl_cli.engine import embedded

    built = []
    real = embedded.EmbeddedEngine.__init__

    def init(self, *a, cuda_graphs=True, **k):
        built.append(cuda_graphs)
        real(self, *a, cuda_graphs=cuda_graphs, **k)

    monkeypatch.setattr(embedded.EmbeddedEngine, "__init__", init)
    for flag, want in (([], True), (["--no-cuda-graphs"], False)):
        built.clear()
        bench("rollout", "--batch", 2, "--new-tokens", 2, "--flows", "bf16", "--no-transformers", *flag, *FAST)
        assert len(built) == 4 and set(built) == {want}, built  # fp32 and bf16, fixed and task workloads


@pytest.mark.slow  # 15 s on 2 AVX2 cores (the default suite's 15-minute budget); CI runs it with -m slow
def test_rollout_train_and_e2e_modes():
    out_r = bench("rollout", "--batch", 2, "--new-tokens", 4, "--flows", "bf16", *FAST)
    rows = out_r["results"]["rollout"]
    fixed = [r for r in rows if r["workload"] == "fixed"]
    assert [(r["engine"], r["flow"]) for r in fixed] == [
        ("transformers generate()", "fp32"), ("jetrl embedded", "fp32"), ("jetrl embedded", "bf16")]
    task = [r for r in rows if r["workload"].startswith("task")]
    assert [(r["engine"], r["flow"]) for r in task] == [(r["engine"], r["flow"]) for r in fixed]
    assert all(0 < r["tokens"] <= 16 * 8 * 40 for r in task)  # the fp8-unified preset: 16 prompts x 8, <= 40 tokens
    assert all(r["tokens_per_s"] > 0 and r["vs_generate"] > 0 for r in rows)
    for r in (r for r in rows if r["engine"] == "jetrl embedded"):  # what a rollout costs besides tokens/s
        assert r["ttft_s"] > 0 and r["sync_s"] > 0 and r["weight_bytes"] > 0
        # 2 x layers x kv heads x (head_dim x fp32 + a power-of-two scale per token and head: the CPU grid)
        assert r["kv_bytes_per_token"] == 2 * 4 * 2 * (32 * 4 + 4)
    out = bench("train", "--train-batch", 2, "--seq", 16, "--flows", "bf16,fp8-rollout,fp8-unified", *FAST)
    rows = out["results"]["train"]
    # fp8-rollout trains like bf16; the plain-transformers step on the same model and batch is the baseline
    assert [r["flow"] for r in rows] == ["bf16", "fp8-unified", "transformers"]
    bf, u, hf = rows
    assert bf["step_vs_bf16"] == 1.0 and u["s"] > 0 and u["tokens_per_s"] > 0
    assert hf["s"] > 0 and hf["saved_activation_bytes"] > 0 and hf["step_vs_transformers"] == 1.0
    assert bf["step_vs_transformers"] == pytest.approx(bf["s"] / hf["s"])
    assert all(r["model"] == "tiny-policy" and (r["batch"], r["seq"]) == (2, 16) for r in rows)
    # what ran is recorded: the unified flow's FP8 GEMMs on the emulated reference (CPU); bf16 has none
    assert bf["gemm_backends"]["resolved"] == []
    assert {(x["gemm"], x["backend"]) for x in u["gemm_backends"]["resolved"]} == {
        ("fprop", "emulated"), ("dgrad", "emulated"), ("wgrad", "emulated")}
    # the unified flow saves its linear inputs in FP8, the bf16 flow in the activation dtype
    assert 0 < u["saved_activation_bytes"] < bf["saved_activation_bytes"]
    assert any(t["target"].startswith("fp8-unified saved activations") for t in out["targets"])
    out_e = bench("e2e", "--steps", 1, "--flows", "fp8-unified", *FAST)
    rows = out_e["results"]["e2e"]
    r = rows[0]
    assert r["flow"] == "fp8-unified" and r["steps"] == 1
    assert all(r[k] >= 0 for k in ("rollout_s", "score_s", "train_s", "sync_s")) and r["step_s"] > r["rollout_s"]
    # all three modes' tables at 80 columns (what `jetrl bench ... | cat` prints)
    res = {"env": out["env"], "results": {"rollout": out_r["results"]["rollout"], "train": out["results"]["train"],
                                          "e2e": rows}, "targets": out_r["targets"] + out["targets"]}
    assert_readable_at_80_columns(res, [f"{x['tokens_per_s']:.0f}" for x in out_r["results"]["rollout"]]
                                  + [f"{x['s']:.3f}" for x in out["results"]["train"]]
                                  + [f"{x['step_s']:.2f}" for x in rows])


def test_a_train_row_that_runs_out_of_memory_says_so_and_the_bench_goes_on(monkeypatch):
    """A flow whose update (or the transformers baseline) runs out of device memory becomes a row
    saying so; the other rows are measured, the tables print, and the GPU targets judge it."""
    from jetrl_cli import bench as bench_mod
    from jetrl_cli.bench import render, targets
    from jetrl_cli.rl import trainer as trainer_mod

    plain = trainer_mod.Trainer.update

    def update(self, *args, **kwargs):  # the unified flow's micro-batch does not fit
        if self.flow.train.linear.fprop.is_quantized:
            raise trainer_mod._OOM("CUDA out of memory. Tried to allocate 4.64 GiB")
        return plain(self, *args, **kwargs)

    def hf_row(*args, **kwargs):
        raise trainer_mod._OOM("CUDA out of memory. Tried to allocate 9.27 GiB (transformers)")

    monkeypatch.setattr(trainer_mod.Trainer, "update", update)
    monkeypatch.setattr(bench_mod, "_transformers_row", hf_row)
    out = bench("train", "--train-batch", 2, "--seq", 16, "--flows", "bf16,fp8-unified", *FAST)
    rows = out["results"]["train"]
    assert [r["flow"] for r in rows] == ["bf16", "fp8-unified", "transformers"]
    bf, u, hf = rows
    assert bf["s"] > 0 and bf["step_vs_bf16"] == 1.0 and bf["step_vs_transformers"] is None
    assert u == {"flow": "fp8-unified", "model": "tiny-policy", "batch": 2, "micro_batch": 2, "seq": 16,
                 "out_of_memory": "CUDA out of memory. Tried to allocate 4.64 GiB"}
    assert hf["out_of_memory"].endswith("(transformers)") and "s" not in hf
    assert_readable_at_80_columns(out, [f"{bf['s']:.3f}", "out of memory"])
    got = {t["target"]: t for t in targets(out["results"], "cuda")}
    assert got["bf16 train peak memory <= the transformers row's (transformers ran out of memory)"]["met"]
    assert not got["fp8-unified trains 2 x 16 tokens of tiny-policy on this GPU"]["met"]
    assert not any(name.startswith("bf16 trains") for name in got)  # no peak memory measured on CPU
    assert not any("fp8-unified train step" in name for name in got)  # no time to compare
    import io

    from rich.console import Console

    buf = io.StringIO()
    render({**out, "targets": list(got.values())}, Console(file=buf, width=100))
    assert "target missed: fp8-unified trains 2 x 16 tokens" in buf.getvalue()


def test_train_bench_keeps_the_first_layers():
    out = bench("train", "--train-batch", 2, "--seq", 8, "--flows", "bf16", "--layers", 1, *FAST)
    assert {r["model"] for r in out["results"]["train"]} == {"tiny-policy (1 layers)"}
    res = runner.invoke(app, ["bench", "train", "--layers", "9", *FAST])
    assert res.exit_code == 2 and "--layers 9: the model has 4 decoder layers (allowed: 1..4)" in res.output


def test_train_bench_runs_micro_batches():
    """``--micro-batch``: each row runs the update in micro-batches, their gradients accumulated
    (jetrl's trainer, and the transformers baseline the same way); a forward saves one
    micro-batch's activations."""
    args = ("--train-batch", 4, "--seq", 8, "--flows", "bf16", "--layers", 1, *FAST)
    rows = bench("train", "--micro-batch", 2, *args)["results"]["train"]
    whole = bench("train", *args)["results"]["train"]
    assert [(r["flow"], r["batch"], r["micro_batch"]) for r in rows] == [("bf16", 4, 2), ("transformers", 4, 2)]
    assert [r["micro_batch"] for r in whole] == [4, 4]
    for a, b in zip(rows, whole):
        assert 0 < a["saved_activation_bytes"] < b["saved_activation_bytes"], a["flow"]
    res = runner.invoke(app, ["bench", "train", "--micro-batch", "0", *FAST])
    assert res.exit_code == 2 and "--micro-batch must be > 0, got 0" in res.output


def test_train_bench_rows_with_the_layers_as_cuda_graphs():
    """``NAME+graphs`` is a train row with ``train.cuda_graphs`` (the trainer's setting, not the flow's):
    on CPU it runs the layers eagerly and says so; a rollout row takes no such modifier."""
    args = ("--train-batch", 2, "--seq", 8, "--layers", 1, "--no-transformers", "--repeats", 1, "--warmup", 1,
            "--json", "--no-history")
    rows = bench("train", "--flows", "bf16,bf16+graphs,fp8-unified+graphs", *args)["results"]["train"]
    assert [r["flow"] for r in rows] == ["bf16", "bf16+graphs", "fp8-unified+graphs"]
    assert "train_graphs" not in rows[0]
    assert [r["train_graphs"] for r in rows[1:]] == ["off: not on a GPU"] * 2
    assert all(r["first_update_s"] > 0 for r in rows)  # the warm-up update, timed on its own
    assert "e4m3" in rows[2]["train"] and "e4m3" not in rows[1]["train"]
    res = runner.invoke(app, ["bench", "rollout", "--flows", "bf16+graphs", *FAST])
    assert res.exit_code == 2
    assert "--flows: 'bf16+graphs': +graphs, +ckpt and +lora are for train rows only" in res.output


def test_train_bench_rows_with_the_layers_recomputed_save_fewer_activations():
    """``NAME+ckpt`` is a train row with ``train.activation_checkpointing``: fewer saved activations than the
    same flow's row without it (what it is for; its time and GPU memory are for a GPU to measure)."""
    args = ("--train-batch", 2, "--seq", 16, "--layers", 2, "--no-transformers", "--repeats", 1, "--warmup", 1,
            "--json", "--no-history")
    rows = bench("train", "--flows", "bf16,bf16+ckpt", *args)["results"]["train"]
    assert [r["flow"] for r in rows] == ["bf16", "bf16+ckpt"]
    assert 0 < rows[1]["saved_activation_bytes"] < 0.7 * rows[0]["saved_activation_bytes"]
    res = runner.invoke(app, ["bench", "train", "--flows", "bf16+graphs+ckpt", *FAST])
    assert res.exit_code == 2 and "+graphs and +ckpt do not go together" in res.output


def test_train_bench_rows_with_lora_adapters():
    """``NAME+lora``: the same model frozen under rank-32 adapters on every linear layer: the adapters alone
    train (their parameter count in the row), the GEMMs of the flow run beside them."""
    args = ("--train-batch", 2, "--seq", 16, "--layers", 2, "--no-transformers", "--repeats", 1, "--warmup", 1,
            "--json", "--no-history")
    rows = bench("train", "--flows", "fp8-unified,fp8-unified+lora", *args)["results"]["train"]
    assert [r["flow"] for r in rows] == ["fp8-unified", "fp8-unified+lora"]
    assert rows[1]["lora_rank"] == 32 and "lora_rank" not in rows[0]
    # two layers of the tiny policy: 7 adapted layers each, A (32 x in) and B (out x 32)
    h, kv, i = 128, 64, 384
    per_layer = 32 * sum(a + b for a, b in [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)])
    assert rows[1]["trained_params"] == 2 * per_layer
    assert "e4m3" in rows[1]["train"]
    from jetrl_cli.bench import _train_flow

    assert _train_flow("bf16+graphs+lora")[1] == {"graphs", "lora"}  # LoRA's layers as CUDA graphs, on a GPU


def test_a_bench_cut_short_keeps_the_train_rows_it_finished(tmp_path, monkeypatch):
    """``--out``: each train row is written as it finishes (``"partial": true``), so a bench killed at a
    GPU call's time limit still brings back the rows before it; a finished bench replaces them."""
    from jetrl_cli import bench as jbench

    out = tmp_path / "b.json"
    real, calls = jbench._unless_out_of_memory, []

    def second_row_dies(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a time limit's signal would end it
        return real(*a, **k)

    monkeypatch.setattr(jbench, "_unless_out_of_memory", second_row_dies)
    args = ["bench", "train", "--train-batch", "2", "--seq", "8", "--layers", "1", "--no-transformers",
            "--flows", "bf16,fp8-unified", "--repeats", "1", "--warmup", "0", "--no-history", "--out", str(out)]
    runner.invoke(app, args)
    got = json.loads(out.read_text())
    assert got["partial"] and [r["flow"] for r in got["results"]["train"]] == ["bf16"]
    monkeypatch.setattr(jbench, "_unless_out_of_memory", real)
    assert runner.invoke(app, args).exit_code == 0
    got = json.loads(out.read_text())
    assert "partial" not in got and [r["flow"] for r in got["results"]["train"]] == ["bf16", "fp8-unified"]


def test_profile_writes_each_rows_ops_by_self_time(tmp_path):
    d = tmp_path / "prof"
    out = bench("train", "--train-batch", 2, "--seq", 8, "--flows", "bf16", "--layers", 1, "--profile", d, *FAST)
    rows = out["results"]["train"]
    assert [r["profile"] for r in rows] == [str(d / "train-bf16.txt"), str(d / "train-transformers.txt")]
    for r in rows:  # CPU: no device kernels to count
        text = (d / f"train-{r['flow']}.txt").read_text()
        assert text.startswith(f"train-{r['flow']}: one run under torch.profiler (cpu)") and "device_kernels" not in r
        assert "Self CPU" in text and "aten::mm" in text
    assert "_LinearGroupFnBackward" in (d / "train-bf16.txt").read_text()  # jetrl's own backward ran
    for r in rows:  # and the same update under cProfile: the host's Python by function
        text = (d / f"train-{r['flow']}-python.txt").read_text()
        assert r["python_profile"] == str(d / f"train-{r['flow']}-python.txt") and r["python_self_s"] > 0
        assert text.startswith(f"train-{r['flow']}: one run under cProfile (cpu)") and "own ms" in text
    assert "jetrl_cli/precision/linear.py" in (d / "train-bf16-python.txt").read_text()
    out = bench("rollout", "--batch", 2, "--new-tokens", 4, "--flows", "bf16", "--task-preset", "none",
                "--profile", d, *FAST)
    assert {r["profile"] for r in out["results"]["rollout"]} == {
        str(d / f"rollout-fixed-{k}.txt") for k in ("hf", "fp32", "bf16")}
    assert sorted(p.name for p in d.iterdir()) == ["rollout-fixed-bf16.txt", "rollout-fixed-fp32.txt",
                                                   "rollout-fixed-hf.txt", "train-bf16-python.txt", "train-bf16.txt",
                                                   "train-transformers-python.txt", "train-transformers.txt"]


def test_a_profiles_kernels_are_summed_by_what_they_do():
    """A GPU profile's kernels by kind (``profile_kinds_s``, and a table in the profile's text): jetrl's
    Triton kernels by name, cuBLAS / CUTLASS, flash attention and torch's and inductor's by the words
    in their names (names as the profiler printed them on the H200); an inductor kernel named after
    ``_to_copy`` is not a copy, a CUTLASS attention kernel is attention."""
    from jetrl_cli.bench import OTHER_KIND, device_time_by_kind, format_kinds, kernel_kind

    want = {
        "quantizers (jetrl)": ["_act_quant_kernel", "_swiglu_grad_cols_kernel", "_transpose_words_kernel",
                               "_rms_norm_quant_kernel", "_row_quant_kernel", "_weight_quant_kernel"],
        "GEMMs": ["_blockwise_mm_split_kernel", "_int8_split_sum_kernel", "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN",
                  "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize2x1x1",
                  "void gemv2T_kernel_val<int, int, float>", "triton_tem_fused_addmm_0"],
        "attention, KV cache": ["pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
                                "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "_decode_kernel", "_kv_store_kernel",
                                "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"],
        "optimizer": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>"],
        "copies, fills": ["Memcpy DtoD (Device -> Device)", "Memset (Device)",
                          "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
                          "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>"],
        OTHER_KIND: ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton_poi_fused_mul_silu_0",
                     "void at::native::reduce_kernel<512, 1>", "_rms_norm_kernel", "_lse_part_kernel"],
    }
    for kind, names in want.items():
        for n in names:
            assert kernel_kind(n) == kind, (n, kernel_kind(n))
    kinds = device_time_by_kind([("_act_quant_kernel", 1500.0), ("nvjet_x", 3000.0),
                                 ("_swiglu_grad_quant_kernel", 500.0), ("flash_fwd", 1000.0)])
    assert kinds == {"GEMMs": 3e-3, "quantizers (jetrl)": 2e-3, "attention, KV cache": 1e-3}
    assert list(kinds) == ["GEMMs", "quantizers (jetrl)", "attention, KV cache"]  # largest first
    text = format_kinds(kinds)
    assert text.splitlines()[1].split() == ["3.000", "ms", "50.0%", "GEMMs"] and format_kinds({}) == ""


def test_model_shapes_are_real_configs_and_their_transformers_twin_matches():
    from jetrl_cli.models.shapes import SHAPES, random_model, with_layers
    from jetrl_cli.models.transformers_ref import hf_config_dict, transformers_twin

    q = SHAPES["qwen2.5-1.5b"]  # published config.json values
    assert (q.hidden_size, q.intermediate_size, q.num_attention_heads, q.num_key_value_heads, q.vocab_size) == (
        1536, 8960, 12, 2, 151936) and q.tie_word_embeddings and q.attention_bias
    assert hf_config_dict(SHAPES["llama-3-8b"])["rope_theta"] == 500000.0
    small = with_layers(SHAPES["qwen2.5-7b"], 1)
    assert small.num_hidden_layers == 1 and small.hidden_size == 3584
    # the transformers twin computes the same function (tiny shape: the real ones are too big for CI)
    from jetrl_cli.models.tiny import tiny_config

    for kind in ("qwen2", "llama", "qwen3"):
        m = random_model(tiny_config(kind, hidden=128, layers=2, vocab=256), seed=3)
        for name, p in m.named_parameters():  # q/k norms away from 1: a twin that dropped them would differ
            if "q_norm" in name or "k_norm" in name:
                p.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours, theirs = m(ids), transformers_twin(m, torch.float32)(ids).logits
        assert (ours - theirs).abs().max() < 1e-4


def test_history_and_out_file(tmp_path):
    args = ["gemm", "--shapes", "8x128x128", "--repeats", "1", "--warmup", "0", "--history", tmp_path / "h.jsonl"]
    for _ in range(2):
        res = runner.invoke(app, ["bench", *[str(a) for a in args], "--out", str(tmp_path / "r.json")])
        assert res.exit_code == 0, res.output
    lines = (tmp_path / "h.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["results"]["gemm"]
    rows = json.loads((tmp_path / "r.json").read_text())["results"]["gemm"]
    # the tables as piped output shows them (80 columns): every number whole, none cut to "0…"
    assert "…" not in res.stdout and all(len(line) <= 80 for line in res.stdout.splitlines())
    for r in rows:
        if "skipped" in r:  # listed below the table with its reason
            assert f"not run: {r['variant']} @ {r['backend']}" in res.stdout
            continue
        for number in (f"{r['tflops']:.3f}", f"{r['rel_err']:.1e}", f"{r['sqnr_db']:.1f}", f"{r['vs_bf16']:.2f}x"):
            assert number in res.stdout, number


def assert_readable_at_80_columns(res: dict, numbers: list[str]) -> None:
    """``bench.render`` on an 80-column console (piped output): no cell cut, the numbers all there."""
    import io

    from rich.console import Console

    from jetrl_cli import bench as bench_mod

    con = Console(width=80, file=io.StringIO())
    bench_mod.render(res, con)
    text = con.file.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines()), text
    for n in numbers:
        assert n in text, (n, text)


@pytest.mark.parametrize("given, model, want", [
    (None, "tiny", "fp8-unified"), (None, "/models/SmolLM2-135M", None), ("none", "tiny", None),
    ("qurl", "/models/SmolLM2-135M", "qurl"),
])
def test_task_shaped_rollout_batch_is_opt_in_for_a_users_model(given, model, want):
    from jetrl_cli.cli import _bench_task_preset

    assert _bench_task_preset(given, model) == want


@pytest.mark.parametrize("args, msg", [
    (["fastest"], "unknown bench mode 'fastest'"),
    (["gemm", "--shapes", "12x12"], "--shapes: '12x12' is not MxNxK"),
    (["gemm", "--shapes", "4xax4"], "--shapes: '4xax4' is not MxNxK"),
    (["quantize", "--shapes", "0x128"], "--shapes: '0x128' is not MxK"),
    (["attention", "--shapes", "64"], "--shapes: '64' is not BATCHxWIDTH with positive integers (e.g. 64x1024)"),
    (["rollout", "--shapes", "64x64"], "--shapes applies to the gemm, quantize and attention modes"),
    (["rollout", "--flows", "fp9"], "unknown flow 'fp9'"),
    (["gemm", "--device", "tpu"], "--device 'tpu': allowed cpu, cuda"),
    (["train", "--seq", "1"], "--seq must be >= 2"),
    (["gemm", "--profile", "p"], "--profile applies to the rollout and train modes"),
    (["quantize", "--warps", "8,7"], "--warps: '7' is not a warp count (allowed 4, 8, 16, 32, comma-separated)"),
    (["gemm", "--warps", "8"], "--warps applies to the quantize mode"),
    (["e2e", "--model", "qwen2.5-1.5b"],
     "bench e2e: it runs `jetrl run` on a model directory or 'tiny', not on a shape"),
    (["e2e", "--flows", "bf16,bf16+invariant"], "bench e2e: it runs the named flows only (bf16, fp8-rollout, "
                                                "int8-rollout, fp8-unified), not bf16+invariant"),
    (["e2e", "--layers", "1"], "bench e2e: it runs whole models (--layers applies to the rollout and train modes)"),
])
def test_bad_input_is_one_line(args, msg):
    res = runner.invoke(app, ["bench", *args, "--no-history"])
    assert res.exit_code == 2
    assert msg in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_warps_without_the_triton_quantizers_is_an_error(monkeypatch):
    """``--warps`` on a CPU without Triton's interpreter: the Triton quantizers, the only ones that take a
    warp count, cannot run; one line says so (it used to time the torch reference and ignore --warps)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = runner.invoke(app, ["bench", "quantize", "--warps", "8,16", "--shapes", "256x256", *FAST])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "--warps times the Triton quantizers, which do not run here: they run on CUDA tensors" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpu_is_a_clear_error():
    res = runner.invoke(app, ["bench", "gemm", "--device", "cuda", "--no-history"])
    assert res.exit_code == 2 and "--device cuda: torch sees no CUDA device" in res.stderr


def test_generate_reference_loads_quietly(capfd):
    """`bench` builds transformers' model without its dtype deprecation warning or loading bar."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from jetrl_cli.models.hf import load_model
    from jetrl_cli.models.transformers_ref import _dtype_kwarg, transformers_twin
    from jetrl_cli.rl.loop import tiny_policy_dir

    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    model = transformers_twin(load_model(tiny_policy_dir()), torch.float32).eval()
    out, err = capfd.readouterr()
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert "deprecated" not in out + err and "Loading" not in out + err and "%|" not in out + err, out + err
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before
    assert _dtype_kwarg("4.45.2") == "torch_dtype" and _dtype_kwarg("4.56.0") == "dtype" and _dtype_kwarg("5.0.0rc1") == "dtype"

def test_invariant_flow_names_in_bench():
    from jetrl_cli import bench as bench_mod

    f = bench_mod._flow("fp8-unified+invariant")
    assert f.batch_invariant and f.rollout.linear.backend == "invariant" and f.name == "fp8-unified+invariant"
    assert not bench_mod._flow("fp8-unified").batch_invariant
    res = runner.invoke(app, ["bench", "train", "--flows", "bf16+fast", *FAST])
    assert res.exit_code == 2 and "+invariant for its batch-invariant mode" in res.output
    kv = bench_mod._flow("fp8-rollout+fp8kv")
    assert kv.rollout.kv_cache.format.value == "fp8_e4m3" and not kv.batch_invariant
    both = bench_mod._flow("fp8-unified+fp8kv+invariant")
    assert both.batch_invariant and both.kv_cast("train") == both.kv_cast("rollout") == kv.kv_cast("rollout")
    for bad in ("bf16+fp8kv+fp8kv", "bf16+kv8"):
        with pytest.raises(JetrlError, match="unknown flow"):
            bench_mod._flow(bad)
    out = bench("train", "--train-batch", 2, "--seq", 8, "--flows", "bf16,bf16+invariant", *FAST)
    assert [r["flow"] for r in out["results"]["train"]][:2] == ["bf16", "bf16+invariant"]


def test_gpu_targets_follow_the_issues_rules():
    """The GPU targets on CUDA-shaped rows: the fastest backend per shape counts, the worst shape decides,
    rows that were not measured add no target, and each comparison uses the rows it names."""
    from jetrl_cli.bench import GPU_TARGETS, targets

    def g(shape, variant, backend, vs, ok=True, m=4096):
        return {"shape": shape, "M": m, "N": 4096, "K": 4096, "variant": variant, "backend": backend,
                "vs_bf16": vs, "accuracy_ok": ok}

    blk, wg = "fp8 1x128 x 128x128", "fp8 1x128 x 1x128 (wgrad)"
    gemm = [g("llama-3-8b q_proj", "bf16 (cuBLAS)", "torch", 1.0),
            g("llama-3-8b q_proj", blk, "triton", 0.9), g("llama-3-8b q_proj", blk, "scaled_mm", 1.6),
            g("qwen2.5-7b down_proj", blk, "scaled_mm", 1.52), g("qwen2.5-7b down_proj", blk, "triton", 9.0, ok=False),
            g("qwen2.5-7b down_proj", blk, "invariant", 3.0),  # the batch-invariant mode's GEMM: not what auto picks
            g("square 8192", blk, "scaled_mm", 0.5), g("llama-3-8b q_proj", blk, "scaled_mm", 0.1, m=128),
            g("llama-3-8b q_proj", wg, "scaled_mm", 1.1)]
    train = [{"flow": "bf16", "model": "qwen2.5-1.5b", "s": 1.0, "step_vs_bf16": 1.0, "step_vs_transformers": 0.9,
              "peak_vs_transformers": 1.1, "activations_vs_bf16": 1.0, "batch": 16, "seq": 512,
              "peak_memory_bytes": 45 * 2**30},
             {"flow": "fp8-unified", "model": "qwen2.5-1.5b", "s": 0.8, "step_vs_bf16": 0.8, "activations_vs_bf16": 0.55},
             {"flow": "fp8-unified+invariant", "model": "qwen2.5-1.5b", "s": 1.1, "step_vs_bf16": 1.1,
              "activations_vs_bf16": 0.55},
             {"flow": "bf16+graphs", "model": "qwen2.5-1.5b", "s": 0.9, "step_vs_bf16": 0.9},
             {"flow": "fp8-unified+graphs", "model": "qwen2.5-1.5b", "s": 0.72, "step_vs_bf16": 0.72},
             {"flow": "fp8-unified+invariant+graphs", "model": "qwen2.5-1.5b", "s": 0.88, "step_vs_bf16": 0.88}]
    ro = [{"engine": "transformers generate(), static cache", "flow": "bf16", "workload": "fixed", "tokens_per_s": 100.0},
          {"engine": "jetrl embedded", "flow": "bf16", "workload": "fixed", "tokens_per_s": 120.0},
          {"engine": "jetrl embedded", "flow": "fp8-rollout", "workload": "fixed", "tokens_per_s": 150.0},
          {"engine": "jetrl embedded", "flow": "int8-rollout", "workload": "fixed", "tokens_per_s": 145.0}]
    e2e = [{"flow": "fp8-unified", "sync_s": 0.01, "step_s": 1.0}]
    got = {t["target"]: t for t in targets({"gemm": gemm, "train": train, "rollout": ro, "e2e": e2e}, "cuda")}

    def one(prefix):
        (t,) = [t for name, t in got.items() if name.startswith(prefix)]
        return t

    t = one("blockwise FP8 GEMM (Fprop/Dgrad)")  # best per shape: 1.6 and 1.52 (the inaccurate 9.0 and invariant 3.0 are not counted)
    assert t["value"] == 1.52 and t["met"]
    t = one("blockwise FP8 Wgrad")
    assert t["value"] == 1.1 and not t["met"]
    assert one("bf16 train step <=")["met"] and not one("bf16 train peak memory")["met"]
    t = one("bf16 trains 16 x 512 tokens of qwen2.5-1.5b on this GPU (peak GiB)")
    assert t["value"] == 45 and t["met"]
    t = one("fp8-unified train step >= 1.15x")
    assert t["value"] == pytest.approx(1.25) and t["met"]
    t = one("fp8-unified+invariant train step")
    assert t["value"] == pytest.approx(1.1 / 0.8) and not t["met"] and t["target"].endswith("(fp8-unified)")
    t = one("fp8-unified+graphs train step >= 1.15x faster than bf16+graphs")  # each flow's layers as graphs
    assert t["value"] == pytest.approx(0.9 / 0.72) and t["met"]
    t = one("fp8-unified+invariant+graphs train step")  # priced against the same flow's graphs, fast path
    assert t["value"] == pytest.approx(0.88 / 0.72) and t["met"] and t["target"].endswith("(fp8-unified+graphs)")
    assert one("embedded bf16 rollout >= static-cache")["value"] == pytest.approx(1.2)
    t = one("fp8-rollout rollout")
    assert t["value"] == pytest.approx(1.25) and not t["met"] and GPU_TARGETS["rollout_fp8_vs_bf16"] == 1.3
    assert one("int8-rollout rollout")["met"]
    assert one("fp8-unified weight sync")["met"]
    assert not any(name.startswith("every Triton quantizer") for name in got)  # no quantize rows measured
    assert targets({"gemm": gemm}, "cpu") == []  # GPU targets never judge CPU rows


def test_rollout_rows_say_which_attention_read_the_kv_cache(forced_native):
    """Natively (a GPU; here the native path forced, Triton's interpreter) each row names the kernel
    that read its KV cache at decode steps, as decided at the engine's first decode step."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from jetrl_cli import bench as bench_mod
    from jetrl_cli.models.llama import BF16_READ, CACHE_KERNELS, KV_READ

    s = bench_mod.Settings(device=TRITON_DEV, repeats=1, warmup=0, batch=2,
                           new_tokens=3, task_preset=None, flows=("bf16", "bf16+fp8kv"))
    rows = {r["flow"]: r for r in bench_mod.bench_rollout(s) if r["engine"] == "jetrl embedded"}
    fp8_kv, bf16_kv = rows["bf16+fp8kv"]["kv_attention"], rows["bf16"]["kv_attention"]
    if torch.cuda.is_available():
        # a GPU times both ways to read the cache at the first decode step and keeps the faster one
        # (llama._choose_cache_read): either kernel, followed by the timings that chose it
        for label, op in ((fp8_kv, KV_READ), (bf16_kv, BF16_READ)):
            assert label.startswith(tuple(f"{k} (timed at " for k in CACHE_KERNELS[op])), label
    else:
        # Triton's interpreter times nothing: an FP8 cache is read as stored, a bf16 one through SDPA
        assert fp8_kv == "triton, read as stored"
        assert bf16_kv.startswith("SDPA")
    assert rows["bf16+fp8kv"]["kv_bytes_per_token"] < 0.6 * rows["bf16"]["kv_bytes_per_token"]


def test_interleaved_timing_reports_each_call_as_it_ends():
    """``measure_interleaved`` says each warm-up and each timed call (with its tokens/s when the call
    returns a token count) as it ends, in the order they ran: a bench cut off at a time limit on a GPU
    machine still shows what it had measured."""
    from jetrl_cli import bench as bench_mod

    said: list[str] = []
    calls: list[str] = []

    def engine(name, tokens):
        def run():
            calls.append(name)
            time.sleep(0.002)
            return tokens
        return run

    s = bench_mod.Settings(device="cpu", repeats=2, warmup=1, progress=said.append)
    out = bench_mod.measure_interleaved({"a": engine("a", 40), "b": engine("b", None)}, s)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert [m.split(":")[0].strip() for m in said] == calls
    assert "warm-up 1 of 1" in said[0] and "run 2 of 2" in said[-1]
    timed_a = [m for m in said if m.strip().startswith("a: run")]
    assert len(timed_a) == 2 and all(m.endswith(" tokens/s") for m in timed_a)
    assert not any("tokens/s" in m for m in said if m.strip().startswith("b:"))
    assert out["a"]["tokens"] == 40 and out["a"]["repeats"] == 2 and "tokens" not in out["b"]


def test_short_calls_are_timed_back_to_back_on_a_gpu(monkeypatch):
    """On a GPU ``measure`` times a call shorter than ``TIMED_S`` as many calls between two events
    (per call), a long one alone. The GPU's clock is stood in for by a counter each call advances by
    its own duration, so the per-call time is known exactly."""
    from jetrl_cli import bench

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    s = bench.Settings(device="cuda", repeats=3, warmup=1)
    calls = []

    def call(dt):
        def fn():
            calls.append(dt)
            clock[0] += dt
        return fn

    short = bench.measure(call(1e-4), s)
    assert short["calls"] == min(bench.MAX_CALLS, int(bench.TIMED_S / 1e-4)) > 1
    assert short["s"] == pytest.approx(1e-4) and short["repeats"] == 3
    assert len(calls) == 1 + 1 + 3 * short["calls"]  # warm-up, the probe, the timed runs
    calls.clear()
    long = bench.measure(call(0.05), s)
    assert long["calls"] == 1 and long["s"] == pytest.approx(0.05) and len(calls) == 1 + 1 + 3


def test_train_rows_say_when_the_cuda_allocator_made_a_step_wait():
    """On a GPU each train row counts the caching allocator's retries and cudaMalloc / cudaFree calls in
    one more step (``allocator_events``); the table says so when there were any (a step near the
    memory limit waits on them), and nothing when there were none."""
    import io

    from rich.console import Console

    from jetrl_cli import bench as bench_mod

    out = bench("train", "--train-batch", 2, "--seq", 8, "--flows", "bf16", "--layers", 1, *FAST)
    row = out["results"]["train"][0]
    assert "allocator_per_step" not in row  # CPU: no allocator to ask

    def text(events):
        con = Console(width=120, file=io.StringIO())
        bench_mod.render({**out, "results": {"train": [{**row, "allocator_per_step": events}]}}, con)
        return con.file.getvalue()

    quiet = dict.fromkeys(bench_mod.ALLOCATOR_EVENTS, 0)
    assert "allocator" not in text(quiet)
    line = "bf16: per step, the CUDA allocator retried 2 allocations, called cudaMalloc 7 and cudaFree 5 times"
    assert line in text({**quiet, "num_alloc_retries": 2, "num_device_alloc": 7, "num_device_free": 5})


def test_measuring_saved_activations_leaves_no_graph_behind():
    """The saved-activations forward's graph (and, through its gradient accumulators, the weights)
    is freed with its output, never differentiated: a pack hook that kept the tensor itself made a
    cycle through a saved output's grad_fn, which held each bench row's model after the row (39 GiB
    on an H200). The graph still differentiates as one without the hooks."""
    import gc
    import weakref

    from jetrl_cli.bench import _saved_bytes

    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(4, 8, generator=g)
    w = torch.randn(8, 16, generator=g, requires_grad=True)

    def loss(weight):
        return torch.log_softmax(torch.tanh(x @ weight), -1).sum()

    gone = weakref.ref(w)
    saved, out = _saved_bytes(lambda: loss(w))
    assert saved == 2 * 4 * 16 * 4 + 4 * 8 * 4  # tanh's and log_softmax's outputs, and x (matmul's input)
    del out, w
    gc.collect()
    assert gone() is None
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    _saved_bytes(lambda: loss(w))[1].backward()
    loss(w2).backward()
    assert torch.equal(w.grad, w2.grad)


def test_decode_gemm_rows_are_also_timed_from_a_graph_on_a_gpu(monkeypatch):
    """On a GPU a decode-sized GEMM row (at most ``DECODE_ROWS`` rows) is also timed replayed from a
    CUDA graph (``graph_s``: what a captured decode step pays; eager back-to-back calls of so small a
    GEMM time the host's launches), and the table shows it beside the eager time. CPU rows have none."""
    import io

    from rich.console import Console

    from jetrl_cli import bench as jbench
    from jetrl_cli.precision import gemm

    calls = []
    monkeypatch.setattr(gemm, "device_time_ms", lambda fn, device: calls.append(device) or 0.5)
    s = jbench.Settings(device="cuda")
    assert jbench._graph_s(lambda: None, 64, s) == 0.5e-3 and jbench._graph_s(lambda: None, 65, s) is None
    assert calls == [torch.device("cuda")]
    assert jbench._graph_s(lambda: None, 8, jbench.Settings(device="cpu")) is None
    row = {"shape": "s", "M": 8, "N": 16, "K": 16, "backend": "torch", "variant": "bf16 (cuBLAS)", "s": 1e-4,
           "tflops": 1.0, "vs_bf16": 1.0, "rel_err": 0.0, "sqnr_db": 50.0, "kernel_rel_err": 0.0, "accuracy_ok": True}
    fp8 = {**row, "backend": "triton", "variant": "fp8 1x128 x 128x128", "graph_s": 4e-6, "graph_vs_bf16": 1.25}
    out = io.StringIO()
    env = {"date": "today", "device": "cuda", "device_name": "a GPU", "threads": 2, "torch": torch.__version__}
    gemm_rows = [{**row, "graph_s": 5e-6, "graph_vs_bf16": 1.0}, fp8]
    jbench.render({"env": env, "targets": [], "results": {"gemm": gemm_rows}}, Console(file=out, width=250))
    assert "graph vs bf16" in out.getvalue() and "1.25x" in out.getvalue() and "0.0040" in out.getvalue()


def test_a_profile_finds_where_the_device_waited_and_keeps_the_timeline(tmp_path):
    """``device_gaps``: the idle time between a run's kernels (overlapping kernels and copies count as
    busy) and its longest gaps, with the kernels around each; ``export_trace`` writes the profiler's
    timeline as gzipped Chrome-trace JSON."""
    import gzip
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from jetrl_cli.bench import device_gaps, export_trace, format_gaps

    def k(name, start, end, device=DeviceType.CUDA):
        return NS(name=name, device_type=device, time_range=NS(start=start, end=end))

    # a: 0-10, b overlaps a (5-30), host op (ignored), c after a 20 us gap, d after 5, e inside d
    events = [k("c", 50, 60), k("a", 0, 10), k("b", 5, 30), k("host", 30, 90, DeviceType.CPU), k("d", 65, 100),
              k("e", 70, 80)]
    g = device_gaps(events)
    assert g["idle_s"] == pytest.approx(25e-6) and g["span_s"] == pytest.approx(100e-6)
    assert [(x["us"], x["after"], x["before"]) for x in g["gaps"]] == [(20.0, "b", "c"), (5.0, "c", "d")]
    assert "device idle 0.0 ms of the 0.1 ms" in format_gaps(g)
    assert device_gaps([k("host", 0, 9, DeviceType.CPU)]) == {"idle_s": 0.0, "span_s": 0.0, "gaps": []}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    path = export_trace(prof, str(tmp_path / "run-trace.json.gz"))
    with gzip.open(path) as f:
        assert "traceEvents" in json.load(f)
    assert [p.name for p in tmp_path.iterdir()] == ["run-trace.json.gz"]


@pytest.mark.parametrize("args", [["--model", "qwen2.5-1.5b"], ["--flows", "bf16,fp8-unified+fp8kv"],
                                  ["--layers", "2"]])
def test_bench_all_leaves_out_e2e_where_it_cannot_run_before_any_mode_runs(monkeypatch, args):
    """``bench`` (all modes) with settings e2e cannot take -- a random-weight shape, a flow variant,
    ``--layers`` -- leaves e2e out with a line saying why, found before the first mode runs (a GPU
    bench of every mode ended only at e2e, with an error); the JSON says it too."""
    from jetrl_cli import bench as jbench

    ran = []
    monkeypatch.setattr(jbench, "RUNNERS", {m: (lambda s, m=m: ran.append(m) or []) for m in jbench.MODES})
    res = runner.invoke(app, ["bench", *args, *FAST])
    assert res.exit_code == 0, res.output
    assert ran == [m for m in jbench.MODES if m != "e2e"]
    out = json.loads(res.stdout)
    assert set(out["not_run"]) == {"e2e"} and "e2e" not in out["results"]
    assert "not run: e2e: it runs" in res.stderr
    ran.clear()
    res = runner.invoke(app, ["bench", "--flows", "bf16", *FAST])  # settings e2e takes: every mode
    assert res.exit_code == 0 and ran == list(jbench.MODES) and "not_run" not in json.loads(res.stdout)


def test_sizes_that_do_not_fit_in_memory_are_one_line_naming_the_options(monkeypatch):
    """An allocation that fails (on CPU a RuntimeError from c10's allocator, not torch.OutOfMemoryError)
    ends the bench with one line naming the options that size it; any other error stays a bug."""
    from jetrl_cli.rl import trainer as trainer_mod

    # 4e14 bytes: past any machine's address space, so refused whatever the kernel's overcommit policy
    res = runner.invoke(app, ["bench", "gemm", "--shapes", "10000000x8x10000000", "--no-history", "--json"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert res.stderr.startswith("error: bench gemm: out of memory on cpu (asked for 363.8 TiB): lower "
                                 "--shapes 10000000x8x10000000")
    alloc = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
             "to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)")

    def update(self, *args, **kwargs):
        raise RuntimeError(alloc)

    monkeypatch.setattr(trainer_mod.Trainer, "update", update)
    res = runner.invoke(app, ["bench", "train", "--train-batch", 2, "--seq", 16, "--flows", "bf16",
                              "--no-transformers", "--repeats", 1, "--warmup", 0, "--no-history", "--json"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert " ".join(res.stderr.split()) == ("error: bench train: out of memory on cpu (asked for 74.5 GiB): lower "
                                            "--seq 16 or --train-batch 2, give a --micro-batch, or use a smaller "
                                            "--model or fewer --layers")
    alloc = "something else went wrong"
    with pytest.raises(RuntimeError, match="something else"):
        runner.invoke(app, ["bench", "train", "--train-batch", 2, "--seq", 16, "--flows", "bf16",
                            "--no-transformers", "--repeats", 1, "--warmup", 0, "--no-history"], catch_exceptions=False)


def test_a_profile_path_that_is_a_file_is_refused_before_the_bench_runs(tmp_path, monkeypatch):
    from jetrl_cli import bench as bench_mod

    def never(*args, **kwargs):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(bench_mod, "run_bench", never)
    f = tmp_path / "afile"
    f.write_text("")
    res = runner.invoke(app, ["bench", "train", "--profile", str(f), "--no-history"])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == f"error: --profile {f}: is a file; --profile takes the directory to write into"
