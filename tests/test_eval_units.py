"""Verdict rules, fidelity statistics, attribution formats and the simulate engine, without a model run."""

import pytest
import torch

from kvpack.errors import ConfigError
from kvpack.evaluation.attribution import keys_only, values_only
from kvpack.evaluation.fidelity import FidelityResult, bucket_edges, summarize
from kvpack.evaluation.simulate import roundtrip_blocks
from kvpack.evaluation.suite import EvalConfig
from kvpack.evaluation.verdict import compare_needles, fmt_tokens, outlier_layer, verdict
from kvpack.formats import DType, parse_format
from kvpack.quant import dequantize, quantize


def case(length, depth, kind, **correct):
    return {"length": length, "depth": depth, "kind": kind, "correct": correct}


CASES = [
    case(1024, 0.5, "number", fp16=True, a=True, b=True, c=True),
    case(2048, 0.5, "number", fp16=True, a=True, b=True, c=False),
    case(4096, 0.1, "identifier", fp16=True, a=True, b=False, c=True),
    case(4096, 0.5, "identifier", fp16=False, a=False, b=False, c=True),
]
GOOD_KL = {"kl_mean": 0.004, "kl_p99": 0.03, "top1_agreement": 0.98, "ppl_delta": 0.01}


def test_compare_needles_counts():
    a = compare_needles(CASES, "a", "fp16")
    assert (a["correct"], a["total"], a["lost"], a["gained"], a["identical_up_to"]) == (3, 4, 0, 0, 4096)
    b = compare_needles(CASES, "b", "fp16")
    assert (b["lost"], b["identical_up_to"], b["first_lost"]) == (
        1,
        2048,
        {"length": 4096, "depth": 0.1, "kind": "identifier"},
    )
    c = compare_needles(CASES, "c", "fp16")
    assert (c["lost"], c["gained"], c["identical_up_to"]) == (1, 1, 1024)
    assert c["by_length"][4096] == {"correct": 2, "baseline_correct": 1, "lost": 0, "gained": 1, "total": 2}


def test_verdicts_are_conservative_and_explained():
    ok = verdict("a", compare_needles(CASES, "a", "fp16"), GOOD_KL, 4096)
    assert ok["status"] == "ok"
    assert ok["text"].startswith("a: OK: identical needle accuracy up to 4k (3/4)")
    assert "KL 0.004" in ok["text"]
    lost = verdict("b", compare_needles(CASES, "b", "fp16"), GOOD_KL, 4096)
    assert lost["status"] == "fails"  # a good KL never overrules a lost needle
    assert "lost 1 of 3 needles fp16 found (first at 4k, identifier, depth 0.1)" in lost["text"]
    assert "identical up to 2k" in lost["text"]
    drift = verdict("a", compare_needles(CASES, "a", "fp16"), {**GOOD_KL, "kl_mean": 0.05}, 4096)
    assert drift["status"] == "caution" and "drifts" in drift["text"]
    gained = verdict("d", compare_needles([case(1024, 0.5, "number", fp16=False, d=True)], "d", "fp16"), None, 1024)
    assert gained["status"] == "caution" and "answered differently" in gained["text"]
    wrecked = verdict("a", compare_needles(CASES, "a", "fp16"), {**GOOD_KL, "kl_mean": 0.9}, 4096)
    assert wrecked["status"] == "fails" and "badly damaged" in wrecked["text"]
    flips = verdict("a", None, {**GOOD_KL, "top1_agreement": 0.4}, None)
    assert flips["status"] == "fails"
    assert verdict("fp16", None, GOOD_KL, 4096)["status"] == "baseline"


def test_a_layer_that_carries_the_error_is_named_even_when_needles_and_kl_pass():
    flat = [0.1, 0.12, 0.09, 0.11, 0.1]
    assert verdict("a", compare_needles(CASES, "a", "fp16"), GOOD_KL, 4096, layer_errors=flat)["status"] == "ok"
    spiked = [0.79, *flat]  # rotated e4m3 on biased keys: layer 0 wrecked, the others fine
    v = verdict("a", compare_needles(CASES, "a", "fp16"), GOOD_KL, 4096, layer_errors=spiked)
    assert v["status"] == "caution"
    assert "layer 0 carries the error (attention error 0.79, 8x the median layer's 0.1" in v["text"]
    # a spike that is large relative to tiny errors but small in absolute terms is not an alarm
    assert outlier_layer([0.1, 0.01, 0.01, 0.01]) is None
    assert outlier_layer([0.3, 0.1, 0.1]) is None  # 3x: not past the ratio
    assert outlier_layer([0.5, 0.1]) is None  # too few layers for a median
    # a format that already fails keeps failing, with the layer named too
    lost = verdict("b", compare_needles(CASES, "b", "fp16"), GOOD_KL, 4096, layer_errors=spiked)
    assert lost["status"] == "fails" and "layer 0 carries the error" in lost["text"]


def test_fmt_tokens():
    assert [fmt_tokens(n) for n in (1024, 1536, 4096, 700, 8192)] == ["1k", "1.5k", "4k", "700", "8k"]


def test_fidelity_summary_and_buckets():
    n = 1000
    kl = torch.zeros(n, dtype=torch.float64)
    kl[-20:] = 1.0  # damage only at the far end: the p99 and the last bucket see it, the mean barely
    r = FidelityResult(kl, torch.ones(n, dtype=torch.float64), torch.full((n,), 2.0), torch.full((n,), 2.0))
    s = summarize(r)
    assert s["tokens"] == n and s["kl_mean"] == pytest.approx(0.02)
    assert s["kl_p99"] == 1.0 and s["kl_max"] == 1.0
    assert s["ppl_delta"] == 0.0 and s["ppl"] == pytest.approx(torch.e**2)
    assert bucket_edges(n) == [0, 256, 512, n]
    last = s["by_position"][-1]
    assert (last["start"], last["end"], last["tokens"]) == (512, n, n - 512)
    assert last["kl_mean"] == pytest.approx(20 / (n - 512))
    assert s["by_position"][0]["kl_mean"] == 0.0


def test_attribution_formats():
    fmt = parse_format("int4")
    k, v = keys_only(fmt), values_only(fmt)
    assert k.key == fmt.key and k.value.dtype is DType.FP16 and k.block_size == fmt.block_size
    assert v.value == fmt.value and v.key.dtype is DType.FP16
    assert k.name == "int4 keys only" and v.name == "int4 values only"


@pytest.mark.parametrize("name", ["int8", "int4", "kivi2", "fp8-plain"])
def test_simulated_blocks_equal_the_primitives(name):
    fmt = parse_format(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 3 * fmt.block_size, 32, generator=g)  # [batch, H, 3 blocks, D]
    got = roundtrip_blocks(x, fmt.key, fmt.block_size)
    for j in range(3):
        block = x[0, :, j * fmt.block_size : (j + 1) * fmt.block_size]  # [H, B, D], one block as the cache seals it
        want = dequantize(quantize(block, fmt.key))
        assert torch.equal(got[0, :, j * fmt.block_size : (j + 1) * fmt.block_size], want)


def test_simulated_tails_take_the_formats_tail_dtype():
    """``int8,tail=fp16`` on float32 inputs: the open block holds the float16 roundings, and the sealed block is the
    round trip of those (what kvpack's cache seals from its float16 tail)."""
    from kvpack.evaluation.simulate import _layer_class

    fmt = parse_format("int8,tail=fp16")
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 70, 32, generator=g) * 3, torch.randn(1, 2, 70, 32, generator=g)
    keys, values = _layer_class()(fmt).update(k, v)
    k16, v16 = (x.to(torch.float16).float() for x in (k, v))
    assert not torch.equal(k16, k)  # the rounding is visible
    assert torch.equal(keys[..., 64:, :], k16[..., 64:, :]) and torch.equal(values[..., 64:, :], v16[..., 64:, :])
    assert torch.equal(keys[..., 1:64, :], roundtrip_blocks(k16[..., :64, :], fmt.key, 64)[..., 1:, :])
    assert torch.equal(keys[..., :1, :], k16[..., :1, :])  # the sink row, as it entered the tail
    plain, _ = _layer_class()(parse_format("int8")).update(k, v)
    assert torch.equal(plain[..., 64:, :], k[..., 64:, :])


def test_config_errors_name_every_problem():
    with pytest.raises(ConfigError) as e:
        EvalConfig(formats=["int8"], depths=[1.5], kinds=["riddle"], lengths=[10]).check()
    msg = str(e.value)
    for part in ("baseline 'fp16'", "at least 64", "[0, 1]", "riddle"):
        assert part in msg


def test_verdict_names_a_single_length_as_such():
    one = compare_needles([case(8000, 0.5, "number", fp16=True, a=True)], "a", "fp16")
    assert "identical needle accuracy at 8000 (1/1)" in verdict("a", one, None, 8000)["text"]
