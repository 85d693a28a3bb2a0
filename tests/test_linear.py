"""The FP8 linear layer: three GEMMs against float64 references, one forward path, the swap."""

import pytest
import torch
from torch import nn

from jetrl_cli.errors import JetrlError
from jetrl_cli.precision import (
    CastSpec,
    GemmSpec,
    JetLinear,
    LinearPrecision,
    apply_flow,
    error_stats,
    fake_quantize,
    named_flow,
    quantize,
    swap_linears,
)
from jetrl_cli.precision.formats import Block, Format

from .conftest import fresh_seed

# Odd shapes on purpose: K and N not multiples of 128, tokens not a multiple of 128.
SHAPES = [(37, 200, 72), (130, 256, 384), (5, 96, 40)]


def fp32_out(prec: LinearPrecision) -> LinearPrecision:
    """Same operand casts, but every GEMM writes fp32: isolates the GEMM from output rounding."""
    def g(s):
        return GemmSpec(s.a, s.b, Format.FP32, s.backend)
    return LinearPrecision(g(prec.fprop), g(prec.dgrad), g(prec.wgrad), prec.save_fp8_activations)


def run_layer(prec, x, w, b, gy):
    x = x.clone().requires_grad_(True)
    wp, bp = nn.Parameter(w.clone()), nn.Parameter(b.clone())
    layer = JetLinear(wp, bp, prec)
    y = layer(x)
    y.backward(gy)
    return y.detach(), x.grad, wp.grad, bp.grad


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("flow", ["fp8-unified", "bf16"])
def test_each_gemm_is_its_operands_cast_then_multiplied_exactly(flow, m, k, n):
    """Fprop, Dgrad, Wgrad each equal float64(cast(a) @ cast(b)) up to fp32 accumulation."""
    prec = fp32_out(named_flow(flow).train.linear)
    x, w, b, gy = torch.randn(m, k), torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(m, n)
    y, gx, gw, gb = run_layer(prec, x, w, b, gy)
    d = torch.float64
    y_ref = fake_quantize(x, prec.fprop.a).to(d) @ fake_quantize(w, prec.fprop.b).to(d).T + b.to(d)
    gx_ref = fake_quantize(gy, prec.dgrad.a).to(d) @ fake_quantize(w, prec.dgrad.b).to(d)
    gw_ref = fake_quantize(gy, prec.wgrad.a).to(d).T @ fake_quantize(x, prec.wgrad.b).to(d)
    for got, ref in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert error_stats(ref, got)["rel_err"] < 2e-6
    assert torch.allclose(gb.double(), gy.double().sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_unified_fp8_against_float64_reference(m, k, n):
    """The true (unquantized) float64 products: stated SQNR floors for each GEMM."""
    prec = named_flow("fp8-unified").train.linear
    x, w, b, gy = torch.randn(m, k), torch.randn(n, k) / k**0.5, torch.zeros(n), torch.randn(m, n)
    y, gx, gw, _ = run_layer(prec, x, w, b, gy)
    d = torch.float64
    stats = {
        "fprop": error_stats(x.to(d) @ w.to(d).T, y),
        "dgrad": error_stats(gy.to(d) @ w.to(d), gx),
        "wgrad": error_stats(gy.to(d).T @ x.to(d), gw),
    }
    for name, s in stats.items():
        assert s["sqnr_db"] > 25.0, (name, s)  # E4M3 with fine scales: ~28-31 dB measured
        assert s["rel_err"] < 0.06, (name, s)


def test_bf16_flow_matches_float64_closely():
    prec = named_flow("bf16").train.linear
    x, w, gy = torch.randn(64, 256), torch.randn(96, 256) / 16, torch.randn(64, 96)
    y, gx, gw, _ = run_layer(prec, x, w, torch.zeros(96), gy)
    d = torch.float64
    assert error_stats(x.to(d) @ w.to(d).T, y)["sqnr_db"] > 45
    assert error_stats(gy.to(d) @ w.to(d), gx)["sqnr_db"] > 45
    assert error_stats(gy.to(d).T @ x.to(d), gw)["sqnr_db"] > 45


def test_fp32_precision_gradients_match_autograd_of_nn_linear():
    """gradcheck-style: with fp32 everywhere the custom backward equals autograd's."""
    hp = CastSpec("fp32")
    g = GemmSpec(hp, hp, Format.FP32)
    prec = LinearPrecision(g, g, g)
    x, w, b, gy = torch.randn(9, 33), torch.randn(17, 33), torch.randn(17), torch.randn(9, 17)
    y, gx, gw, gb = run_layer(prec, x, w, b, gy)
    xr = x.double().requires_grad_(True)
    wr, br = w.double().requires_grad_(True), b.double().requires_grad_(True)
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(gy.double())
    for got, ref in ((y, yr), (gx, xr.grad), (gw, wr.grad), (gb, br.grad)):
        assert torch.allclose(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_each_gemm_follows_its_own_spec():
    """Changing one GEMM's spec changes that GEMM's result and no other."""
    base = named_flow("fp8-unified").train.linear
    bf = CastSpec("bf16")
    x, w, b, gy = torch.randn(40, 256), torch.randn(128, 256) / 16, torch.randn(128), torch.randn(40, 128)
    ref = run_layer(base, x, w, b, gy)
    variants = {
        0: LinearPrecision(GemmSpec(bf, bf, Format.BF16), base.dgrad, base.wgrad, True),
        1: LinearPrecision(base.fprop, GemmSpec(bf, bf, Format.BF16), base.wgrad, True),
        2: LinearPrecision(base.fprop, base.dgrad, GemmSpec(bf, bf, Format.FP32), False),
    }
    for changed, prec in variants.items():
        out = run_layer(prec, x, w, b, gy)
        for i in range(3):
            same = torch.equal(out[i], ref[i])
            assert same == (i != changed), (changed, i)


@pytest.mark.parametrize("flow", ["fp8-unified", "fp8-rollout", "int8-rollout", "bf16"])
def test_same_forward_in_train_eval_and_no_grad(flow):
    f = named_flow(flow)
    layer = nn.Sequential(nn.Linear(256, 192), nn.Linear(192, 64))
    for side in ("train", "rollout"):
        apply_flow(layer, f.__class__(**{**f.__dict__, "skip": ()}), side)
        x = torch.randn(3, 11, 256)
        layer.train()
        y_train = layer(x)
        layer.eval()
        y_eval = layer(x)
        with torch.no_grad():
            y_nograd = layer(x)
        with torch.inference_mode():
            y_inf = layer(x)
        assert torch.equal(y_train, y_eval) and torch.equal(y_eval, y_nograd) and torch.equal(y_nograd, y_inf)


def test_unified_rollout_and_training_forward_are_bitwise_equal():
    f = named_flow("fp8-unified")
    train_side, rollout_side = nn.Sequential(nn.Linear(300, 130)), nn.Sequential(nn.Linear(300, 130))
    rollout_side.load_state_dict(train_side.state_dict())
    swap_linears(train_side, f.train.linear, ())
    swap_linears(rollout_side, f.rollout_linear(), ())
    assert isinstance(train_side[0], JetLinear) and isinstance(rollout_side[0], JetLinear)
    x = torch.randn(7, 300)
    with torch.no_grad():
        y_rollout = rollout_side(x)
    assert torch.equal(train_side(x), y_rollout)


def test_off_policy_flow_rollout_differs_from_training():
    f = named_flow("fp8-rollout")
    lin = nn.Linear(256, 128)
    seq = nn.Sequential(lin)
    x = torch.randn(8, 256)
    apply_flow(seq, f.__class__(**{**f.__dict__, "skip": ()}), "train")
    y_train = seq(x)
    apply_flow(seq, f.__class__(**{**f.__dict__, "skip": ()}), "rollout")
    assert not torch.equal(seq(x), y_train)


def test_saved_fp8_activations_give_the_same_gradients_and_save_fp8():
    base = named_flow("fp8-unified").train.linear
    unsaved = LinearPrecision(base.fprop, base.dgrad, base.wgrad, False)
    x, w, b, gy = torch.randn(50, 256), torch.randn(64, 256) / 16, torch.randn(64), torch.randn(50, 64)
    a, c = run_layer(base, x, w, b, gy), run_layer(unsaved, x, w, b, gy)
    for i in range(4):
        assert torch.equal(a[i], c[i])
    # what the autograd graph holds: no high-precision copy of x
    xg = x.clone().requires_grad_(True)
    layer = JetLinear(nn.Parameter(w.clone()), None, base)
    y = layer(xg)
    saved = [t for t in y.grad_fn.saved_tensors]
    assert all(t.data_ptr() != xg.data_ptr() for t in saved)
    assert [t.dtype for t in saved] == [torch.float8_e4m3fn, torch.float32]  # x^T in fp8, its scales
    # Wgrad's operand in its final layout: x^T (K x tokens), one scale per 128 tokens of each feature
    ref = quantize(x, CastSpec("fp8_e4m3", "128x1")).t()
    assert saved[0].shape == (256, 50) and saved[1].shape == (256, 1)
    assert torch.equal(saved[0].view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(saved[1], ref.scale)


def test_weight_cache_follows_in_place_updates():
    f = named_flow("fp8-unified")
    layer = JetLinear(nn.Parameter(torch.randn(64, 128)), None, f.train.linear)
    x = torch.randn(4, 128)
    y1 = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    y2 = layer(x)
    assert not torch.equal(y1, y2)
    fresh = JetLinear(nn.Parameter(layer.weight.detach().clone()), None, f.train.linear)
    assert torch.equal(fresh(x), y2)


def test_swap_shares_parameters_respects_skip_list_and_prints_precision():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(10, 128)
            self.q_proj = nn.Linear(128, 128)
            self.mlp = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
            self.norm = nn.LayerNorm(128)
            self.lm_head = nn.Linear(128, 10, bias=False)

    m = Tiny()
    params_before = {n: p for n, p in m.named_parameters()}
    f = named_flow("fp8-unified")
    rep = apply_flow(m, f, "train")
    assert rep.quantized == ["q_proj", "mlp.0", "mlp.1"]
    assert rep.skipped == ["lm_head"]
    assert rep.unmatched_patterns == []
    assert isinstance(m.q_proj, JetLinear) and isinstance(m.lm_head, JetLinear)
    assert m.q_proj.precision.is_quantized and not m.lm_head.precision.is_quantized
    assert m.lm_head.precision == LinearPrecision.unquantized(Format.BF16)  # the flow's skip_format
    for n, p in m.named_parameters():
        assert p is params_before[n]
    text = repr(m)
    assert "fprop=e4m3[1x128]xe4m3[128x128]->bf16" in text and "wgrad=e4m3[128x1]xe4m3[128x1]->fp32" in text
    # the same swap on the rollout side quantizes the very same modules
    rep2 = apply_flow(m, f, "rollout")
    assert rep2.quantized == rep.quantized and rep2.skipped == rep.skipped
    rep3 = swap_linears(Tiny(), f.train.linear, ("nonexistent_proj",))
    assert rep3.unmatched_patterns == ["nonexistent_proj"]


@pytest.mark.parametrize("spec", ["fp8_e4m3 row", "fp8_e4m3 tensor", "int8 row"])
def test_scaled_mm_backend_matches_emulated(spec):
    fmt, block = spec.split()
    cs = CastSpec(fmt, block)
    emu = GemmSpec(cs, cs, Format.FP32, "emulated")
    smm = GemmSpec(cs, cs, Format.FP32, "scaled_mm")
    _skip_unless_cpu_scaled_mm_runs(smm)
    x, w = torch.randn(33, 256), torch.randn(48, 256)
    lin_e = JetLinear(nn.Parameter(w.clone()), None, LinearPrecision.forward_only(emu))
    lin_s = JetLinear(nn.Parameter(w.clone()), None, LinearPrecision.forward_only(smm))
    with torch.no_grad():
        ye, ys = lin_e(x), lin_s(x)
    assert error_stats(ye, ys)["rel_err"] < 1e-6


def _skip_unless_cpu_scaled_mm_runs(spec, gemm_name="fprop"):
    """torch 2.11's CPU scaled_mm takes per-tensor scales only (2.13's takes row-wise too)."""
    from jetrl_cli.precision.gemm import get_backend

    why = get_backend("scaled_mm").unsupported(spec, gemm_name, torch.device("cpu"))
    if why is not None:
        pytest.skip(why)


def test_backend_that_cannot_run_a_spec_is_a_clear_error():
    cs = CastSpec("fp8_e4m3", "1x64")
    with pytest.raises(JetrlError, match="scaled_mm needs per-tensor or per-row scales .* or the blockwise recipes"):
        JetLinear(nn.Parameter(torch.randn(8, 128)), None,
                  LinearPrecision.forward_only(GemmSpec(cs, CastSpec("fp8_e4m3", "128x128"), Format.BF16, "scaled_mm")))
    with pytest.raises(JetrlError, match="backend triton runs FP8 operands with 1x128 or 128x128"):
        JetLinear(nn.Parameter(torch.randn(8, 128)), None,
                  LinearPrecision.forward_only(GemmSpec(CastSpec("fp8_e4m3", "row"), CastSpec("fp8_e4m3", "128x128"),
                                                        Format.BF16, "triton")))
    with pytest.raises(JetrlError, match="backend te is not available: no Transformer Engine integration"):
        JetLinear(nn.Parameter(torch.randn(8, 128)), None,
                  LinearPrecision.forward_only(GemmSpec(CastSpec("fp8_e4m3", "1x128"), CastSpec("fp8_e4m3", "128x128"),
                                                        Format.BF16, "te")))
    bf16 = CastSpec(Format.BF16)
    for backend in ("triton", "scaled_mm", "emulated"):  # ignored before: torch's matmul runs a bf16 GEMM
        with pytest.raises(JetrlError, match=f"backend {backend} runs 8-bit GEMMs only"):
            JetLinear(nn.Parameter(torch.randn(8, 128)), None,
                      LinearPrecision.forward_only(GemmSpec(bf16, bf16, Format.BF16, backend)))
    with pytest.raises(JetrlError, match="backend te is not available"):
        JetLinear(nn.Parameter(torch.randn(8, 128)), None, LinearPrecision.forward_only(GemmSpec(bf16, bf16,
                                                                                                  Format.BF16, "te")))


def test_blockwise_scaled_mm_is_refused_on_cpu_at_first_use():
    """Blockwise FP8 through torch's scaled_mm runs on Hopper GPUs; named explicitly on a CPU it is a
    one-line error when the layer first runs (``auto`` would pick the emulated reference instead)."""
    spec = GemmSpec(CastSpec("fp8_e4m3", "1x128"), CastSpec("fp8_e4m3", "128x128"), Format.BF16, "scaled_mm")
    layer = JetLinear(nn.Parameter(torch.randn(128, 128)), None, LinearPrecision.forward_only(spec))
    with pytest.raises(JetrlError, match="backend scaled_mm cannot run .* on cpu: blockwise FP8 runs on CUDA GPUs only"):
        layer(torch.randn(4, 128))


def test_triton_backend_unavailable_without_gpu_or_interpreter(monkeypatch):
    from jetrl_cli.precision import gemm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = named_flow("fp8-unified").train.linear.fprop
    why = gemm.get_backend("triton").unsupported(spec, "fprop", torch.device("cpu"))
    assert why is not None and "the Triton kernels need a CUDA GPU" in why
    gemm.reset_resolutions()
    with pytest.raises(JetrlError, match="backend triton cannot run .* need a CUDA GPU"):
        gemm.resolve(GemmSpec(spec.a, spec.b, spec.out, "triton"), "fprop", "cpu")
    gemm.reset_resolutions()


def test_non_finite_input_propagates_as_nan_not_garbage():
    layer = JetLinear(nn.Parameter(torch.randn(16, 256)), None, named_flow("fp8-unified").train.linear)
    x = torch.randn(4, 256)
    x[1, 3] = float("inf")
    y = layer(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


def test_scaled_mm_in_backward_gemms_follows_the_reduction_dim():
    """Dgrad reduces over N: a per-output-channel weight scale varies along it and cannot factor out;
    Wgrad reduces over tokens: per-column (natural layout) scales are its row-wise scales."""
    row, col = CastSpec("fp8_e4m3", "row"), CastSpec("fp8_e4m3", "col")
    fwd = GemmSpec(row, row, Format.FP32, "scaled_mm")
    bad_dgrad = GemmSpec(row, row, Format.FP32, "scaled_mm")
    with pytest.raises(JetrlError, match=r"precision.dgrad: backend scaled_mm needs per-tensor or per-row scales"):
        JetLinear(nn.Parameter(torch.randn(64, 64)), None, LinearPrecision(fwd, bad_dgrad, fwd))
    good = LinearPrecision(fwd, GemmSpec(row, col, Format.FP32, "scaled_mm"), GemmSpec(col, col, Format.FP32, "scaled_mm"))
    for g in ("fprop", "dgrad", "wgrad"):
        _skip_unless_cpu_scaled_mm_runs(getattr(good, g), g)
    emu = LinearPrecision(*(GemmSpec(g.a, g.b, g.out, "emulated") for g in (good.fprop, good.dgrad, good.wgrad)))
    x, w, gy = torch.randn(48, 64), torch.randn(80, 64), torch.randn(48, 80)
    for got, ref in zip(run_layer(good, x, w, torch.zeros(80), gy), run_layer(emu, x, w, torch.zeros(80), gy)):
        assert error_stats(ref, got)["rel_err"] < 1e-6


@pytest.mark.parametrize("flow", ["fp8-unified", "bf16"])
def test_changed_weights_are_copied_into_the_cached_gemm_operand(flow):
    """An optimizer step or a weight sync refreshes the cached (concatenated, quantized) weight in
    place: the same tensors, the new values (what keeps a captured CUDA graph valid)."""
    from jetrl_cli.precision.gemm import ExactOperand
    from jetrl_cli.precision.linear import group_weight, linear_group

    g = torch.Generator().manual_seed(fresh_seed())
    prec = named_flow(flow).train.linear
    mods = [JetLinear(nn.Parameter(torch.randn(n, 128, generator=g) / 12), None, prec) for n in (128, 256)]
    owner = nn.Module()
    x = torch.randn(5, 128, generator=g)
    with torch.no_grad():
        linear_group(mods, x, owner)
        w0, _ = group_weight(mods, owner)
        def ptrs(w):
            return [w.values.data_ptr(), w.scales.data_ptr()] if isinstance(w, ExactOperand) else [w.data_ptr()]

        tensors = ptrs(w0)
        for m in mods:
            m.weight.mul_(1.5)
        y = linear_group(mods, x, owner)
        w1, _ = group_weight(mods, owner)
        now = ptrs(w1)
        fresh = [JetLinear(nn.Parameter(m.weight.detach().clone()), None, prec) for m in mods]
        assert w1 is w0 and now == tensors
        assert torch.equal(y, linear_group(fresh, x, nn.Module()))


def test_cached_operands_are_refreshed_in_place_only_when_of_the_same_kind():
    """A group weight is updated in place only by an operand of the same kind: an FP8 exact operand
    must not be copied into a dense one of the same shape (a layer switched precision)."""
    from jetrl_cli.precision.gemm import ExactOperand, exact_operand
    from jetrl_cli.precision.linear import copy_operand_

    w = torch.randn(256, 128)
    fp8 = exact_operand(quantize(w, CastSpec(Format.FP8_E4M3, Block(128, 128))))
    dense = ExactOperand(w.double(), torch.ones(256, 1, dtype=torch.float64), 128, Format.BF16)
    assert fp8.values.shape == dense.values.shape and fp8.scales.shape == dense.scales.shape
    assert not copy_operand_(dense, fp8)
    same = exact_operand(quantize(torch.randn(256, 128), CastSpec(Format.FP8_E4M3, Block(128, 128))))
    assert copy_operand_(fp8, same) and torch.equal(fp8.values, same.values)
