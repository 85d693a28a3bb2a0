"""The GPU code paths on fake CUDA tensors, without a GPU (``tests/fake_cuda.py``, in a subprocess).

A CPU run of the native path (``test_gpu_paths``' forced-native tests) checks the GPU path's dtypes
and numerics, but every tensor is on the CPU there, so it cannot tell a tensor left on the host by
mistake, nor where the host waits for the device. Here CUDA tensors are torch's FakeTensors (torch's
meta kernels give shapes, dtypes and devices; nothing is computed) while host tensors stay real:

- the embedded engine's GPU decoding (one static cache, compaction in place, weights synced twice,
  in place) and the trainer's forward, scoring and loss run for bf16, FP8 (``scaled_mm``, emulated,
  FP8 KV cache) and INT8 flows with no CPU tensor meeting a CUDA one (torch's fake mode raises on
  mixed devices, as CUDA does);
- the host reads device values only where it means to: rollout at the stop check, every
  ``check_every`` tokens, and once at the end; the trainer once per scored micro-batch and once
  per mini-batch (``host_values``), none in a micro-batch's forward and loss;
- the trainer's whole update -- forward, backward (FP8 Dgrad and Wgrad through ``scaled_mm``'s
  blockwise scale layouts), gradient clipping, fused AdamW -- leaves fp32 gradients and optimizer
  state on the device and reads the host twice per mini-batch: its values, and the finite check of
  the updated parameters; its micro-batches' inputs go to the device without a blocking copy (one
  would wait for the work queued before it), and a micro-batch after the first adds its weight
  gradients into the ``.grad`` the first left (``grads_in_place``);
- the batch-invariant flows' decoding and training forward, the same way (their Triton kernels' wrappers
  on the device);
- the engine's decode steps and ``train.cuda_graphs``: the captures (``HostOnlyGraphs``) read nothing
  from the device and copy nothing to it from the host, for every flow;
- ``jetrl bench train --device cuda`` (1.5B shape, one layer) runs every row, and ``auto`` keeps
  blockwise ``scaled_mm`` for Fprop, Dgrad and Wgrad (its probe once cast Wgrad's operands as no
  kernel takes them, which would have sent a GPU's Wgrad to the emulated path);
- ``jetrl bench rollout --device cuda`` runs every engine row, fixed and task-shaped batches (its
  task rows once stopped at the weight-sync timing: a sync after a rollout wrote into inference
  tensors outside inference mode);
- ``jetrl run PRESET --set model.device=cuda`` (fp8-unified, bf16, int8-rollout-tis) runs two whole
  RL steps, reading the host only where the parts above do (its eval once stopped at a one-row
  decode step: blockwise ``scaled_mm`` wants the scales' row stride 1 even for one row); so do the
  ``gpu-qwen2.5-1.5b-gsm8k-*`` presets with their own batch settings, on a Hugging Face directory of a
  small Qwen2 with the real model's traits (tied embeddings, GQA, head_dim 128) and GSM8K-style JSONL.

It needs a CUDA build of torch (a GPU machine's, or torch 2.11+cu130 installed on CPU); a CPU-only
build cannot create fake CUDA tensors, and the test is skipped there.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "fake_cuda.py")

# Fake CUDA stands in for a GPU that is absent. Where a real one is present, torch's fake mode and the
# real CUDA runtime meet in the subprocess (CUDA graph state, FakeTensor data pointers) and it crashes;
# there the ``gpu``-marked tests (test_gpu_paths, test_engine_gpu_path, ...) run these paths for real.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a real GPU is here: fake CUDA is for CPU-only machines (the gpu tests run the real paths)")


@pytest.fixture(scope="module")
def report():
    if not torch.backends.cuda.is_built():
        pytest.skip(f"this torch ({torch.__version__}) is not built with CUDA: no fake CUDA tensors")
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_the_detectors_work(report):
    assert report["control"]["reads"] == 1
    assert report["control"]["blocking_h2d"] == 1
    assert "cuda:0, cpu" in report["control"]["mixed"]  # torch's fake mode rejects mixed devices, as CUDA does


def test_every_scenario_runs(report):
    assert report["failures"] == {}
    assert set(report["rollout"]) == set(report["train_forward"])
    # the batch-invariant flows: rollout and the trainer's forward (their attention's backward recomputes
    # through autograd's C++ engine, which wants a CUDA context)
    assert set(report["rollout"]) - set(report["train_step"]) == {"bf16+invariant", "fp8-unified+invariant"}
    assert len(report["rollout"]) >= 7
    for kernel in ("_mm_kernel", "_fp8_mm_kernel", "_attention_kernel", "_rms_norm_kernel", "_lse_part_kernel",
                   "_rope_kernel", "_silu_mul_kernel"):  # the last two: RoPE and SwiGLU as one kernel each
        assert report["triton_launches"].get(kernel, 0) > 0, kernel  # the invariant kernels' wrappers ran
    # the fp8-unified scenario's FP8 KV cache is read as stored (the kernel's launch stood in)
    assert report["triton_launches"].get("decode_attention", 0) > 0 and report["triton_launches"].get("kv_store", 0) > 0
    assert report["triton_launches"].get("keyed_gumbel_argmax", 0) > 0  # sampling: one kernel a step on a GPU
    # the Triton quantizers' wrappers, on the device: activations, weights, SwiGLU forward and its
    # backward (its gradient with down's h^T: swiglu_quantize_t alone is for a frozen gate/up), the
    # norms that quantize their GEMM's input, INT8 rows (an INT8 rollout's norms and SwiGLU write theirs)
    launches = report["triton_launches"]
    for kernel in ("_act_quant_kernel", "_weight_quant_kernel", "_swiglu_quant_kernel",
                   "_rms_norm_quant_kernel", "_row_quant_kernel", "_rms_norm_rows_kernel", "_swiglu_rows_kernel"):
        assert launches.get(kernel, 0) > 0, kernel
    # the SwiGLU backward as its one kernel or its two (the device's timed choice), never both
    one, two = launches.get("_swiglu_grad_quant_kernel", 0), launches.get("_swiglu_grad_cols_kernel", 0)
    assert (one > 0) != (two > 0) and (two == 0 or launches.get("_swiglu_grad_rows_kernel", 0) == two), launches
    assert launches.get("_swiglu_quant_t_kernel", 0) == 0
    # a trainer's q/k/v and gate/up written into their stacks, the model's groups together after an update
    assert report["triton_launches"].get("quantize_weight_stacks", 0) > 0


def test_rollout_stays_on_the_device_and_syncs_only_at_stop_checks(report):
    """Every flow's decoding, the batch-invariant ones too: no host read but the stop checks and the
    final copy (a read in a decode step would also break its CUDA graph's capture)."""
    for name, r in report["rollout"].items():
        assert r["load_reads"] == {}, name  # a weight sync never waits for the device
        assert r["completions"] == [2, 2, 2]
        reads = r["generate_reads"]
        stop = [k for k in reads if "done.tolist()" in k]
        final = [k for k in reads if "_completions(" in k]
        assert len(stop) == 1 and len(final) == 1 and set(reads) == set(stop + final), (name, reads)
        # one element read per live row at each check, a check every check_every tokens
        assert 1 <= reads[stop[0]] <= r["rows"] * math.ceil(24 / r["check_every"]), (name, reads)
        assert r["check_every"] > 1
        assert reads[final[0]] == 2  # tokens and logprobs, copied to the host once


def test_training_forward_stays_on_the_device_and_reads_once_per_minibatch(report):
    for name, r in report["train_forward"].items():
        assert r["logprobs"] == [[3, 159], "torch.float32", "cuda:0"], name
        assert _steady(r["step_reads"]) == {}, (name, r["step_reads"])  # forward + loss: no host sync
        (score,) = _steady(r["score_reads"])
        assert "token_logprobs(model, mb, sampling, entropy).float().cpu()" in score and r["score_reads"][score] == 2
        (values,) = r["host_values_reads"]
        assert "rl/trainer.py" in values and r["host_values_reads"][values] == 1 + len(r["stats"]) + 1


def _steady(reads: dict) -> dict:
    """``reads`` but a backend's one-time check against the emulated GEMM, where a GEMM kind's backend is
    first resolved in the process (the invariant flows' training forward, here): once, not per step."""
    return {k: v for k, v in reads.items() if not ("precision/gemm.py" in k and "err = float((got - ref)" in k and v == 1)}


def test_training_update_stays_on_the_device_and_reads_twice_per_minibatch(report):
    for name, r in report["train_step"].items():
        assert r["updates"] == 2 and r["no_grad"] == [], name
        assert r["grads"] == ["cuda torch.float32 of torch.float32"], name  # fp32 master weights and grads
        assert r["optimizer_state"] == ["cuda torch.float32"], name
        # the lm_head's two logprob chunks: the second Wgrad adds into the first's fp32 sum in the GEMM
        # (addmm(out_dtype=), passing the checks of torch 2.11's CUDA kernel: tests/fake_cuda.py)
        assert r["wgrad_sum"]["kernel"] == "GEMM into the sum (out_dtype)", (name, r["wgrad_sum"])
        # each mini-batch's second micro-batch adds its weight gradients where the first left them
        # (``grads_in_place``), fp32 on the device: per layer q/k/v through one view of three .grads,
        # gate/up through one of two, o and down; the lm_head's and the untied embedding's
        assert r["grads_in_place"] == {"3 x cuda torch.float32": 2 * 2, "2 x cuda torch.float32": 2 * 2,
                                       "1 x cuda torch.float32": 2 * (2 * 2 + 2)}, (name, r["grads_in_place"])
        assert r["stats"] == ["clip_frac", "grad_norm", "loss", "pg_loss"], name
        reads = r["update_reads"]
        (values,) = [k for k in reads if "torch.stack([t.float() for t in flat]" in k]
        (finite,) = [k for k in reads if "bool(finite.all())" in k]
        assert set(reads) == {values, finite}, (name, reads)  # none in the backward, clipping or AdamW
        loss_values = 1 + len(report["train_forward"][name]["stats"])
        # one element read per value: each micro-batch's, the gradient norm and the clipping factor
        assert reads[values] == 2 * (2 * loss_values + 2), (name, reads)
        assert reads[finite] == 2, (name, reads)
        # the micro-batches' inputs go to the device without waiting for it (pinned, non-blocking)
        assert r["update_blocking_h2d"] == {}, (name, r["update_blocking_h2d"])


def test_decode_steps_capture_with_no_host_read_or_copy(report):
    """The engine's decode steps captured as CUDA graphs for every flow, the batch-invariant ones too:
    the capture keeps them (not switched off) and nothing in it reads the device from the host or
    copies to it from the host (either would break a real capture: the engine would then decode
    eagerly, host-bound)."""
    assert set(report["decode_graphs"]) == set(report["rollout"]), report["failures"]
    for name, r in report["decode_graphs"].items():
        assert r["completions"] == [2, 2, 2] and r["captures"] >= 1 and r["disabled"] is None, (name, r)
        assert r["in_capture"] == {}, (name, r["in_capture"])


def test_training_cuda_graphs_capture_with_no_host_read_or_copy(report):
    """``train.cuda_graphs`` on the GPU code path: scoring's forward and the update's two forward and
    backward pairs (an optimizer step's first micro-batch, whose backward writes the gradients, and
    the others, adding into them) are captured once each (every micro-batch has one shape) and
    replayed after; nothing in a
    capture reads the device from the host or copies to it from the host (either would break a real
    capture), and no FP8 weight job table is made during one (it would have to be copied in)."""
    assert set(report["train_graphs"]) == {"bf16", "fp8-unified"}, report["failures"]
    for name, r in report["train_graphs"].items():
        assert r["captures"] == 5 and r["state"].startswith("3 captured"), (name, r)
        assert r["first_replays"] == 2, (name, r)  # two mini-batches: two optimizer steps
        assert r["in_capture"] == {}, (name, r["in_capture"])
        assert r["stats"] == ["clip_frac", "grad_norm", "loss", "pg_loss"], name


def test_bench_train_runs_and_auto_keeps_scaled_mm_for_every_fp8_gemm(report):
    rows = report["bench_train"]
    assert set(rows) == {"bf16", "fp8-unified", "transformers"}
    for flow, r in rows.items():
        assert {"s", "tokens_per_s", "peak_memory_bytes", "saved_activation_bytes", "step_vs_transformers",
                "peak_vs_transformers", "allocator_per_step", "peak_memory_by_phase", "peak_reserved_bytes", "memory_at_start_bytes"} <= set(r["keys"]), flow
        # each phase's peak on its own: where a GPU's peak is, the training run's or the bench's extras'
        assert r["phases"] == ["first update", "saved-activations forward", "setup", "updates"], flow
    fp8 = rows["fp8-unified"]
    assert set(fp8["resolved"]) == {"fprop", "dgrad", "wgrad"} and fp8["fallbacks"] == []
    for g, res in fp8["resolved"].items():
        assert "scaled_mm" not in res["rejected"], (g, res)
        assert "scaled_mm" in [res["backend"], *res["fallback_order"]], (g, res)


def test_bench_rollout_runs_every_engine_row(report):
    rows = report["bench_rollout"]
    assert set(rows) == {f"{w} {f}" for w in ("fixed", "task") for f in ("bf16", "fp8-rollout", "int8-rollout")}
    for name, r in rows.items():
        assert {"tokens_per_s", "ttft_s", "sync_s", "kv_bytes_per_token", "weight_bytes", "peak_memory_bytes",
                "vs_bf16"} <= set(r["keys"]), name
        assert r["cuda_graphs"].startswith("capture failed"), name  # no capture on fake tensors: eager, and said


def test_rl_loop_runs_on_the_device_and_reads_only_where_its_parts_do(report):
    allowed = ("done.tolist()", "_completions(", "token_logprobs(model, mb, sampling, entropy).float().cpu()",
               "torch.stack([t.float() for t in flat]", "bool(finite.all())",
               "err = float((got - ref).norm()")  # the last: auto's probe, once per GEMM spec
    assert set(report["run"]) == {"fp8-unified", "fp8-unified+kl", "fp8-unified+lora", "bf16", "int8-rollout-tis",
                                  "gpu-qwen2.5-1.5b-gsm8k-fp8-unified", "gpu-qwen2.5-1.5b-gsm8k-fp8-rollout-tis"}
    for preset, r in report["run"].items():
        assert r["steps"] == [0, 1, 2], preset  # step 0: the eval before training
        assert {"mismatch_kl", "frac_bitwise_equal", "loss", "grad_norm", "sync_s", "rollout_s"} <= set(r["keys"])
        odd = [k for k in r["reads"] if not any(a in k for a in allowed)]
        assert odd == [], (preset, odd)
