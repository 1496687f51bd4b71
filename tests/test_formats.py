"""Formats as data: honest byte accounting, the string syntax, and clear errors."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

from kvpack.errors import FormatError
from kvpack.formats import (
    PRESETS,
    DType,
    KVFormat,
    PerChannel,
    PerGroup,
    PerHead,
    PerTensor,
    PerToken,
    QuantSpec,
    ScaleDType,
    parse_format,
    preset,
)
from kvpack.outliers import quantize_outliers
from kvpack.quant import quantize

H, D, B = 8, 128, 64  # kv_heads, head_dim, block_size of the reference table

# Honest bits per element at kv_heads 8, head_dim 128, block 64, fp16 scales (+ fp16 zero when asym).
EXPECTED_BITS = {
    "fp16": Fraction(16),
    "bf16": Fraction(16),
    "fp8-plain": Fraction(8) + Fraction(2 * H * 2 * 8, 2 * H * B * D),  # one fp16 scale per head per block, K and V
    "fp8_e5m2": Fraction(8) + Fraction(2 * H * 2 * 8, 2 * H * B * D),
    # + 4 key channels per head kept: fp16 residuals per token (4 x 16 bits) and a uint8 index each per block
    "fp8-o4": Fraction(8) + Fraction(2 * H * 2 * 8 + H * B * 4 * 16 + H * 4 * 8, 2 * H * B * D),
    # keys: an fp16 scale and an fp16 midpoint per channel per block (the rotation is a function of head_dim);
    # values: one fp16 scale per head per block
    "fp8": Fraction(8) + Fraction(H * D * 2 * 16 + H * 16, 2 * H * B * D),
    "int8": Fraction(8.375),  # 8.1875 symmetric, + fp16 zero-points per key channel per block and per value token
    "int4": Fraction(4.75),
    "int4-o4": Fraction(4.75) + Fraction(H * B * 4 * 16 + H * 4 * 8, 2 * H * B * D),  # int4 + 4 fp16 residuals
    "k8v4": Fraction(6.625),
    "k4v2": Fraction(3.75),
    "kivi2": Fraction(2.75),
    "int4-g32": Fraction(5),  # the reference article says 5.25; 32*4 + 32 metadata bits per 32 elements is 5.0
}


def test_every_preset_is_pinned() -> None:
    assert set(EXPECTED_BITS) == set(PRESETS)


@pytest.mark.parametrize("name", list(EXPECTED_BITS))
def test_bits_per_element(name: str) -> None:
    assert PRESETS[name].bits_per_element(H, D) == float(EXPECTED_BITS[name])


def test_fp8_bits_value() -> None:
    assert PRESETS["fp8-plain"].bits_per_element(H, D) == pytest.approx(8.001953125, abs=0)


def test_int4_g32_is_exactly_five_bits() -> None:
    f = PRESETS["int4-g32"]
    assert f.bits_per_element(H, D) == 5.0
    # for any head count and any head_dim divisible by 32: 4 payload bits + 2 x 16 bits per 32 elements
    for h, d in [(1, 32), (3, 64), (32, 256)]:
        assert f.bits_per_element(h, d) == 5.0


def test_block_bytes_counted_by_hand() -> None:
    # int8: keys uint8 [8, 64, 128] + per-channel fp16 scales and zero-points [8, 1, 128] each; values uint8 +
    # per-token fp16 scales and zero-points [8, 64, 1] each
    assert PRESETS["int8"].block_bytes(H, D) == (8 * 64 * 128 + 8 * 128 * (2 + 2)) + (8 * 64 * 128 + 8 * 64 * (2 + 2))
    assert PRESETS["int8"].block_bytes(H, D) == 137_216
    # int4 (asym): keys 4-bit [8, 64, 64 bytes] + scale and zero per channel; values 4-bit + scale and zero
    # per token per group of 32 (4 groups)
    keys = 8 * 64 * 64 + 8 * 128 * (2 + 2)
    values = 8 * 64 * 64 + 8 * 64 * 4 * (2 + 2)
    assert PRESETS["int4"].block_bytes(H, D) == keys + values == 77_824
    # kivi2: 2-bit keys per channel (scale + zero), 2-bit values in groups of 32 (scale + zero)
    assert PRESETS["kivi2"].block_bytes(H, D) == (8 * 64 * 32 + 8 * 128 * 4) + (8 * 64 * 32 + 8 * 64 * 4 * 4)
    # fp8: payload plus one fp16 scale per head, for K and V
    assert PRESETS["fp8-plain"].block_bytes(H, D) == 2 * (8 * 64 * 128 + 8 * 2)
    f = PRESETS["int8"]
    assert f.payload_bytes(H, D) + f.scale_bytes(H, D) == f.block_bytes(H, D)


def test_scale_dtype_is_part_of_the_byte_count() -> None:
    sizes = {}
    for sd in ScaleDType:
        spec = QuantSpec(DType.INT4, PerGroup(32), symmetric=False, scale_dtype=sd)
        sizes[sd] = spec.scale_bytes(H, B, D)
    groups = H * B * (D // 32)
    assert sizes[ScaleDType.FP32] == groups * 8
    assert sizes[ScaleDType.FP16] == sizes[ScaleDType.BF16] == groups * 4
    assert sizes[ScaleDType.E8M0] == groups * (1 + 2)  # uint8 exponent + fp16 zero-point
    sym = QuantSpec(DType.INT4, PerGroup(32), symmetric=True, scale_dtype=ScaleDType.E8M0)
    assert sym.scale_bytes(H, B, D) == groups  # no zero-point when symmetric
    # 4-bit payload with one E8M0 scale per 32 elements: 4.25 bits (the microscaling layout)
    assert KVFormat(sym, sym).bits_per_element(H, D) == 4.25


def test_sizes_scale_with_layers_and_tokens() -> None:
    f = PRESETS["int8"]
    assert f.bytes_per_token(H, D, layers=80) == 80 * f.block_bytes(H, D) / 64
    # worked example of the reference article: 80 layers, 8 kv heads, head_dim 128, fp16
    fp16 = PRESETS["fp16"]
    assert fp16.bytes_per_token(H, D, layers=80) == 327_680
    gib = 1024**3
    assert fp16.bytes_for_tokens(8 * 1024, H, D, layers=80) == 2.5 * gib
    assert fp16.bytes_for_tokens(128 * 1024, H, D, layers=80) == 40 * gib


def test_bytes_for_tokens_counts_sealed_blocks_and_the_tail() -> None:
    f = PRESETS["int4"]
    tail = 2 * H * B * D * 2  # one fp16 block of K and V
    sink = 2 * H * 1 * D * 2  # the preset keeps sink=1: one fp16 position of K and V
    assert f.sink == 1 and f.sink_bytes(H, D) == sink
    assert f.tail_bytes(H, D) == tail
    assert f.bytes_for_tokens(0, H, D) == tail + sink  # tail and sink are allocated with the sequence
    assert f.bytes_for_tokens(63, H, D) == tail + sink
    assert f.bytes_for_tokens(64, H, D) == f.block_bytes(H, D) + tail + sink
    assert f.bytes_for_tokens(130, H, D, layers=3) == 3 * (2 * f.block_bytes(H, D) + tail + sink)
    assert f.bytes_for_tokens(64, H, D, tail_element_bytes=4) == f.block_bytes(H, D) + 2 * tail + 2 * sink
    # without the sink: sealed blocks and the tail only
    f0 = parse_format("int4,sink=0")
    assert f0.block_bytes(H, D) == f.block_bytes(H, D)
    assert f0.bytes_for_tokens(0, H, D) == tail
    assert f0.bytes_for_tokens(130, H, D, layers=3) == 3 * (2 * f.block_bytes(H, D) + tail)
    # passthrough has no separate tail: tokens live in fp16 blocks, the last one partly filled
    fp16 = PRESETS["fp16"]
    assert fp16.bytes_for_tokens(1, H, D) == fp16.block_bytes(H, D)
    assert fp16.bytes_for_tokens(64, H, D) == fp16.block_bytes(H, D)
    assert fp16.bytes_for_tokens(65, H, D) == 2 * fp16.block_bytes(H, D)


def test_padding_is_counted_for_odd_head_dims() -> None:
    # int2 with head_dim 6: 12 bits per row pad to 2 bytes; int4 with head_dim 5: 20 bits pad to 3 bytes
    int2 = QuantSpec(DType.INT2, PerChannel(), symmetric=False)
    assert int2.packed_head_dim(6) == 2
    assert int2.payload_bytes(1, 64, 6) == 64 * 2
    int4 = QuantSpec(DType.INT4, PerToken(), symmetric=True)
    assert int4.packed_head_dim(5) == 3
    f = KVFormat(int2, int2)
    assert f.bits_per_element(1, 6) > 2 + 2 * 16 * 6 / (6 * 64)  # padding pushes it past payload + scales
    assert f.bits_per_element(1, 6) == 8 * (2 * (64 * 2 + 6 * 4)) / (2 * 64 * 6)


SPECS_FOR_STORAGE = [
    QuantSpec(DType.INT8, PerChannel()),
    QuantSpec(DType.INT8, PerToken(), symmetric=False, scale_dtype=ScaleDType.FP32),
    QuantSpec(DType.INT4, PerChannel(), symmetric=False),
    QuantSpec(DType.INT4, PerToken(), scale_dtype=ScaleDType.E8M0),
    QuantSpec(DType.INT2, PerHead(), symmetric=False, scale_dtype=ScaleDType.E8M0),
    QuantSpec(DType.INT2, PerTensor(), scale_dtype=ScaleDType.BF16),
    QuantSpec(DType.FP8_E4M3, PerHead()),
    QuantSpec(DType.FP8_E5M2, PerChannel(), scale_dtype=ScaleDType.FP32),
    QuantSpec(DType.FP16),
    QuantSpec(DType.FP32),
]


@pytest.mark.parametrize("spec", SPECS_FOR_STORAGE, ids=str)
@pytest.mark.parametrize("head_dim", [1, 3, 5, 6, 7, 64, 96, 128])
def test_accounting_matches_what_quantize_stores(spec: QuantSpec, head_dim: int) -> None:
    x = torch.randn(3, 16, head_dim)
    qt = quantize(x, spec)
    assert qt.nbytes() == spec.block_bytes(3, 16, head_dim)
    assert qt.data.shape[-1] == spec.packed_head_dim(head_dim)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_accounting_matches_stored_blocks(name: str) -> None:
    f = PRESETS[name]
    k, v = torch.randn(2, H, B, D), torch.randn(2, H, B, D)  # two blocks
    seal_k = quantize_outliers if f.key.has_outliers else quantize  # + fp16 residuals and per-block indices
    stored = seal_k(k, f.key).nbytes() + quantize(v, f.value).nbytes()
    assert stored == 2 * f.block_bytes(H, D)


@pytest.mark.parametrize("name", list(PRESETS))
def test_honest_bits_never_below_nominal(name: str) -> None:
    f = PRESETS[name]
    for h, d in [(1, 64), (8, 128), (2, 96), (32, 256)]:
        assert f.bits_per_element(h, d) >= (f.key.bits + f.value.bits) / 2


# ----------------------------------------------------------------------------------------------------
# String syntax


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_round_trip(name: str) -> None:
    f = PRESETS[name]
    assert parse_format(f.spec_string()) == f
    assert parse_format(f.spec_string()).name == name  # a custom string that spells a preset gets its name
    assert parse_format(name) is f
    assert parse_format(name.upper()) is f
    assert parse_format(f) is f


CUSTOM = [
    "k=int4:channel:asym,v=int2:g32:asym:fp16,block=64",
    "k=int8:channel:sym:fp32,v=int8:token:asym:bf16,block=16",
    "kv=int4:g64:sym:e8m0,block=128",
    "k=fp8_e5m2:channel:fp32,v=fp8_e4m3:token,block=32",
    "k=fp16,v=int4:g16",
    "k=bf16,v=bf16,block=1",
    "kv=int2:tensor:asym:e8m0",
    "k = int8 : channel , v = int8 : token",
]


@pytest.mark.parametrize("text", CUSTOM)
def test_custom_round_trip(text: str) -> None:
    f = parse_format(text)
    assert parse_format(f.spec_string()) == f
    assert parse_format(f.spec_string()).spec_string() == f.spec_string()


def test_parse_defaults_and_aliases() -> None:
    f = parse_format("k=int8,v=int8")  # keys per channel, values per token, int8 symmetric, fp16 scales, no sink
    assert f.key == QuantSpec(DType.INT8, PerChannel()) and f.value == QuantSpec(DType.INT8, PerToken())
    assert f.sink == 0 and f != PRESETS["int8"].with_sink(0)  # the preset's keys and values carry zero-points
    f = parse_format("k=int8:asym,v=int8:asym,sink=1")  # spelled with the preset's fields and sink: the preset
    assert f == PRESETS["int8"] and f.name == "int8"
    f = parse_format("kv=int4")
    assert f.key.granularity == PerChannel() and f.value.granularity == PerToken()
    assert not f.key.symmetric  # sub-byte ints default to asymmetric
    assert parse_format("kv=fp8").key == QuantSpec(DType.FP8_E4M3, PerHead())
    assert parse_format("kv=e5m2").key.dtype is DType.FP8_E5M2
    assert parse_format("kv=int4:group32").key.granularity == PerGroup(32)
    assert parse_format("kv=int4:fp8").key.scale_dtype is ScaleDType.E8M0
    assert parse_format("key=int8:channel:asym,values=int8:token:asym,block_size=64,sink=1") == PRESETS["int8"]


def test_block_size_variants() -> None:
    f = parse_format("int8,block=32")
    assert f.block_size == 32 and f.key == PRESETS["int8"].key
    assert f.name == "int8,block=32"
    assert parse_format(f.name) == f
    assert parse_format(f.spec_string()) == f
    assert parse_format("int8,block=64") is PRESETS["int8"]
    assert PRESETS["int4"].with_block_size(128).bits_per_element(H, D) < PRESETS["int4"].bits_per_element(H, D)


def test_formats_are_frozen_and_hashable() -> None:
    f = PRESETS["int8"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.block_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.key.symmetric = False  # type: ignore[misc]
    assert len({parse_format("int8"), parse_format("k=int8:asym,v=int8:asym,sink=1"), PRESETS["int4"]}) == 2
    assert len({parse_format("int8"), parse_format("int8,sink=0")}) == 2  # the sink is part of the format


# ----------------------------------------------------------------------------------------------------
# Errors: typed, and they say how to fix it


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(FormatError) as info:
        parse_format("int3")
    for name in PRESETS:
        assert name in str(info.value)
    with pytest.raises(FormatError, match="presets are"):
        preset("nope")


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("k=int3,v=int8", ["unknown key dtype 'int3'", "int8", "fp8_e4m3", "int2"]),
        ("kv=int8:perchannel", ["unknown field 'perchannel'", "channel", "token", "g<N>", "sym|asym", "e8m0"]),
        ("k=int8,v=int8,foo=1", ["unknown field 'foo'", "k=SPEC"]),
        ("kv=fp8:channel:asym:static", ["midpoint", "drop 'static' or 'asym'"]),
        ("kv=fp8_e5m2:head:asym:static", ["calibration cannot give"]),
        ("k=int8", ["needs both k= and v="]),
        ("int8,k=int4", ["either a preset or k=/v= specs"]),
        ("int8,int4", ["only one preset"]),
        ("int8,block=0", ["block must be a positive integer"]),
        ("int8,block=x", ["block must be a positive integer"]),
        ("int8,block=²", ["block must be a positive integer"]),
        ("kv=int4:g0", ["group size must be a positive integer"]),
        ("kv=int4:g²", ["unknown field"]),
        ("kv=fp16:channel", ["takes no fields"]),
        ("kv=int8:channel:token", ["granularity twice", "keep one"]),
        ("kv=int8:sym:asym", ["symmetry twice"]),
        ("kv=int8:fp16:e8m0", ["scale dtype twice"]),
        ("", ["empty format"]),
        ("k=,v=int8", ["empty key spec"]),
    ],
)
def test_bad_strings_raise_clear_format_errors(text: str, needles: list[str]) -> None:
    with pytest.raises(FormatError) as info:
        parse_format(text)
    for n in needles:
        assert n in str(info.value), f"{n!r} not in {info.value}"


def test_groups_that_do_not_divide_head_dim_become_narrower_never_wider() -> None:
    g32 = PerGroup(32)
    # exactly 32 where it divides; Phi-2's 80: four groups of 20 (three of 26.7 cannot be); 120: five of 24
    assert [g32.width(d) for d in (64, 96, 128, 256, 80, 120, 48, 112, 40)] == [32, 32, 32, 32, 20, 24, 24, 28, 20]
    assert PerGroup(64).scale_shape(2, 16, 96) == (2, 16, 2)  # 96 = 2 x 48
    for size in range(1, 70):
        for d in range(1, 300):
            n = PerGroup(size).groups(d)
            assert d % n == 0 and d // n <= size  # equal groups, never wider than asked
            fewer = [m for m in range(-(-d // size), n) if d % m == 0]
            # the fewest such groups, preferring whole 4-channel runs (packed 2- and 4-bit codes fill bytes)
            assert not any((d // m) % 4 == 0 for m in fewer)
            if d % size and (d // n) % 4:  # (where size divides d, the groups are exactly size wide)
                assert not any((d // m) % 4 == 0 for m in range(n, d + 1) if d % m == 0)
    f = parse_format("int4")  # keys per channel, values in g32
    assert f.reasons_invalid(80) == []
    # the narrower groups are paid in bytes: 4 value scales and zeros per token at 80 instead of 2.5
    assert f.value.scale_bytes(1, 64, 80) == 64 * 4 * 2 * 2
    assert f.bits_per_element(1, 80) > f.bits_per_element(1, 64)
    PRESETS["int4-g32"].check(96)  # 96 = 3 x 32
    with pytest.raises(FormatError, match="head_dim must be positive"):
        PRESETS["int8"].check(0)


def test_spec_validation_in_post_init() -> None:
    with pytest.raises(FormatError, match="needs a granularity"):
        QuantSpec(DType.INT8)
    with pytest.raises(FormatError, match="takes no granularity"):
        QuantSpec(DType.FP16, PerToken())
    with pytest.raises(FormatError, match="must be a DType"):
        QuantSpec("int8", PerToken())  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="block_size must be a positive integer"):
        KVFormat(PRESETS["int8"].key, PRESETS["int8"].value, block_size=0)
    with pytest.raises(FormatError):
        PerGroup(-4)
    assert math.isclose(PRESETS["int8"].bytes_per_token(H, D), 137_216 / 64)


@pytest.mark.parametrize("text", ["int4,sink=1,sink=2", "int4,block=16,block_size=32", "k=int8,kv=int8,v=int8",
                                  "k=int8,v=int8,key=int4"])  # fmt: skip
def test_a_field_given_twice_is_refused(text: str) -> None:
    with pytest.raises(FormatError, match="given twice"):
        parse_format(text)
