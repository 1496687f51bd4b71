"""The whole evaluation end to end on a tiny random model: determinism, a planted broken format, the report."""

import json
import re
import warnings
from dataclasses import replace

import pytest
import torch

from kvpack.calibration.static import CalibrationDriftWarning
from kvpack.errors import ConfigError, FormatError
from kvpack.evaluation.report import summary_table, write_report
from kvpack.evaluation.runner import Runner, wrap
from kvpack.evaluation.suite import EvalConfig, run_eval
from kvpack.evaluation.tiny import tiny_model
from kvpack.plans import parse_plan


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: a second thread only adds synchronisation (and other test runs share the cores)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm(one_thread):
    model, tok = tiny_model(seed=0)
    return wrap(model, tok, "tiny-llama")


def small_config(**kw):
    base = dict(
        formats=["fp16", "int8", "kivi2"],
        lengths=[192, 384],
        depths=[0.5],
        kinds=["number", "identifier"],
        fidelity_tokens=384,
        fidelity_chunk=128,
        attribution=["kivi2"],
        sensitivity_tokens=160,
        speculative_tokens=6,
        speculative_prompts=1,
        speculative_context=192,
        engine="simulate",
    )
    base.update(kw)
    return EvalConfig(**base)


def _numbers(results):
    return {k: v for k, v in results.items() if k != "run"}


@pytest.fixture(scope="module")
def simulated(lm):
    return run_eval(small_config(), lm=lm)


def test_runs_end_to_end_and_is_deterministic(lm, simulated):
    again = run_eval(small_config(), lm=lm)
    assert _numbers(again) == _numbers(simulated)
    other_seed = run_eval(small_config(seed=1, fidelity_tokens=0, sensitivity_tokens=0, speculative_tokens=0), lm=lm)
    assert other_seed["needles"]["cases"][0]["answer"] != simulated["needles"]["cases"][0]["answer"]


def test_results_hold_every_section(simulated):
    r = simulated
    assert r["config"]["engine"] == "simulate"
    assert {"torch", "transformers", "python", "kvpack"} <= set(r["environment"])
    cases = r["needles"]["cases"]
    assert len(cases) == 2 * 1 * 2
    assert all(set(c["outputs"]) == {"fp16", "int8", "kivi2"} for c in cases)
    fid = r["fidelity"]["variants"]
    assert set(fid) == {"fp16", "int8", "kivi2", "kivi2 keys only", "kivi2 values only"}
    # fp16 barely moves the distribution; int8 a little; 2-bit a lot (ordering, not hard-coded values)
    assert fid["fp16"]["kl_mean"] < fid["int8"]["kl_mean"] < fid["kivi2"]["kl_mean"]
    assert fid["fp16"]["top1_agreement"] >= fid["kivi2"]["top1_agreement"]
    assert sum(b["tokens"] for b in fid["int8"]["by_position"]) == fid["int8"]["tokens"] == 383
    assert set(r["attribution"]["fidelity"]["kivi2"]) == {"both", "keys_only", "values_only"}
    sens = r["attribution"]["layer_sensitivity"]["errors"]
    assert set(sens) == {"int8", "kivi2"} and all(len(v) == 2 for v in sens.values())
    assert sum(sens["int8"]) < sum(sens["kivi2"])
    spec = r["speculative"]
    for s in spec.values():  # each verification commits the accepted draft tokens plus one of its own
        assert s["accepted"] + s["target_calls"] in (6, 7) and 0.0 <= s["acceptance"] <= 1.0
    fmt = r["formats"]
    assert fmt["fp16"]["ratio_vs_fp16"] == 1.0 and fmt["kivi2"]["ratio_vs_fp16"] < fmt["int8"]["ratio_vs_fp16"] < 1
    assert r["verdicts"]["fp16"]["status"] == "baseline"
    assert r["verdicts"]["kivi2"]["status"] in ("caution", "fails")


def test_planted_broken_format_is_reported_failing(lm):
    cfg = small_config(lengths=[384], kinds=["number"], attribution=[], sensitivity_tokens=0, speculative_tokens=0)
    honest = run_eval(cfg, lm=lm)
    broken = run_eval(cfg, lm=lm, zero_keys_for=["int8"])
    assert honest["verdicts"]["int8"]["status"] == "ok", honest["verdicts"]["int8"]
    assert broken["verdicts"]["int8"]["status"] == "fails", broken["verdicts"]["int8"]
    assert "badly damaged" in broken["verdicts"]["int8"]["text"]
    kl_honest = honest["fidelity"]["variants"]["int8"]["kl_mean"]
    kl_broken = broken["fidelity"]["variants"]["int8"]["kl_mean"]
    assert kl_broken > 50 * kl_honest
    # the baseline is untouched by the planted format
    assert broken["fidelity"]["variants"]["fp16"] == honest["fidelity"]["variants"]["fp16"]


def test_report_files(simulated, tmp_path):
    page = write_report(simulated, tmp_path / "rep")
    html = page.read_text()
    assert html.count("data:image/png;base64,") >= 5  # heatmaps, length curve, fidelity, attribution, layers
    assert "http" not in html.replace("http-equiv", "")  # nothing to fetch: readable offline
    for name in ("fp16", "int8", "kivi2"):
        assert name in html
    loaded = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert _numbers(loaded) == json.loads(json.dumps(_numbers(simulated)))
    table = summary_table(simulated)
    assert table.splitlines()[0].split()[:3] == ["format", "bits/elem", "bytes"]
    assert "kivi2:" in table
    bare = write_report(simulated, tmp_path / "bare", plots=False).read_text()
    assert "data:image/png" not in bare and "<table" in bare


def test_speculative_full_precision_accepts_everything(lm):
    from kvpack.evaluation.speculative import assisted_greedy

    runner = Runner(lm, engine="simulate")
    prompt = lm.encode("The quick brown fox jumps over the lazy dog. " * 4)
    pre = runner.prefill(prompt[:-1])
    target, draft = runner.filled(pre, None, 400), runner.filled(pre, None, 400)
    res = assisted_greedy(runner, prompt, target, draft, max_new_tokens=12, draft_tokens=3)
    assert res.acceptance == 1.0
    assert res.target_calls == 3  # 12 tokens, 3 drafted + 1 from the target per call
    plain = runner.greedy(runner.filled(pre, None, 400), prompt[-1:], 12, stop_at_newline=False)
    assert res.tokens[: len(plain)] == plain
    # a 2-bit target rejects some draft tokens, and the caches stay consistent while it does
    target2, draft2 = runner.filled(pre, "kivi2", 400), runner.filled(pre, None, 400)
    res2 = assisted_greedy(runner, prompt, target2, draft2, max_new_tokens=12, draft_tokens=3)
    assert len(res2.tokens) == 12
    # both caches hold the prompt and the committed tokens but the last (one more when the last round overshot)
    assert target2.get_seq_length() in (len(prompt) + 11, len(prompt) + 12)
    assert draft2.get_seq_length() <= target2.get_seq_length()


def test_kvpack_engine_matches_simulation(lm):
    cfg = small_config(lengths=[384], attribution=[], sensitivity_tokens=0, speculative_tokens=0, engine="kvpack")
    real = run_eval(cfg, lm=lm)
    sim = run_eval(small_config(lengths=[384], attribution=[], sensitivity_tokens=0, speculative_tokens=0), lm=lm)
    assert real["config"]["engine"] == "kvpack"
    for name in ("int8", "kivi2"):
        a = real["fidelity"]["variants"][name]["kl_mean"]
        b = sim["fidelity"]["variants"][name]["kl_mean"]
        assert abs(a - b) <= 0.05 * b + 1e-5, (name, a, b)
    # the paged cache reports its bytes, and the quantized one is smaller
    fmt = real["formats"]
    assert 0 < fmt["kivi2"]["measured_cache_bytes"] < fmt["fp16"]["measured_cache_bytes"]


@pytest.mark.parametrize("engine", ["simulate", "kvpack"])
def test_filling_caches_leaves_the_prefill_untouched(lm, engine):
    runner = Runner(lm, engine=engine)
    pre = runner.prefill(lm.encode("A document of a few blocks. " * 12))
    before = [k.clone() for k in pre.keys] + [v.clone() for v in pre.values]
    cache = runner.filled(pre, "kivi2", 512)
    assert cache.get_seq_length() == len(pre.ids)
    assert all(torch.equal(a, b) for a, b in zip(before, pre.keys + pre.values))
    # and the question reads the quantized document: its logits differ from the full-precision cache's
    q = lm.encode(" Question?")
    assert not torch.equal(runner.forward(q, cache), runner.forward(q, runner.filled(pre, None, 512)))


@pytest.fixture(scope="module")
def calibration_dir(lm, tmp_path_factory):
    from types import SimpleNamespace

    from kvpack.calibration.run import calibrate

    tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: lm.encode(text))
    art = calibrate(lm.model, tok, samples=2, seq_len=128, format="fp8@static")
    d = tmp_path_factory.mktemp("calibration")
    art.save(d)
    return d


def test_static_variants_run_through_the_harness(lm, calibration_dir):
    from kvpack.errors import ConfigError

    kw = dict(lengths=[384], attribution=["int4@static"], sensitivity_tokens=160, speculative_tokens=0)
    cfg = small_config(
        formats=["fp16", "fp8-plain", "fp8@static", "int4", "int4@static"], calibration=calibration_dir, **kw
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run_eval(cfg, lm=lm)
    assert not [w for w in caught if w.category is CalibrationDriftWarning]
    assert r["calibration"]["drift_warnings"]["count"] >= 0
    fid = r["fidelity"]["variants"]
    # calibrated scales are different scales: the numbers move, and stay in the format's range of damage
    for name, static in (("fp8-plain", "fp8@static"), ("int4", "int4@static")):  # fp8@static is plain static e4m3
        dyn, st = fid[name]["kl_mean"], fid[static]["kl_mean"]
        assert dyn != st and 0 < st < 20 * dyn + 1e-3, (name, dyn, st)
    assert r["formats"]["fp8@static"]["spec"].count("static") == 2  # keys and values (per head)
    assert r["formats"]["int4@static"]["spec"].count("static") == 1  # keys only: values are per token
    assert r["calibration"]["made_for"] == "fp8@static"
    assert set(r["calibration"]["source_per_format"]) == {"fp8@static", "int4@static"}
    assert len(r["attribution"]["layer_sensitivity"]["errors"]["int4@static"]) == 2
    assert {"int4@static keys only", "int4@static values only"} <= set(fid)
    # without an artifact a static format is refused before anything runs
    with pytest.raises(ConfigError, match="--calibration"):
        run_eval(small_config(formats=["fp16", "fp8@static"], **kw), lm=lm)


def test_static_variants_refuse_another_models_artifact(calibration_dir):
    from kvpack.errors import CalibrationError

    other, tok = tiny_model(seed=1, layers=3)
    with pytest.raises(CalibrationError, match="another model"):
        run_eval(small_config(formats=["fp16", "fp8@static"], calibration=calibration_dir), lm=wrap(other, tok, "t3"))


def test_static_and_outlier_variants_agree_across_engines(lm, calibration_dir):
    names = ["fp16", "fp8@static", "fp8-o4", "int4-o4", "fp8"]
    kw = dict(formats=names, lengths=[384], attribution=[], sensitivity_tokens=0, speculative_tokens=0)
    real = run_eval(small_config(engine="kvpack", calibration=calibration_dir, **kw), lm=lm)
    sim = run_eval(small_config(calibration=calibration_dir, **kw), lm=lm)
    for name in names[1:]:
        a = real["fidelity"]["variants"][name]["kl_mean"]
        b = sim["fidelity"]["variants"][name]["kl_mean"]
        assert abs(a - b) <= 0.05 * b + 1e-5, (name, a, b)
    # the residuals are stored and counted: the outlier formats hold more bytes than their plain selves
    fmt = real["formats"]
    assert fmt["fp8-o4"]["bits_per_element"] > fmt["fp8@static"]["bits_per_element"]
    assert fmt["fp8-o4"]["measured_cache_bytes"] > fmt["fp8@static"]["measured_cache_bytes"]


def test_drift_warnings_are_collected_not_printed(lm, tmp_path):
    from types import SimpleNamespace

    from kvpack.calibration.run import calibrate

    tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: lm.encode(text))
    calibrate(lm.model, tok, samples=1, seq_len=8, format="int4@static").save(tmp_path)  # far too little text
    cfg = small_config(
        formats=["fp16", "int4@static"], calibration=tmp_path, lengths=[], attribution=[], engine="kvpack"
    )
    cfg = replace(cfg, sensitivity_tokens=0, speculative_tokens=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run_eval(cfg, lm=lm)
    assert not [w for w in caught if w.category is CalibrationDriftWarning]  # not once per cache on stderr
    drift = r["calibration"]["drift_warnings"]
    assert drift["count"] > 0 and "fell outside the calibrated range" in drift["first"][0], drift


def test_a_plan_is_evaluated_as_its_layers_formats(lm):
    """A per-layer plan in --formats: its bytes, bits and per-layer errors are those of each layer's own format, and
    its KL lies between those of its formats (layer 0 wider than the rest)."""
    plan = "kivi2/int8[0]"
    cfg = small_config(formats=["fp16", "int8", "kivi2", plan], attribution=[plan], speculative_tokens=0)
    r = run_eval(cfg, lm=lm)
    n = r["model"]["layers"]
    facts = r["formats"]
    for key in ("bits_per_element", "bytes_per_token", "cache_bytes"):
        want = (facts["int8"][key] + (n - 1) * facts["kivi2"][key]) / n  # each format's: over all layers
        assert facts[plan][key] == pytest.approx(want, rel=1e-9), key
    errs = r["attribution"]["layer_sensitivity"]["errors"]
    assert errs[plan] == [errs["int8"][0], *errs["kivi2"][1:]]
    kl = {name: r["fidelity"]["variants"][name]["kl_mean"] for name in ("int8", "kivi2", plan)}
    assert kl["int8"] < kl[plan] < kl["kivi2"]
    sides = r["attribution"]["fidelity"][plan]
    assert set(sides) == {"both", "keys_only", "values_only"} and sides["both"] == kl[plan]
    assert plan in r["verdicts"] and r["needles"]["summary"][plan]["total"] > 0
    # a plan that is one format everywhere is that format
    same = run_eval(small_config(formats=["fp16", "int8/int8[0]"], lengths=[192], **_ONLY_KL), lm=lm)
    plain = run_eval(small_config(formats=["fp16", "int8"], lengths=[192], **_ONLY_KL), lm=lm)
    assert same["fidelity"]["variants"]["int8/int8[0]"] == plain["fidelity"]["variants"]["int8"]


_ONLY_KL = {"attribution": [], "sensitivity_tokens": 0, "speculative_tokens": 0}


def test_a_plan_through_the_kvpack_engine_stores_what_its_formats_store(lm):
    plan = "kivi2/int8[0]"
    cfg = small_config(formats=["fp16", "int8", "kivi2", plan], lengths=[384], engine="kvpack", **_ONLY_KL)
    real = run_eval(cfg, lm=lm)
    sim = run_eval(replace(cfg, engine="simulate"), lm=lm)
    a, b = (x["fidelity"]["variants"][plan]["kl_mean"] for x in (real, sim))
    assert abs(a - b) <= 0.05 * b + 1e-5, (a, b)
    used = {name: real["formats"][name]["measured_cache_bytes"] for name in ("int8", "kivi2", plan)}
    n = real["model"]["layers"]
    assert used[plan] == pytest.approx((used["int8"] + (n - 1) * used["kivi2"]) / n, rel=1e-9)


@pytest.mark.parametrize(
    "plan, error, message",
    [
        ("int4/int8[5]", FormatError, "names layer(s) [5] but the model has 2 layers"),
        ("int4/int8@static[0]", ConfigError, "take calibrated scales"),
        ("int4/k=int4:channel:asym:o2q,v=int4:g32:asym[0]", ConfigError, "rank outlier key channels by the queries"),
    ],
)
def test_a_plan_the_model_cannot_take_is_refused_before_the_sweep(lm, plan, error, message):
    with pytest.raises(error, match=re.escape(message)):
        run_eval(small_config(formats=["fp16", plan]), lm=lm)


def test_the_plan_search_end_to_end_proposes_a_plan_that_measures_as_it_said(lm):
    """--plan through the whole run (three rungs): the chosen plan is the fewest-bits probe within the budget, its
    string parses, and evaluated as a format on the same text it measures the KL the search recorded."""
    ladder = ["kivi2", "int4", "int8"]
    budget = 0.25  # this seeded model: kivi2 everywhere 1.5, int4 everywhere 0.13, int8 6e-4
    r = run_eval(small_config(formats=["fp16"], lengths=[192], plan_budget=budget, plan_formats=ladder,
                              plan_tokens=384, **_ONLY_KL), lm=lm)  # fmt: skip
    chosen, probes = r["plan"]["chosen"], r["plan"]["probes"]
    assert [p["plan"] for p in probes[:2]] == ["int8", "kivi2"]  # the widest and the narrowest first
    assert chosen is not None and chosen["kl_mean"] <= budget
    assert all(p["kl_mean"] > budget for p in probes if p["bits"] < chosen["bits"])
    plan = chosen["plan"]
    assert not parse_plan(plan).is_uniform and 2.75 < chosen["bits"] < 4.75  # kivi2 with a layer in int4
    again = run_eval(small_config(formats=["fp16", plan], lengths=[192], fidelity_tokens=384, **_ONLY_KL), lm=lm)
    assert again["fidelity"]["variants"][plan]["kl_mean"] == pytest.approx(chosen["kl_mean"], rel=1e-6)
    assert again["formats"][plan]["bits_per_element"] == pytest.approx(chosen["bits"])


def test_the_plan_search_pools_its_kl_over_several_texts(lm):
    """--plan-windows 2: each probe's KL is the mean over every token of two texts that share none, which is what
    the chosen plan measures on those two texts through a cache of its own."""
    from kvpack.evaluation.corpus import Corpus, builtin_source
    from kvpack.evaluation.fidelity import teacher_forced
    from kvpack.evaluation.report import plan_line

    ladder, budget = ["kivi2", "int4", "int8"], 0.25
    cfg = small_config(formats=["fp16"], lengths=[192], plan_budget=budget, plan_formats=ladder, plan_tokens=256,
                       plan_windows=2, **_ONLY_KL)  # fmt: skip
    r = run_eval(cfg, lm=lm)
    chosen = r["plan"]["chosen"]
    assert r["plan"]["windows"] == 2 and r["plan"]["tokens"] == 256 and chosen is not None
    texts = Corpus(builtin_source(), lm.encode).passages(256, 2, seed=7)
    runner = Runner(lm, engine="simulate")
    kl = []
    for ids in texts:
        res = teacher_forced(runner.forward, ids, runner.cache(None, len(ids)), {"p": runner.cache(chosen["plan"], 257)},
                             chunk=cfg.fidelity_chunk)  # fmt: skip
        kl.append(res["p"].kl.flatten())
    assert chosen["kl_mean"] == pytest.approx(float(torch.cat(kl).mean()), rel=1e-6)
    assert chosen["kl_mean"] != pytest.approx(float(kl[0].mean()), rel=1e-3)  # the second text counts
    assert chosen["kl_texts"] == pytest.approx([float(k.mean()) for k in kl], rel=1e-6)
    assert all(len(p["kl_texts"]) == 2 for p in r["plan"]["probes"])
    assert "over 2 texts of 256 tokens" in plan_line(r["plan"])
    with pytest.raises(ConfigError, match="plan_windows must be an integer from 1 to 64"):
        run_eval(replace(cfg, plan_windows=0), lm=lm)


def test_a_plan_at_its_budgets_edge_on_one_text_points_to_more_texts():
    from kvpack.evaluation.report import plan_line

    probe = {"plan": "int4/int8[0]", "bits": 5.0, "kl_mean": 0.0095}
    plan = {"budget": 0.01, "ladder": ["int4", "int8"], "probes": [probe], "chosen": probe, "tokens": 1024}
    assert "--plan-windows 4 tells whether it holds" in plan_line({**plan, "windows": 1})
    assert "--plan-windows" not in plan_line({**plan, "windows": 1, "chosen": {**probe, "kl_mean": 0.005}})
    pooled = {**probe, "kl_texts": [0.008, 0.011]}
    line = plan_line({**plan, "windows": 2, "probes": [pooled], "chosen": pooled})
    assert "--plan-windows" not in line and "over 2 texts of 1,024 tokens (texts 0.008-0.011)" in line
