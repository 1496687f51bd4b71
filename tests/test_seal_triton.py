"""The Triton seal kernel (write path) is bit-identical to quant.quantize, under the Triton interpreter.

The interpreter's float32 -> fp8 and -> bfloat16 casts round wrongly (upstream triton issue 8322: bf16 is
truncated, the fp8 rounding carry lands in the exponent). A GPU rounds to nearest even, so the test set-up
swaps in correct casts (``_triton_interpreter.fixed_interpreter``) and every case, fp8 included, is
checked byte for byte. Scale rounding does not depend on it: the kernel rounds to nearest and then steps
once toward the required direction, which gives the same directed rounding from a truncated cast.
"""

from __future__ import annotations

import pytest
import torch

from _triton_interpreter import fixed_interpreter
from kvpack.errors import NonFiniteError, ShapeError, UnsupportedError
from kvpack.formats import parse_format
from kvpack.kernels import reference
from kvpack.kernels import triton_decode as td
from kvpack.kernels.triton_seal import reasons_unsupported, seal_blocks, seal_into
from kvpack.kernels.views import PagedKV
from kvpack.quant import payload_torch_dtype, quantize, scale_torch_dtype
from kvpack.testing import assert_bitexact, assert_close, realistic_keys

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreter_fixes():
    with fixed_interpreter():
        yield


def _spec(text: str, block: int = 16):
    return parse_format(f"kv={text},block={block}").key


def _hard_values(n: int, h: int, b: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Keys with outlier channels, plus blocks that stress rounding: constant, tiny, huge, exact ties."""
    x = realistic_keys(n, h, b, d, generator=g)
    x[0, 0] = 0.0  # all zero: scale falls back to 1
    x[0, 1] = 3e-9 * torch.randn(b, d, generator=g)  # scales below the fp16 smallest normal
    x[1, 0] = torch.randint(-127, 128, (b, d), generator=g).float() + 0.5  # ties between codes
    x[1, 1, :, :2] = 3.0e4  # near the fp16 top
    return x


SPECS = [
    "int8:channel:sym:fp16",
    "int8:token:sym:fp16",
    "int8:token:asym:e8m0",
    "int8:tensor:sym:e8m0",
    "int4:channel:asym:fp16",
    "int4:g32:asym:fp16",
    "int4:g16:sym:bf16",
    "int4:head:sym:fp32",
    "int2:g32:asym:fp16",
    "int2:channel:asym:bf16",
    "fp8_e4m3:head:fp16",
    "fp8_e4m3:channel:e8m0",
    "fp8_e5m2:token:fp32",
]


@pytest.mark.parametrize("text", SPECS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_seal_is_bit_identical_to_quantize(text, x_dtype):
    g = torch.Generator().manual_seed(len(text))
    spec = _spec(text)
    x = _hard_values(3, 2, 16, 64, g).to(x_dtype)
    got, want = seal_blocks(x, spec), quantize(x, spec)
    assert_bitexact(got.data, want.data, f"{text} payload")
    if want.scale is not None:
        assert_bitexact(got.scale, want.scale, f"{text} scale")
    if want.zero is not None:
        assert_bitexact(got.zero, want.zero, f"{text} zero")


@pytest.mark.parametrize("text", ["int4:g32:asym:fp16", "int8:channel:sym:fp16", "fp8_e4m3:head:fp16"])
def test_seal_into_scatters_to_block_ids_and_nothing_else(text):
    spec = _spec(text, block=32)
    g = torch.Generator().manual_seed(1)
    x = realistic_keys(3, 2, 32, 32, generator=g).half()
    num_blocks, ids = 8, torch.tensor([5, 1, 6], dtype=torch.int64)
    data = torch.full((num_blocks, 2, 32, spec.packed_head_dim(32)), 0x5A, dtype=torch.uint8)
    data = data.view(payload_torch_dtype(spec))
    shape = spec.scale_shape(2, 32, 32)
    scale = torch.full(
        (num_blocks, *shape), 7, dtype=torch.uint8 if spec.scale_dtype.value == "e8m0" else torch.float16
    )
    zero = torch.full((num_blocks, *shape), -3.0, dtype=scale_torch_dtype(spec.zero_dtype)) if spec.has_zero else None
    before = (data.clone(), scale.clone(), None if zero is None else zero.clone())
    seal_into(x, spec, data, scale, zero, ids)
    want = quantize(x, spec)
    untouched = [i for i in range(num_blocks) if i not in ids.tolist()]
    for pool, old, ref in ((data, before[0], want.data), (scale, before[1], want.scale), (zero, before[2], want.zero)):
        if pool is None:
            continue
        assert_bitexact(pool[ids], ref, text)
        assert_bitexact(pool[untouched], old[untouched], f"{text} wrote outside its blocks")


def test_sealed_blocks_decode_like_the_reference():
    """The GPU write path and the GPU read path together, on one cache: seal, then attend."""
    fmt = parse_format("k8v4,block=16")
    h, b, d, n = 2, 16, 64, 3
    g = torch.Generator().manual_seed(2)
    k = realistic_keys(n, h, b, d, generator=g)
    v = torch.randn(n, h, b, d, generator=g)
    pools = {}
    for role, spec, x in (("k", fmt.key, k), ("v", fmt.value, v)):
        data = torch.zeros(n + 1, h, b, spec.packed_head_dim(d), dtype=payload_torch_dtype(spec))
        shape = spec.scale_shape(h, b, d)
        scale = torch.zeros(n + 1, *shape, dtype=scale_torch_dtype(spec.scale_dtype))
        zero = torch.zeros(n + 1, *shape, dtype=scale_torch_dtype(spec.zero_dtype)) if spec.has_zero else None
        seal_into(x, spec, data, scale, zero, torch.tensor([3, 1, 2], dtype=torch.int32))
        pools[role] = (data, scale, zero)
    tail = torch.randn(1, h, b, d)
    kv = PagedKV(fmt, d, *pools["k"], *pools["v"], torch.tensor([[3, 1, 2]], dtype=torch.int32),
                 torch.tensor([n * b + 5], dtype=torch.int32), tail, tail.clone())  # fmt: skip
    q = torch.randn(1, 4, d)
    assert_close(td.decode_attention(q, kv, num_splits=2), reference.decode_attention(q, kv), 2e-5, 1e-4)


def test_non_finite_input_is_refused_and_pools_stay_intact():
    spec = _spec("int8:channel:sym:fp16")
    x = torch.randn(2, 2, 16, 32)
    x[1, 0, 7, 3] = float("nan")
    data = torch.zeros(4, 2, 16, 32, dtype=torch.int8)
    scale = torch.zeros(4, 2, 1, 32, dtype=torch.float16)
    with pytest.raises(NonFiniteError, match="head 0, position 7") as e:
        seal_into(x, spec, data, scale, None, torch.tensor([1, 2]))
    assert e.value.where[0]["channel"] == 3
    assert not data.any() and not scale.any()


def test_bad_pools_and_unsupported_shapes():
    spec = _spec("int4:g32:asym:fp16")
    x = torch.randn(2, 2, 16, 64)
    data = torch.zeros(4, 2, 16, 32, dtype=torch.uint8)
    scale = torch.zeros(4, 2, 16, 2, dtype=torch.float16)
    with pytest.raises(ShapeError, match="zero must be"):
        seal_into(x, spec, data, scale, None, torch.tensor([1, 2]))
    with pytest.raises(ShapeError, match="block_ids"):
        seal_into(x, spec, data, scale, scale.clone(), torch.tensor([1, 2, 3]))
    with pytest.raises(ShapeError, match="data must be"):
        seal_into(x, spec, data[..., :16], scale, scale.clone(), torch.tensor([1, 2]))
    odd = torch.randn(1, 2, 12, 96)  # block 12 and head_dim 96: not powers of two
    assert len(reasons_unsupported(odd, _spec("int8:channel:sym:fp16", block=12))) == 2
    with pytest.raises(UnsupportedError):
        seal_blocks(odd, _spec("int8:channel:sym:fp16", block=12))
    static = _spec("int8:channel:sym:fp16:static")
    assert any("static" in r for r in reasons_unsupported(torch.randn(1, 2, 16, 32), static))


def test_passthrough_specs_copy_the_values():
    spec = _spec("bf16")
    x = torch.randn(2, 2, 16, 32)
    got = seal_blocks(x, spec)
    assert_bitexact(got.data, quantize(x, spec).data)
