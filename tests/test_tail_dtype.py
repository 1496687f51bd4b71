"""A format's own tail dtype (``tail=fp32|fp16|bf16``): the full-precision tail and sink rows in that dtype,
whatever the model's, in the format string, the byte counts, kvpack's cache and ``kvpack size``."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvpack import parse_format
from kvpack.cache import PagedKVCache
from kvpack.cli.main import main
from kvpack.errors import FormatError, NonFiniteError
from kvpack.formats import PRESETS, DType, split_formats
from kvpack.sizing import vllm_capacity_tokens, vllm_page

H, D = 3, 64


def test_tail_field_parses_names_and_round_trips():
    f = parse_format("int8,tail=fp16")
    assert f.tail is DType.FP16 and f.name == "int8,tail=fp16" and (f.key, f.value, f.sink) == (
        PRESETS["int8"].key, PRESETS["int8"].value, 1)  # fmt: skip
    assert f.spec_string() == PRESETS["int8"].spec_string() + ",tail=fp16"
    assert parse_format(f.spec_string()) == f and parse_format(f.spec_string()).name == "int8,tail=fp16"
    assert f != PRESETS["int8"] and PRESETS["int8"].tail is None  # the tail dtype is part of the format
    assert parse_format("int8,tail=float16") == f and parse_format("int8,tail=bfloat16").tail is DType.BF16
    assert f.with_tail(None) == PRESETS["int8"] and PRESETS["int8"].with_tail(DType.FP16) == f
    # block=, sink= and @static keep it; it keeps them
    assert parse_format("int4,block=32,sink=0,tail=bf16").name == "int4,block=32,sink=0,tail=bf16"
    g = f.with_block_size(32).with_sink(2)
    assert g.tail is DType.FP16 and g == parse_format("int8,block=32,sink=2,tail=fp16")
    assert parse_format("int8,tail=fp16@static").tail is DType.FP16
    c = parse_format("k=int8,v=int4:g32,tail=fp32")
    assert c.tail is DType.FP32 and parse_format(c.spec_string()) == c
    assert split_formats("int8,tail=fp16,int4,sink=0,tail=bf16") == ["int8,tail=fp16", "int4,sink=0,tail=bf16"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("int8,tail=int8", "tail must be fp32, fp16 or bf16"),
        ("int8,tail=fp16,tail=bf16", "tail= is given twice"),
        ("fp16,tail=fp16", "stored in full precision"),
        ("kv=fp32,tail=bf16", "stored in full precision"),
    ],
)
def test_bad_tails_are_refused(text, words):
    with pytest.raises(FormatError, match=re.escape(words)):
        parse_format(text)


def test_bytes_follow_the_formats_tail_whatever_the_model():
    f, base = parse_format("int8,tail=fp16"), PRESETS["int8"]
    tail = 2 * H * 64 * D * 2  # one block of K and V in float16
    for act in (2, 4):  # the model's activation bytes no longer matter
        assert f.tail_bytes(H, D, act) == tail and f.sink_bytes(H, D, act) == 2 * H * 1 * D * 2
    assert base.tail_bytes(H, D, 4) == 2 * tail
    assert f.bytes_for_tokens(130, H, D, 2, tail_element_bytes=4) == 2 * (
        2 * f.block_bytes(H, D) + tail + 2 * H * D * 2
    )
    # a vLLM page: float16 sink rows, cells still whole float32 elements (vLLM views the page in the model's dtype)
    page = vllm_page(f, H, D, 4)
    sinks = [n for name, _, n in page.regions if name.startswith("sink")]
    assert sinks == [H * D * 2, H * D * 2] and page.cell_bytes % 4 == 0
    assert page.page_bytes < vllm_page(base, H, D, 4).page_bytes
    # the quick benchmark's space (30 layers, 192 MiB, 32 requests, float32 model): half the tails, more tokens
    mib = 2**20
    assert vllm_capacity_tokens(base, 30, H, D, 4, 192 * mib, 32) == 8_192
    assert vllm_capacity_tokens(f, 30, H, D, 4, 192 * mib, 32) == 12_224
    assert vllm_capacity_tokens(f, 30, H, D, 4, 192 * mib, 32) == vllm_capacity_tokens(base, 30, H, D, 2, 192 * mib, 32)


def test_kvpacks_cache_keeps_the_formats_tail_dtype_and_refuses_an_overflow():
    cache = PagedKVCache("int8,tail=fp16", 1, H, D, num_blocks=8, tail_dtype=torch.float32)
    assert cache.tail_dtype == torch.float16
    sid = cache.add_sequence()
    k, v = torch.randn(1, H, 70, D), torch.randn(1, H, 70, D)
    cache.append(0, [sid], k, v)
    view = cache.view(0, [sid])
    assert view.tail_k.dtype == torch.float16 and view.sink_k.dtype == torch.float16
    assert torch.equal(view.tail_k[0, :, :6], k[0, :, 64:].to(torch.float16))
    big = torch.randn(1, H, 1, D)
    big[0, 2, 0, 7] = 1e5
    with pytest.raises(NonFiniteError, match=r"overflows the cache's float16 tail.*'int8,tail=fp16'.*tail=bf16"):
        cache.append(0, [sid], big, torch.randn(1, H, 1, D))
    assert cache.seq_len(sid) == 70  # nothing was stored
    ok = PagedKVCache("int8,tail=bf16", 1, H, D, num_blocks=8, tail_dtype=torch.float32)
    s2 = ok.add_sequence()
    ok.append(0, [s2], big, torch.randn(1, H, 1, D))  # bfloat16 keeps float32's range
    assert ok.view(0, [s2]).tail_k.dtype == torch.bfloat16


def test_size_predicts_the_formats_tails(capsys):
    args = ["size", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--context", "512", "--format", "int8",
            "--format", "int8,tail=fp16", "--vllm-space", "192MiB", "--max-num-seqs", "32", "--dtype", "float32",
            "--json"]  # fmt: skip
    assert main(args) == 0
    rows = {r["format"]: r for r in json.loads(capsys.readouterr().out)["formats"]}
    assert rows["int8"]["vllm_tokens"] == 8_192 and rows["int8,tail=fp16"]["vllm_tokens"] == 12_224
    assert rows["int8,tail=fp16"]["vllm_tail_bytes"] * 2 == rows["int8"]["vllm_tail_bytes"] == 90 * 2**20
    # the preset's row names the float16-tail format (a float32 model), which names none itself
    assert rows["int8"]["vllm_float16_tails"] == {"format": "int8,tail=fp16", "vllm_tokens": 12_224}
    assert "vllm_float16_tails" not in rows["int8,tail=fp16"]
    assert main(args[:-1]) == 0
    assert "float16 tails hold more tokens here: int8 -> 'int8,tail=fp16' 12,224" in capsys.readouterr().out
    assert main([*args[:-2], "bfloat16"]) == 0  # a bfloat16 model's tails are 16-bit already
    assert "float16 tails" not in capsys.readouterr().out
