"""Per-layer plans: the string, the layered cache, sizing, the transformers cache, and the plan search."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpack.hf
from kvpack.cache import PagedKVCache
from kvpack.cache.layered import LayeredKVCache
from kvpack.errors import CalibrationError, ConfigError, FormatError, ShapeError
from kvpack.evaluation.planner import greedy_plans, plan_from_layers, search_plan
from kvpack.formats import parse_format, split_formats
from kvpack.integrations.vllm.config import settings_from
from kvpack.plans import LayerPlan, is_plan, layer_formats, parse_plan
from kvpack.sizing import ModelShape, estimate, parse_formats

INT4, INT8, K4V2 = (parse_format(n) for n in ("int4", "int8", "k4v2"))


def test_plan_strings_parse_name_and_round_trip():
    p = parse_plan("int4/int8[0,5-6]")
    assert p.base == INT4 and p.overrides == ((INT8, frozenset({0, 5, 6})),)
    assert p.name == "int4/int8[0,5-6]" and parse_plan(p.name) == p
    assert parse_plan(p.spec_string()) == p
    f = p.formats(8)
    assert [x.name for x in f] == ["int8", "int4", "int4", "int4", "int4", "int8", "int8", "int4"]
    three = parse_plan("k4v2/int4[1-3]/int8[0]")
    assert [x.name for x in three.formats(5)] == ["int8", "int4", "int4", "int4", "k4v2"]
    custom = parse_plan("int4/k=int8:channel,v=int4:g32:asym[2]")
    assert custom.formats(3)[2] == parse_format("k=int8:channel,v=int4:g32:asym")
    assert not is_plan("int4") and is_plan("int4/int8[0]") and layer_formats("int8", 2) == [INT8, INT8]
    # bits: the mean over layers (every layer stores the same number of elements)
    want = (INT8.bits_per_element(8, 128) * 3 + INT4.bits_per_element(8, 128) * 5) / 8
    assert p.bits_per_element(8, 128, 8) == pytest.approx(want)
    assert p.bytes_per_token(8, 128, 8) == pytest.approx(
        3 * INT8.bytes_per_token(8, 128) + 5 * INT4.bytes_per_token(8, 128)
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("int4/int8", "is FORMAT"),
        ("int4/int8[0]/fp8[0-2]", "two formats"),
        ("int4/int8[3-1]", "backwards"),
        ("int4/int8[a]", "0-based numbers"),
        ("int4/int8[1,x-2]", "0-based numbers"),
        ("int4[0]/int8[1]", "base format"),
        ("int4/nope[0]", "unknown format preset"),
        ("", "empty plan"),
    ],
)
def test_bad_plans_raise_clear_format_errors(text, needle):
    with pytest.raises(FormatError, match=needle):
        parse_plan(text)


def test_a_plan_naming_a_layer_the_model_lacks_is_refused():
    with pytest.raises(FormatError, match=r"names layer\(s\) \[9\] but the model has 4 layers"):
        parse_plan("int4/int8[0,9]").formats(4)


def test_plans_stay_whole_in_format_lists_and_sizing():
    assert split_formats("int4/int8[0,5-6],int8,fp8") == ["int4/int8[0,5-6]", "int8", "fp8"]
    assert split_formats("int4/k=int8:channel,v=int4:g32:asym[0],fp8") == [
        "int4/k=int8:channel,v=int4:g32:asym[0]",
        "fp8",
    ]
    shape = ModelShape("m", layers=8, kv_heads=8, head_dim=128)
    rows = estimate(shape, 8192, 4, parse_formats(["int4,int8,int4/int8[0-7],int4/int8[0,5-6]"])).rows
    by = {r.format.name: r for r in rows}
    # a plan with every layer int8 costs exactly int8
    assert by["int4/int8[0-7]"].total_bytes == by["int8"].total_bytes
    mixed = by["int4/int8[0,5-6]"]
    assert (
        mixed.total_bytes == (INT8.bytes_for_tokens(8192, 8, 128, 3, 2) + INT4.bytes_for_tokens(8192, 8, 128, 5, 2)) * 4
    )
    assert by["int4"].total_bytes < mixed.total_bytes < by["int8"].total_bytes
    budget = estimate(shape, 8192, 4, parse_formats(["int4/int8[0,5-6]"]), gpu_mem_bytes=2**30, weights_bytes=0)
    row = budget.rows[0]
    per_token = lambda n: INT8.bytes_for_tokens(n, 8, 128, 3, 2) + INT4.bytes_for_tokens(n, 8, 128, 5, 2)  # noqa: E731
    assert per_token(row.max_context) <= 2**30 // 4 < per_token(row.max_context + 64)


def _kv(seed: int, t: int = 70) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, t, 64, generator=g), torch.randn(2, 2, t, 64, generator=g)


def test_the_layered_cache_stores_each_layer_exactly_as_its_own_format_does():
    fmts = [INT8, INT4, INT8]
    lay = LayeredKVCache(fmts, 2, 64, lambda f: 32)
    ref = {f.name: PagedKVCache(f, 1, 2, 64, 32) for f in (INT8, INT4)}
    ids = [lay.add_sequence(), lay.add_sequence()]
    rids = {n: [c.add_sequence(), c.add_sequence()] for n, c in ref.items()}
    for layer, f in enumerate(fmts):
        k, v = _kv(layer)
        lay.append(layer, ids, k, v)
        if layer < 2:
            ref[f.name].append(0, rids[f.name], k, v)
    for layer in (0, 1):
        a, b = lay.view(layer, ids), ref[fmts[layer].name].view(0, rids[fmts[layer].name])
        assert a.format == fmts[layer]
        for name in ("k_data", "v_data"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert torch.equal(ta[a.block_tables[:, :1].long()], tb[b.block_tables[:, :1].long()])
        assert torch.equal(a.seq_lens, b.seq_lens)
    assert [lay.seq_len(s, layer=2) for s in ids] == [70, 70]
    rep = lay.memory_report()
    assert len(rep.layers) == 3 and rep.sequences == 2 and "/" in rep.format
    assert rep.total.live_tokens == sum(m.live_tokens for m in rep.layers)
    fork = lay.fork(ids[0])
    lay.crop(fork, 10)
    assert lay.seq_len(fork, 1) == 10 and lay.seq_len(ids[0], 1) == 70
    for s in (fork, *ids):
        lay.free(s)
    assert lay.problems() == [] and lay.memory_report().sequences == 0
    with pytest.raises(ShapeError, match="unknown sequence id"):
        lay.view(0, [ids[0]])


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).eval()


@torch.inference_mode()
def test_a_plan_cache_in_transformers_matches_the_single_formats_it_is_made_of():
    model = _tiny()
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))

    def logits(fmt):
        cache = kvpack.hf.cache_for(model, format=fmt, max_tokens=300)
        kw = {kvpack.hf.cache_kwarg(model): cache}
        out = [model(input_ids=ids[:, :100], use_cache=True, **kw).logits]
        for t in range(100, 150):  # decode through the fused kernel, layer by layer in each layer's format
            out.append(model(input_ids=ids[:, t : t + 1], use_cache=True, **kw).logits)
        return torch.cat(out, dim=1), cache

    int8, _ = logits("int8")
    all8, cache = logits("int4/int8[0-2]")
    assert torch.equal(int8, all8)  # every layer int8 through the layered cache: the very same numbers
    assert cache.format_name == "int4/int8[0-2]" and "int4/int8[0-2]" in repr(cache)
    int4, _ = logits("int4")
    mixed, cache = logits("int4/int8[0]")
    assert not torch.equal(mixed, int4) and not torch.equal(mixed, int8)
    assert cache.bytes_summary()["used_bytes"] > 0 and len(cache.memory_report().layers) == 3
    with pytest.raises(CalibrationError, match="no calibration artifact at"):  # loaded and checked before any run
        kvpack.hf.cache_for(model, format="int4/int8[0]", calibration="/nonexistent")
    with pytest.raises(FormatError, match="names layer"):
        kvpack.hf.cache_for(model, format="int4/int8[7]")


def test_the_vllm_settings_take_a_plan_and_name_each_layers_format():
    cfg = types.SimpleNamespace(additional_config={"kvpack": {"format": "int4/int8[0,5-6]"}})
    s = settings_from(cfg)
    assert s.name == "int4/int8[0,5-6]" and s.format == parse_format("int4")
    assert [s.layer_format(i).name for i in range(8)] == [
        "int8",
        "int4",
        "int4",
        "int4",
        "int4",
        "int8",
        "int8",
        "int4",
    ]
    assert [f.name for f in s.formats] == ["int4", "int8"]
    uneven = types.SimpleNamespace(additional_config={"kvpack": {"format": "int4/int8,sink=0[1]"}})
    with pytest.raises(ConfigError, match=r"differ.* in block size, sink rows or tail dtype"):
        settings_from(uneven)
    uneven.additional_config = {"kvpack": {"format": "int4,tail=fp16/int8[1]"}}  # the override keeps the model's
    with pytest.raises(ConfigError, match=r"int8 differ.*tail fp16\).*same block=, sink= and tail="):
        settings_from(uneven)
    even = types.SimpleNamespace(additional_config={"kvpack": {"format": "int4,tail=fp16/int8,tail=fp16[1]"}})
    assert [f.tail.value for f in settings_from(even).formats] == ["fp16", "fp16"]


def test_greedy_plans_widen_the_worst_layer_first_and_the_search_measures_what_it_picks():
    errors = [[0.9, 0.1, 0.3, 0.2], [0.05, 0.01, 0.02, 0.02]]  # int4, int8 per layer
    plans = greedy_plans([INT4, INT8], errors)
    assert [p.name for p in plans] == [
        "int4",
        "int4/int8[0]",
        "int4/int8[0,2]",
        "int8/int4[1]",
        "int8",
    ]
    assert plan_from_layers([INT8, INT4, INT8]).name == "int8/int4[1]"
    kl = {"int4": 0.05, "int4/int8[0]": 0.012, "int4/int8[0,2]": 0.006, "int8/int4[1]": 0.004, "int8": 0.001}
    calls = []

    def kl_of(p: LayerPlan) -> float:
        calls.append(p.name)
        return kl[p.name]

    found = search_plan(plans, kl_of, lambda p: 4.0, 0.008, [INT4, INT8])
    assert found.chosen["plan"] == "int4/int8[0,2]" and found.chosen["kl_mean"] == 0.006
    assert len(calls) == len(set(calls)) <= 4  # each candidate measured once, a binary search
    missed = search_plan(plans, kl_of, lambda p: 4.0, 1e-4, [INT4, INT8])
    assert missed.chosen is None and [p["plan"] for p in missed.probes] == ["int8"]
    with pytest.raises(ConfigError, match="positive number"):
        search_plan(plans, kl_of, lambda p: 4.0, 0.0, [INT4, INT8])
