"""`jetrl mismatch-report`: its statistics by hand, its agreement with the trainer's logs, and the
report on the tiny policy (unified and bf16 flows on-policy, fp8-rollout not, every layer listed)."""

import io
import json
import math

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from jetrl_cli.cli import app
from jetrl_cli.config import load_job_config
from jetrl_cli.errors import JetrlError
from jetrl_cli.precision.flow import parse_flow
from jetrl_cli.rl import mismatch as mm
from jetrl_cli.rl.algos import CorrectionConfig, mismatch_metrics
from jetrl_cli.rl.loop import run

from .conftest import fresh_seed

runner = CliRunner()
SMALL = ["rollout.prompts_per_step=4", "rollout.n=2"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def sets(items):
    return [x for it in items for x in ("--set", it)]


def _by_hand(lt, lr, mask, cfg):
    """mismatch_metrics in plain Python, token by token."""
    toks, seqs = [], []
    for i in range(lt.shape[0]):
        s = [(float(lt[i, j]), float(lr[i, j])) for j in range(lt.shape[1]) if mask[i, j]]
        toks += s
        if s:
            seqs.append(sum(a - b for a, b in s))
    d = [a - b for a, b in toks]
    r = [math.exp(x) for x in d]
    n = len(d)
    return {
        "mismatch_kl": sum(x - 1 - y for x, y in zip(r, d)) / n,
        "mismatch_k1": -sum(d) / n,
        "abs_dlogp_mean": sum(abs(x) for x in d) / n,
        "abs_dlogp_max": max(abs(x) for x in d),
        "abs_dp_mean": sum(abs(math.exp(a) - math.exp(b)) for a, b in toks) / n,
        "abs_dp_max": max(abs(math.exp(a) - math.exp(b)) for a, b in toks),
        "prob_err": sum(math.exp(abs(x)) - 1 for x in d) / n,
        "chi2": sum((x - sum(r) / n) ** 2 for x in r) / n / (sum(r) / n) ** 2,
        "ess": sum(r) ** 2 / (n * sum(x * x for x in r)),
        "frac_above_tis_cap": sum(x > cfg.tis_cap for x in r) / n,
        "frac_outside_mis": sum(x < cfg.mis_low or x > cfg.mis_high for x in r) / n,
        "seq_log_ratio_mean": sum(seqs) / len(seqs),
        "seq_log_ratio_abs_max": max(abs(x) for x in seqs),
        "tokens": n,
    }


def test_every_mismatch_statistic_against_plain_python():
    g = torch.Generator().manual_seed(fresh_seed())
    lr = -torch.rand(6, 9, generator=g) * 3
    lt = lr + torch.randn(6, 9, generator=g) * 0.8
    lt[0, :4] = lr[0, :4]  # some bitwise-equal tokens
    mask = torch.rand(6, 9, generator=g) > 0.3
    mask[2] = False  # a sequence with no completion tokens
    mask[1, 0] = True
    cfg = CorrectionConfig("tis", tis_cap=1.5, mis_low=0.7, mis_high=1.4)
    got = mismatch_metrics(lt, lr, mask, cfg)
    want = _by_hand(lt, lr, mask, cfg)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_chi2_is_never_negative_and_agrees_with_ess():
    """The plain mean(r^2) - 1 goes negative when the batch's weights are all below 1 (as reported
    for fp8-rollout, -3.45e-05); the self-normalised estimate cannot."""
    mask = torch.ones(2, 4, dtype=torch.bool)
    lr = torch.zeros(2, 4)
    lt = torch.full((2, 4), -0.01)  # every r = exp(-0.01) < 1: mean(r^2) - 1 = -0.0198
    lt[0, 0] = -0.02
    m = mismatch_metrics(lt, lr, mask)
    r = torch.tensor([math.exp(-0.02)] + [math.exp(-0.01)] * 7, dtype=torch.float64)
    assert float((r * r).mean() - 1) < 0  # what the old estimator reported
    assert m["chi2"] == pytest.approx(float(r.var(unbiased=False) / r.mean() ** 2), rel=1e-9) and m["chi2"] > 0
    assert 1 / (1 + m["chi2"]) == pytest.approx(m["ess"], rel=1e-12)
    assert mismatch_metrics(lt.fill_(-0.01), lr, mask)["chi2"] == 0.0  # equal weights: exactly 0
    g = torch.Generator().manual_seed(fresh_seed())
    for _ in range(20):
        lt = -torch.rand(3, 16, generator=g) * 0.05  # pi_train below pi_rollout everywhere
        assert mismatch_metrics(lt, torch.zeros(3, 16), torch.ones(3, 16, dtype=torch.bool))["chi2"] >= 0


def test_positions_buckets_and_divergence_by_hand():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    assert mm.completion_positions(mask).tolist() == [[-1, 0, 1, 2, -1], [0, 1, -1, -1, -1]]
    assert mm.bucket_edges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert mm.bucket_edges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    lr = torch.zeros(2, 5)
    lt = torch.tensor([[0.0, 0.5, 0.0, -0.2, 9.0], [0.1, 0.0, 9.0, 9.0, 9.0]])
    rows = mm.by_position(lt, lr, mask, CorrectionConfig(), buckets=3)
    assert [(r["lo"], r["hi"], r["tokens"]) for r in rows] == [(0, 1, 2), (1, 2, 2), (2, 3, 1)]
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    assert rows[0]["mismatch_kl"] == pytest.approx((k3(0.5) + k3(0.1)) / 2)
    assert rows[1]["mismatch_kl"] == 0.0 and rows[1]["frac_bitwise_equal"] == 1.0
    assert rows[2]["mismatch_kl"] == pytest.approx(k3(-0.2))
    assert mm.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert mm.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert mm.first_divergence([1, 2], [1, 2, 3]) == 2
    st = mm.divergence_stats([[1, 2, 3], [1, 2, 3], [4]], [[1, 2, 3], [1, 2, 0], [5]])
    assert st == {"sequences": 3, "diverged_frac": pytest.approx(2 / 3), "first_min": 0, "first_median": 2}


def test_verdicts_and_gates():
    eq = mismatch_metrics(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool))
    assert mm.verdict(eq)[0] == "on-policy"
    small = mismatch_metrics(torch.full((1, 3), 1e-4), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool))
    assert mm.verdict(small)[0] == "near"
    big = mismatch_metrics(torch.full((1, 3), 0.3), torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool))
    assert mm.verdict(big)[0] == "drift"
    flows = [{"flow": "a", "summary": eq}, {"flow": "b", "summary": big}]
    assert mm.gate_failures(flows, {"mismatch_kl": 1e-6}) == [f"b: mismatch_kl = {big['mismatch_kl']:.4g} > 1e-06"]
    assert mm.gate_failures(flows, {"mismatch_kl": 1.0}) == []


def test_trainer_view_decodes_with_the_training_precision():
    f = parse_flow("fp8-rollout")
    v = mm.trainer_view(f)
    assert v.rollout.linear == f.train.linear.fprop and v.kv_cast("rollout") == f.kv_cast("train")
    u = parse_flow("fp8-unified")
    assert mm.trainer_view(u).rollout == u.rollout  # unified: the trainer's forward is the rollout's


def test_report_numbers_equal_the_trainers_logs(tmp_path):
    """Offline report on a run's step-1 samples == that step's mismatch columns in metrics.jsonl."""
    cfg = load_job_config("fp8-rollout", SMALL + ["train.steps=1", "eval.prompts=4", "rollout.max_new_tokens=24"])
    lines = run(cfg, tmp_path / "run")
    logged = lines[-1]
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", tmp_path / "run" / "rollouts.jsonl", "--step", 1,
                 "--no-attribution", "--json", *sets(SMALL + ["rollout.max_new_tokens=24"]))
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    s = rep["flows"][0]["summary"]
    assert s["mismatch_kl"] > 0
    for k, v in s.items():
        assert logged[k] == v, k  # the same function on the same tensors: exactly equal


def test_report_on_the_tiny_policy(tmp_path, monkeypatch):
    passes: list[list] = []  # per attributed flow, in order: (done, total) of every scoring pass
    attribute = mm.layer_attribution

    def counting(*args):  # the attribution's progress callback, as the progress bar sees it
        *rest, on_pass = args
        passes.append([])
        return attribute(*rest, lambda what, done, total: (passes[-1].append((done, total)),
                                                            on_pass and on_pass(what, done, total)))

    monkeypatch.setattr(mm, "layer_attribution", counting)
    res = invoke("mismatch-report", "fp8-rollout", "--flows", "preset,bf16,fp8-unified", "--lengths", "6,12",
                 "--prompts", 3, "--attribution-sequences", 4, "--attribution-layers", 1, "--json",
                 "--out", tmp_path / "rep", *sets(SMALL))
    assert res.exit_code == 0, res.output
    assert res.stderr.strip(), "progress goes to stderr with --json too"
    rep = json.loads(res.stdout)
    flows = {f["flow"]: f for f in rep["flows"]}
    assert list(flows) == ["fp8-rollout", "bf16", "fp8-unified"]
    for name in ("bf16", "fp8-unified"):
        f = flows[name]
        assert f["status"] == "on-policy" and f["summary"]["mismatch_kl"] == 0.0
        assert f["summary"]["frac_bitwise_equal"] == 1.0 and f["top_tokens"] == []
        assert all(r["mismatch_kl"] == 0.0 for r in f["by_length"] + f["by_position"])
        assert f["greedy"]["vs_train"]["diverged_frac"] == 0.0
        assert f["decode_vs_forward"]["first_divergent"] is None and f["decode_vs_forward"]["positions"] > 0
        assert all(r["rel_diff"] == 0.0 and r["kl_alone"] is None for r in f["layers"])
        assert [d["kl_alone"] for d in f["decoder_layers"]] == [0.0] * 4 and f["refined_layers"] == []
        assert passes[list(flows).index(name)][-1] == (4, 4)  # one pass per decoder layer, none refined
    off = flows["fp8-rollout"]
    assert off["status"] == "drift" and off["summary"]["mismatch_kl"] > 0
    assert off["decode_vs_forward"]["first_divergent"] == "decoder layer 0"  # FP8 GEMMs in rollout only
    assert [r["length"] for r in off["by_length"]] == [6, 12] and off["by_length"][1]["tokens"] == 3 * 2 * 12
    assert off["rollout_vs_fp32"]["mismatch_kl"] > 0 and off["top_tokens"]
    # coarse to fine: each of the 4 decoder layers alone, then the 7 linears of the worst one alone
    dec = {d["layer"]: d["kl_alone"] for d in off["decoder_layers"]}
    assert sorted(dec) == [0, 1, 2, 3] and max(dec.values()) > 0
    worst = max(dec, key=dec.get)
    assert off["refined_layers"] == [worst] and passes[0][-1] == (4 + 7, 4 + 7)
    alone = {r["name"]: r["kl_alone"] for r in off["layers"] if r["kl_alone"] is not None}
    assert sorted(alone) == sorted(r["name"] for r in off["layers"] if r["name"].startswith(f"model.layers.{worst}."))
    assert len(alone) == 7 and any(v > 0 for v in alone.values())
    assert off["top_layer"] == max(alone, key=alone.get)
    # every quantized layer gets its output error: 7 linears in each of the tiny policy's 4 layers
    names = [r["name"] for r in off["layers"]]
    assert len(names) == 28 and "model.layers.3.mlp.down_proj" in names and "lm_head" not in names
    assert all(r["rel_err_rollout"] > r["rel_err_train"] > 0 for r in off["layers"])  # fp8 vs bf16, both vs fp32
    assert len(off["hidden"]) == 4
    for p in ("report.md", "report.json", "drift_vs_position.png", "layer_error.png"):
        assert (tmp_path / "rep" / p).stat().st_size > 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert f"**fp8-rollout** ({off['description']}): {off['verdict']}" in md
    assert f"| {worst} | {mm._fmt(dec[worst])} |" in md  # the decoder-layer table
    # the tables as `jetrl mismatch-report ... | cat` prints them: 80 columns, no number cut
    con = Console(width=80, file=io.StringIO())
    mm.render(rep, con)
    text = con.file.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines()), text
    for f in flows.values():
        for r in f["by_position"]:  # the "KL by position" row that read "0.00… │ 8.10… │ 4.77…"
            assert mm._fmt(r["mismatch_kl"]) in text
        assert mm._fmt(f["summary"]["chi2"]) in text and f["summary"]["chi2"] >= 0
    assert mm._fmt(alone[off["top_layer"]]) in text and mm.short_name(off["top_layer"]) in text


def test_kl_plots_have_no_negative_ticks():
    """KL is non-negative: the symlog axes start at 0 instead of mirroring below it."""
    pytest.importorskip("matplotlib")
    from jetrl_cli.rl.plots import curves_figure

    flows = [{"flow": name, "by_position": [{"lo": 4 * i, "hi": 4 * i + 4, "mismatch_kl": kl * i, "abs_dlogp_mean": kl}
                                            for i in range(8)]} for name, kl in (("a", 0.0), ("b", 3e-4))]
    runs = [(name, [{"step": s, "reward_mean": 0.5, "mismatch_kl": kl * s} for s in range(1, 6)])
            for name, kl in (("a", 0.0), ("b", 2e-3))]
    for ax in (mm.drift_figure(flows).axes[0], curves_figure(runs).axes[2]):
        lo, hi = ax.get_ylim()
        assert lo == 0 and hi > 0
        assert all(t >= 0 for t in ax.get_yticks() if lo <= t <= hi)


def test_fail_above_is_a_ci_gate(tmp_path):
    common = ["--lengths", "8", "--prompts", 2, "--no-attribution", "--fail-above", "mismatch_kl=1e-9", *sets(SMALL)]
    res = invoke("mismatch-report", "fp8-rollout", "--flows", "fp8-unified", *common)
    assert res.exit_code == 0, res.output
    res = invoke("mismatch-report", "fp8-rollout", "--flows", "preset", *common)
    assert res.exit_code == 4
    assert "fp8-rollout: mismatch_kl" in res.stderr and "Traceback" not in res.output


def _rollout_file(tmp_path):
    out = tmp_path / "r.jsonl"
    assert invoke("rollout", "fp8-rollout", "-o", out, "--prompts", 2, *sets(["rollout.n=2"])).exit_code == 0
    return out


@pytest.mark.parametrize("args, msg", [
    (["--flows", "fp9-magic"], "unknown flow 'fp9-magic'"),
    (["--lengths", "0"], "--lengths: 0 must be > 0"),
    (["--lengths", "-5,8"], "--lengths: -5 must be > 0"),
    (["--lengths", "ten"], "--lengths: 'ten' is not an integer"),
    (["--fail-above", "kl"], "--fail-above 'kl': expected METRIC=VALUE"),
    (["--fail-above", "mismatch_kl=high"], "'high' is not a number"),
    (["--prompts", "0"], "--prompts must be > 0"),
])
def test_bad_arguments_are_one_line_errors(args, msg):
    res = invoke("mismatch-report", "fp8-rollout", *args)
    assert res.exit_code == 2
    assert msg in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_bad_rollout_files_are_one_line_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", empty)
    assert res.exit_code == 2 and "empty" in res.stderr
    good = _rollout_file(tmp_path)
    rows = [json.loads(x) for x in good.read_text().splitlines()]
    rows[1]["tokens"][0] = 50_000  # written with another model's vocabulary
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", other)
    assert res.exit_code == 2 and "token id 50000 is out of range" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", good, "--step", 7)
    assert res.exit_code == 2 and "no samples of step 7" in res.stderr
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", good, "--no-attribution", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["flows"][0]["summary"]["mismatch_kl"] > 0
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", good, "--fail-above", "greedy_diverged_frac=0.5")
    assert res.exit_code == 2 and "greedy decoding is not measured on saved samples" in res.stderr


def test_a_gate_passes_only_on_a_measured_number_within_its_limit(tmp_path, monkeypatch):
    """``--fail-above``: a NaN metric, or one the report did not measure, fails its gate (it used to pass),
    and a limit that is not a finite number is refused."""
    flows = [{"flow": "f", "summary": {"mismatch_kl": float("nan"), "chi2": 0.5, "prob_err": 1e-3}}]
    assert mm.gate_failures(flows, {"mismatch_kl": 1e-6, "chi2": 1.0, "prob_err": 1e-4, "abs_dp_max": 1.0}) == [
        "f: mismatch_kl is nan", "f: prob_err = 0.001 > 0.0001", "f: abs_dp_max was not measured"]
    for limit in ("nan", "inf"):
        with pytest.raises(JetrlError, match="the limit must be a finite number"):
            mm.parse_gates([f"mismatch_kl={limit}"])

    def no_matplotlib(report, out):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(mm, "_plots", no_matplotlib)  # as without matplotlib: the report says so
    good = _rollout_file(tmp_path)
    res = invoke("mismatch-report", "fp8-rollout", "--rollouts", good, "--no-attribution", "--out", tmp_path / "rep",
                 "--fail-above", "mismatch_kl=1e-12")
    assert res.exit_code == 4, res.output
    assert "no plots: they need matplotlib (pip install 'jetrl[plot]')" in res.stderr
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["report.json", "report.md"]


def test_decode_steps_are_compared_with_the_trainer_forward_stage_by_stage():
    """``divergence.decode_divergence``: on-policy flows agree at every stage; when one stage
    computes differently (here: one decoder layer's rollout GEMMs in another precision) it is that
    stage the report names."""
    import copy

    import torch

    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import apply_flow, named_flow
    from jetrl_cli.rl.divergence import decode_divergence

    base = random_model(tiny_config("qwen2", hidden=128, layers=3, vocab=128), seed=4, std=0.05)
    g = torch.Generator().manual_seed(fresh_seed())
    prompts = [torch.randint(1, 128, (int(k),), generator=g).tolist() for k in (3, 7, 5)]
    comps = [torch.randint(1, 128, (9,), generator=g).tolist() for _ in prompts]
    flow = named_flow("fp8-unified")
    roll, train = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    apply_flow(roll, flow, "rollout")
    apply_flow(train, flow, "train")
    d = decode_divergence(roll, train, prompts, comps, SamplingParams(), 32)
    assert d["first_divergent"] is None and d["positions"] == 3 * 9
    assert [s["stage"] for s in d["stages"]][:3] == ["decoder layer 0", "decoder layer 1", "decoder layer 2"]
    assert all(s["frac_equal"] == 1.0 and s["max_abs_diff"] == 0.0 for s in d["stages"])
    # break layer 1: its MLP runs the bf16 flow's rollout precision on the rollout side only
    bf = named_flow("bf16").rollout_linear()
    for lin in (roll.model.layers[1].mlp.gate_proj, roll.model.layers[1].mlp.up_proj):
        lin.set_precision(bf)
    d = decode_divergence(roll, train, prompts, comps, SamplingParams(), 32)
    assert d["first_divergent"] == "decoder layer 1"
    assert d["stages"][0]["frac_equal"] == 1.0 and d["stages"][1]["frac_equal"] < 1.0


def test_the_correction_fractions_follow_its_level_and_prob_err_is_zero_when_equal():
    """``frac_above_tis_cap`` and ``frac_outside_mis`` count what the correction does at its level: with
    ``tis_level: sequence`` every token of a sequence whose ratio product passes the cap (each token's own
    ratio is below it); with ``mis_level: sequence`` the tokens MIS drops (``frac_masked``)."""
    from jetrl_cli.rl.algos import importance

    g = torch.Generator().manual_seed(fresh_seed())
    lr = -torch.rand(4, 8, generator=g) * 2
    lt = lr + 0.15  # each token's ratio e^0.15 = 1.16: below every cap and inside [0.5, 2]
    mask = torch.ones(4, 8, dtype=torch.bool)
    mask[3, 2:] = False  # a sequence of 2 tokens: product e^0.3 = 1.35
    tis = mismatch_metrics(lt, lr, mask, CorrectionConfig("tis", tis_cap=2.0, tis_level="sequence"))
    assert tis["frac_above_tis_cap"] == pytest.approx(24 / 26)  # 8 x 0.15 = 1.2: e^1.2 = 3.3 > 2
    assert mismatch_metrics(lt, lr, mask, CorrectionConfig("tis", tis_cap=2.0))["frac_above_tis_cap"] == 0.0
    mis = CorrectionConfig("mis", mis_low=0.5, mis_high=1.1, mis_level="sequence")
    imp = importance(lt, lr, mask, mis, 0.28)
    assert imp.metrics["frac_outside_mis"] == imp.metrics["frac_masked"] == 1.0
    same = mismatch_metrics(lr, lr.clone(), mask)
    assert same["prob_err"] == 0.0 and same["mismatch_kl"] == 0.0
    tiny = mismatch_metrics(lr.nextafter(torch.zeros(())), lr, mask)  # 1 ulp apart: a KL above 0, not rounded to it
    assert tiny["frac_bitwise_equal"] == 0.0 and tiny["mismatch_kl"] > 0.0


def test_a_top_token_beyond_the_trainers_cut_is_printed_and_written():
    """A token beyond the trainer's top-k/top-p cut has no training logprob (None in the JSON, which has
    no infinity): the console table and report.md say so rather than failing on it."""
    import io

    from rich.console import Console

    res = invoke("mismatch-report", "fp8-rollout", "--flows", "preset", "--lengths", "8", "--prompts", 2,
                 "--no-attribution", "--json", *sets(SMALL))
    report = json.loads(res.stdout)
    tops = report["flows"][0]["top_tokens"]
    assert tops
    tops[0].update(logp_train=None, abs_dlogp=None)
    out = io.StringIO()
    mm.render(report, Console(file=out, width=160))
    assert "-inf (cut)" in out.getvalue()
    assert "-inf (cut)" in mm.markdown(report, [])


def test_greedy_decodes_are_shared_only_between_flows_the_engine_runs_alike(monkeypatch):
    """The report's greedy decodes are cached across flows; flows that differ only in what the engine
    reads besides the rollout formats (the skipped layers' format, batch invariance) decode anew."""
    import dataclasses

    from jetrl_cli.engine.sampling import SamplingParams
    from jetrl_cli.precision.formats import Format

    built = []

    class Engine:
        def __init__(self, model, flow, width, max_batch):
            built.append(flow)

        def generate(self, prompts, sp, seed):
            return [[type("G", (), {"tokens": [len(built)]})()] for _ in prompts]

    monkeypatch.setattr(mm, "EmbeddedEngine", Engine)
    inp = mm.ReportInputs(model=None, decode=None, prompts=[[1, 2]], sampling=SamplingParams(), tcfg=None,
                          ccfg=CorrectionConfig(), max_batch=4)
    base = parse_flow("fp8-unified")
    mm.greedy_divergence(inp, base, 4, 16)
    first = len(built)  # the flow (its trainer view is the same engine: unified) and the fp32 reference
    mm.greedy_divergence(inp, base, 4, 16)
    assert len(built) == first  # the same flow again: every decode from the cache
    for other in (dataclasses.replace(base, skip_format=Format.FP32), dataclasses.replace(base, batch_invariant=True)):
        n = len(built)
        mm.greedy_divergence(inp, other, 4, 16)
        assert len(built) == n + 1 and built[-1] is other


def test_the_logprob_stage_compares_the_tokens_both_sides_keep_under_top_k():
    """With top-k a token one side cuts (logprob -inf) and the other keeps has no finite difference: the
    log-softmax stage's ``max_abs_diff`` is over the tokens both keep (a number, not inf or 3.4e38), and
    ``frac_cut_differs`` counts the positions whose cuts differ."""
    from jetrl_cli.engine.sampling import SamplingParams, sampling_logprobs
    from jetrl_cli.models.shapes import random_model
    from jetrl_cli.models.tiny import tiny_config
    from jetrl_cli.precision import apply_flow, named_flow
    from jetrl_cli.rl.divergence import decode_divergence

    import copy

    cfg = tiny_config("qwen2", hidden=128, layers=2, vocab=128)
    s = fresh_seed()
    # the trainer's model: the rollout's, every weight moved by 30% of its spread (two independent models' top-8
    # sets can be disjoint at every position, leaving no token both keep; these overlap by about half)
    roll = random_model(cfg, seed=s, std=0.05).eval()
    train = copy.deepcopy(roll)
    g = torch.Generator().manual_seed(s + 1)
    with torch.no_grad():
        for p in train.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    for m, side in ((roll, "rollout"), (train, "train")):
        apply_flow(m, named_flow("bf16"), side)
    g = torch.Generator().manual_seed(s)
    prompts = [torch.randint(1, 128, (int(k),), generator=g).tolist() for k in (4, 6)]
    comps = [torch.randint(1, 128, (5,), generator=g).tolist() for _ in prompts]
    sp = SamplingParams(top_k=8)
    d = decode_divergence(roll, train, prompts, comps, sp, 32)
    st = d["stages"][-1]
    assert st["stage"] == "log-softmax (logprobs)"
    # by hand: the two models' logprobs at the same positions, compared where both are finite
    ids = [p + c for p, c in zip(prompts, comps)]
    rows = []
    for m in (roll, train):
        per = []
        for i, x in enumerate(ids):
            with torch.no_grad():
                logits = m(torch.tensor([x]))[0, len(prompts[i]) - 1:len(prompts[i]) - 1 + 5]
                per.append(sampling_logprobs(logits, sp))
        rows.append(torch.cat(per))
    pr, pt = rows
    both = pr.isfinite() & pt.isfinite()
    assert both.any() and (pr.isfinite() != pt.isfinite()).any()
    want = max(abs(float(a) - float(b)) for a, b, k in zip(pr.flatten(), pt.flatten(), both.flatten()) if k)
    assert math.isfinite(st["max_abs_diff"]) and st["max_abs_diff"] == pytest.approx(want, rel=1e-5)
    cut = sum(bool((pr[j].isinf() != pt[j].isinf()).any()) for j in range(pr.shape[0])) / pr.shape[0]
    assert st["frac_cut_differs"] == cut > 0
