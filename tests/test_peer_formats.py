"""Other systems' layouts as presets: their real byte counts, no kvpack defaults they lack, and they run."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from kvpack.cli.main import main
from kvpack.errors import ConfigError
from kvpack.formats import PEER_PRESETS, PRESETS, DType, PerGroup, PerTensor, PerToken, parse_format, preset
from kvpack.quant import quantize

B = 16  # the peers' block size (quanto's is its residual length, 128)

# Honest bits per element, counted by hand: (head_dim 128, head_dim 64), any number of kv heads
EXPECTED_BITS = {
    # 32 int8 codes + one fp16 scale per 32 elements (llama.cpp's block_q8_0, 34 bytes)
    "llamacpp-q8_0": (Fraction(8 * 32 + 16, 32), Fraction(8 * 32 + 16, 32)),
    # 32 4-bit codes + one fp16 scale (block_q4_0, 18 bytes)
    "llamacpp-q4_0": (Fraction(4 * 32 + 16, 32), Fraction(4 * 32 + 16, 32)),
    # one fp32 scale per token and kv head over head_dim elements
    "vllm-int8": (8 + Fraction(32, 128), 8 + Fraction(32, 64)),
    "vllm-fp8": (8 + Fraction(32, 128), 8 + Fraction(32, 64)),
    # 32 bits of scale and zero-point per token and kv head
    "vllm-int4": (4 + Fraction(32, 128), 4 + Fraction(32, 64)),
    # 4-bit / 2-bit codes + an fp16 scale and an fp16 shift per 64 elements
    "quanto-int4": (4 + Fraction(32, 64), 4 + Fraction(32, 64)),
    "quanto-int2": (2 + Fraction(32, 64), 2 + Fraction(32, 64)),
}


def _static_bits(kv_heads: int, head_dim: int) -> Fraction:
    # one fp32 scale per block (kvpack's storage keeps the slot; vLLM stores one per layer)
    return 8 + Fraction(32, B * kv_heads * head_dim)


@pytest.mark.parametrize("name", list(EXPECTED_BITS))
@pytest.mark.parametrize("kv_heads", [1, 8])
def test_bits_per_element(name: str, kv_heads: int) -> None:
    f = PEER_PRESETS[name]
    bits_128, bits_64 = EXPECTED_BITS[name]
    assert f.bits_per_element(kv_heads, 128) == float(bits_128)
    assert f.bits_per_element(kv_heads, 64) == float(bits_64)


def test_stated_numbers() -> None:
    peers = PEER_PRESETS
    assert peers["llamacpp-q8_0"].bits_per_element(8, 128) == 8.5
    assert peers["llamacpp-q4_0"].bits_per_element(8, 128) == 4.5
    assert peers["vllm-int8"].bits_per_element(8, 128) == peers["vllm-fp8"].bits_per_element(8, 128) == 8.25
    assert peers["vllm-int4"].bits_per_element(8, 128) == 4.25
    assert peers["quanto-int4"].bits_per_element(8, 128) == 4.5
    assert peers["quanto-int2"].bits_per_element(8, 128) == 2.5
    f = peers["vllm-fp8-static"]
    assert f.bits_per_element(8, 128) == float(_static_bits(8, 128)) == pytest.approx(8.00195, abs=1e-5)
    assert f.bits_per_element(2, 64) == float(_static_bits(2, 64))


def test_block_bytes_by_hand() -> None:
    h, d = 8, 128
    # q8_0: int8 payload + [H, 16, 4] fp16 scales, for K and for V
    assert PEER_PRESETS["llamacpp-q8_0"].block_bytes(h, d) == 2 * (h * B * d + h * B * (d // 32) * 2)
    # q4_0: packed nibbles (64 bytes a row) + the same scales
    assert PEER_PRESETS["llamacpp-q4_0"].block_bytes(h, d) == 2 * (h * B * d // 2 + h * B * (d // 32) * 2)
    # vLLM int8: one fp32 per token and head
    assert PEER_PRESETS["vllm-int8"].block_bytes(h, d) == 2 * (h * B * d + h * B * 4)
    # vLLM int4: nibbles + fp16 scale + fp16 zero per token and head
    assert PEER_PRESETS["vllm-int4"].block_bytes(h, d) == 2 * (h * B * d // 2 + h * B * 4)
    # quanto int2, block 128: 4 codes a byte + fp16 scale and shift per 64 channels
    assert PEER_PRESETS["quanto-int2"].block_bytes(h, d) == 2 * (h * 128 * d // 4 + h * 128 * 2 * 4)


def test_what_each_peer_stores() -> None:
    spec = {n: (str(f.key), str(f.value), f.block_size) for n, f in PEER_PRESETS.items()}
    assert spec == {
        "llamacpp-q8_0": ("int8:g32:sym:fp16", "int8:g32:sym:fp16", 16),
        "llamacpp-q4_0": ("int4:g32:sym:fp16", "int4:g32:sym:fp16", 16),
        "vllm-int8": ("int8:token:sym:fp32", "int8:token:sym:fp32", 16),
        "vllm-fp8": ("fp8_e4m3:token:fp32", "fp8_e4m3:token:fp32", 16),
        "vllm-int4": ("int4:token:asym:fp16:rot", "int4:token:asym:fp16", 16),
        "vllm-fp8-static": ("fp8_e4m3:tensor:fp32:static", "fp8_e4m3:tensor:fp32:static", 16),
        "quanto-int4": ("int4:g64:asym:fp16", "int4:g64:asym:fp16", 128),
        "quanto-int2": ("int2:g64:asym:fp16", "int2:g64:asym:fp16", 128),
    }


@pytest.mark.parametrize("name", list(PEER_PRESETS))
def test_no_kvpack_defaults_the_peer_lacks(name: str) -> None:
    f = PEER_PRESETS[name]
    assert f.sink == 0  # kvpack's presets keep the attention sink; no peer does
    assert not f.has_outliers
    assert f.key.rotate == (name == "vllm-int4")  # vLLM's int4 mode rotates (keys and values); the others do not
    assert not f.value.rotate
    assert name not in PRESETS


@pytest.mark.parametrize("name", list(PEER_PRESETS))
def test_round_trip(name: str) -> None:
    f = PEER_PRESETS[name]
    assert preset(name) is f and parse_format(name) is f and parse_format(name.upper()) is f
    assert parse_format(f.spec_string()) == f and parse_format(f.spec_string()).name == name
    # str() of each spec is the spec language: written back into a format string it parses to the same format
    again = parse_format(f"k={f.key},v={f.value},block={f.block_size}")
    assert again == f and again.name == name
    assert (again.key, again.value) == (f.key, f.value)
    derived = parse_format(f"{name},block=32")
    assert derived.name == f"{name},block=32" and derived.key == f.key and derived.block_size == 32


@pytest.mark.parametrize("name", list(PEER_PRESETS))
def test_accounting_matches_what_quantize_stores(name: str) -> None:
    f = PEER_PRESETS[name]
    h, d = 2, 128
    k, v = torch.randn(h, f.block_size, d), torch.randn(h, f.block_size, d)
    # a static spec's scales come from calibration; for storage, the block-local twin stores the same bytes
    key, value = (dataclasses.replace(s, static=False) for s in (f.key, f.value))
    assert quantize(k, key).nbytes() + quantize(v, value).nbytes() == f.block_bytes(h, d)


def test_the_specs_are_the_granularities_named() -> None:
    assert PEER_PRESETS["llamacpp-q4_0"].key.granularity == PerGroup(32)
    assert PEER_PRESETS["quanto-int2"].value.granularity == PerGroup(64)
    assert PEER_PRESETS["vllm-int4"].value.granularity == PerToken() and not PEER_PRESETS["vllm-int4"].value.symmetric
    static = PEER_PRESETS["vllm-fp8-static"]
    assert static.is_static and static.key.granularity == PerTensor() and static.key.dtype is DType.FP8_E4M3
    assert static.as_static().key == static.key  # already static: '@static' keeps it


def test_quanto_needs_head_dim_divisible_by_64() -> None:
    reasons = PEER_PRESETS["quanto-int4"].reasons_invalid(32)
    assert reasons and "group size 64" in reasons[0]
    assert not PEER_PRESETS["quanto-int4"].reasons_invalid(64)


def test_unknown_preset_lists_the_peers_too() -> None:
    with pytest.raises(Exception) as info:
        parse_format("llamacpp-q5_1")
    assert "llamacpp-q4_0" in str(info.value) and "vllm-int4" in str(info.value)


def test_kvpack_size_prints_the_stated_bits(capsys) -> None:
    rc = main(
        ["size", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "8k", "--format", "peers"]
    )
    assert rc == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines() if line[:1].isalpha()}
    assert rows["llamacpp-q8_0"] == "8.5000" and rows["llamacpp-q4_0"] == "4.5000"
    assert rows["vllm-int8"] == rows["vllm-fp8"] == "8.2500" and rows["vllm-int4"] == "4.2500"
    assert rows["quanto-int4"] == "4.5000" and rows["quanto-int2"] == "2.5000"
    assert rows["vllm-fp8-static"] == "8.0020"


def test_static_peer_needs_a_calibration_artifact() -> None:
    from kvpack.evaluation.runner import Runner, wrap
    from kvpack.evaluation.tiny import tiny_model

    model, tok = tiny_model(seed=0, max_positions=512)
    runner = Runner(wrap(model, tok, "tiny"), engine="simulate")
    with pytest.raises(ConfigError, match="kvpack calibrate"):
        runner.cache("vllm-fp8-static", 64)


@pytest.mark.parametrize("name", [n for n in PEER_PRESETS if n != "vllm-fp8-static"])
def test_cpu_kernel_matches_reference(name: str) -> None:
    pytest.importorskip("numba")
    from kvpack.kernels import decode_attention
    from kvpack.kernels import reference as ref
    from kvpack.testing import assert_close, cpu_kernel_tolerance, random_paged_kv

    fmt = PEER_PRESETS[name]
    b = fmt.block_size
    lens = [1, b + 1, 2 * b + 5]
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=2, head_dim=64, seed=7)
    q = torch.randn(len(lens), 4, 64)
    got = decode_attention(q, kv, backend="cpu")
    assert_close(got, ref.decode_attention(q, kv, None, None, None), *cpu_kernel_tolerance(kv), name)


def test_peers_run_through_the_harness_like_presets(tmp_path) -> None:
    """The kvpack engine stores and reads every peer on a model (tiny: head_dim 32, so no quanto), the static
    one with scales from an artifact calibrated for it, and reports each one's real bits."""
    from types import SimpleNamespace

    from kvpack.calibration.run import calibrate
    from kvpack.evaluation.runner import wrap
    from kvpack.evaluation.suite import EvalConfig, run_eval
    from kvpack.evaluation.tiny import tiny_model

    model, tok = tiny_model(seed=0, max_positions=1024)
    lm = wrap(model, tok, "tiny")
    enc = SimpleNamespace(encode=lambda text, add_special_tokens=False: lm.encode(text))
    calibrate(lm.model, enc, samples=2, seq_len=128, format="vllm-fp8-static").save(tmp_path)
    names = ["fp16", "llamacpp-q8_0", "llamacpp-q4_0", "vllm-int8", "vllm-fp8", "vllm-int4", "vllm-fp8-static"]
    cfg = EvalConfig(
        formats=names,
        lengths=[192],
        depths=[0.5],
        kinds=["number"],
        fidelity_tokens=256,
        fidelity_chunk=128,
        attribution=[],
        sensitivity_tokens=0,
        speculative_tokens=0,
        engine="kvpack",
        calibration=str(tmp_path),
    )
    r = run_eval(cfg, lm=lm)
    fid = r["fidelity"]["variants"]
    assert set(fid) == set(names)
    assert fid["llamacpp-q8_0"]["kl_mean"] < fid["llamacpp-q4_0"]["kl_mean"]  # 8 bits beat 4
    assert fid["vllm-int8"]["kl_mean"] < fid["vllm-int4"]["kl_mean"]
    for name in names[1:]:
        f = r["formats"][name]
        assert f["bits_per_element"] == PEER_PRESETS[name].bits_per_element(lm.kv_heads, lm.head_dim)
        assert 0 < f["measured_cache_bytes"] < r["formats"]["fp16"]["measured_cache_bytes"]
    assert r["calibration"]["source_per_format"].keys() == {"vllm-fp8-static"}


@pytest.mark.parametrize("name", [n for n in PEER_PRESETS if n != "vllm-fp8-static"])
def test_cpu_chunk_kernel_matches_reference(name: str) -> None:
    pytest.importorskip("numba")
    from kvpack.kernels import chunk_attention
    from kvpack.kernels import reference as ref
    from kvpack.testing import assert_close, random_paged_kv

    kv, _, _ = random_paged_kv(PEER_PRESETS[name].with_block_size(16), [20, 50], kv_heads=2, head_dim=64, seed=3)
    q = torch.randn(2, 5, 4, 64)
    got = chunk_attention(q, kv, backend="cpu")
    assert_close(got, ref.chunk_attention(q, kv), 1e-2, 1e-2, name)  # the chunk kernels round values to bf16


@pytest.mark.parametrize("name", [n for n in PEER_PRESETS if n != "vllm-fp8-static"])
def test_triton_kernels_match_reference(name: str) -> None:
    """Decode and chunk through the Triton kernels (under the Triton interpreter, as every Triton test here)."""
    pytest.importorskip("triton")
    from _triton_interpreter import fixed_interpreter
    from kvpack.kernels import reference as ref
    from kvpack.kernels import run_backend, run_chunk_backend
    from kvpack.testing import assert_close, random_paged_kv

    fmt = PEER_PRESETS[name].with_block_size(16)
    with fixed_interpreter():
        kv, _, _ = random_paged_kv(fmt, [1, 15, 17, 50], 2, 64, tail_dtype=torch.float16, seed=0)
        q = torch.randn(4, 8, 64).half()
        got = run_backend("triton", q, kv)  # the dispatcher rotates the query for vllm-int4's rotated keys
        assert_close(got.float(), ref.decode_attention(q.float(), kv), 5e-3, 5e-3, f"{name} decode")
        kv, _, _ = random_paged_kv(fmt, [20, 40], 2, 64, tail_dtype=torch.float16, seed=1)
        q = torch.randn(2, 3, 8, 64).half()
        got = run_chunk_backend("triton", q, kv)
        assert_close(got.float(), ref.chunk_attention(q.float(), kv), 1e-2, 1e-2, f"{name} chunk")
