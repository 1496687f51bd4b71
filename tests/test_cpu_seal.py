"""The compiled seal (kvpack.kernels.cpu_seal) against the torch quantizer: the same bytes, every time."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvpack import parse_format
from kvpack.formats import PRESETS, QuantSpec
from kvpack.kernels import cpu_seal
from kvpack.quant import quantize

pytest.importorskip("numba")

POISON = 0xA5


def _rows(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [n, width] uint8 with a poisoned gap after each row, backing buffer)``."""
    buf = torch.full((n, width + 8), POISON, dtype=torch.uint8)
    return buf[:, :width], buf


def _expected(x: torch.Tensor, spec: QuantSpec) -> list[torch.Tensor]:
    qt = quantize(x, spec)
    k = x.shape[0]
    parts = [qt.data, qt.scale] + ([qt.zero] if spec.has_zero else [])
    return [p.contiguous().view(torch.uint8).reshape(k, -1) for p in parts]


def _seal(x: torch.Tensor, spec: QuantSpec, ids: np.ndarray, nb: int) -> tuple[bool, list[torch.Tensor], list]:
    want = _expected(x, spec) if torch.isfinite(x).all() else None
    widths = [w.shape[1] for w in want] if want is not None else _widths(x, spec)
    outs = [_rows(nb, w) for w in widths]
    ok = cpu_seal.seal_blocks(x, spec, ids, outs[0][0], outs[1][0], outs[2][0] if spec.has_zero else None)
    return ok, want, outs


def _widths(x: torch.Tensor, spec: QuantSpec) -> list[int]:
    return [w.shape[1] for w in _expected(torch.zeros_like(x), spec)]


def _check(x: torch.Tensor, spec: QuantSpec, seed: int = 0) -> None:
    k = x.shape[0]
    nb = k + 3
    ids = np.random.default_rng(seed).permutation(nb)[:k].astype(np.int64)
    ok, want, outs = _seal(x, spec, ids, nb)
    assert ok
    for (rows, buf), w in zip(outs, want):
        assert torch.equal(rows[torch.from_numpy(ids)], w), f"{spec}: bytes differ"
        assert (buf[:, -8:] == POISON).all(), "a write strayed past its row"
        others = [i for i in range(nb) if i not in set(ids.tolist())]
        assert (rows[others] == POISON).all(), "a row that was not sealed was written"


SPECS = sorted({str(s) for f in PRESETS.values() for s in (f.key, f.value) if cpu_seal.supports(s)})
EXTRA = ["int8:token:asym:fp16", "int4:channel:sym:fp16", "int2:g16:sym:fp16", "int8:head:sym:fp16",
         "int4:tensor:asym:fp16", "int2:channel:asym:fp16"]  # fmt: skip


def test_every_integer_preset_takes_the_compiled_seal():
    assert {"int8:channel:sym:fp16", "int4:channel:asym:fp16", "int4:g32:asym:fp16", "int2:g32:asym:fp16"} <= set(SPECS)
    assert not cpu_seal.supports(parse_format("fp8").key)  # fp8 and rotated keys stay on the torch quantizer
    assert not cpu_seal.supports(parse_format("int4-o4").key)  # outlier channels too


def _key(spec: str) -> QuantSpec:
    return parse_format(f"k={spec},v={spec}").key


SHAPES = [(3, 2, 64, 64), (1, 1, 16, 256), (2, 3, 32, 48)]  # [blocks, kv heads, block size, head_dim]
CASES = [(s, shape) for s in SPECS + EXTRA for shape in SHAPES if not _key(s).reasons_invalid(shape[-1])]


@pytest.mark.parametrize(("spec", "shape"), CASES)
def test_compiled_seal_writes_the_torch_quantizers_bytes(spec, shape):
    q = _key(spec)
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    x[..., 5] += 40.0  # an outlier channel
    x[0, 0, :, 7] = 2.5  # a constant channel: zero span, scale 1
    x[-1, -1, 3] = 0.0  # a zero token
    _check(x, q)
    _check(x.to(torch.bfloat16), q)  # the model's dtype: upcast like quantize does


@pytest.mark.parametrize("spec", ["int4:channel:asym:fp16", "int8:channel:sym:fp16", "int2:g32:asym:fp16"])
@pytest.mark.parametrize("scale", [1e-7, 3e-5, 1e3, 1e6])
def test_float16_edges_tiny_and_saturated_scales(spec, scale):
    """Scales below float16's normals (kept at 2**-14) and zero-points past its range (saturated)."""
    q = _key(spec)
    x = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(3)) * scale
    _check(x, q)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=hnp.arrays(np.float32, (1, 2, 8, 16), elements=st.floats(-7e4, 7e4, width=32, allow_subnormal=True)),
    spec=st.sampled_from(["int4:channel:asym:fp16", "int8:token:sym:fp16", "int2:g8:asym:fp16"]),
)
def test_any_finite_block_seals_to_the_same_bytes(x, spec):
    _check(torch.from_numpy(x.copy()), _key(spec))


def test_a_non_finite_block_writes_nothing():
    q = parse_format("int4").key
    x = torch.randn(2, 2, 64, 64)
    x[1, 0, 9, 3] = float("nan")
    rows, buf = _rows(4, 2 * 64 * 32)
    srows, sbuf = _rows(4, 2 * 64 * 2)
    zrows, zbuf = _rows(4, 2 * 64 * 2)
    assert not cpu_seal.seal_blocks(x, q, np.array([0, 2]), rows, srows, zrows)
    assert (buf == POISON).all() and (sbuf == POISON).all() and (zbuf == POISON).all()


def test_gather_blocks_assembles_tail_rows_then_the_steps_rows():
    g = torch.Generator().manual_seed(0)
    tail, new = torch.randn(3, 2, 8, 4, generator=g), torch.randn(20, 2, 4, generator=g)
    slots, froms, toks = np.array([2, 0]), np.array([5, 0]), np.array([3, 12])
    x, finite = cpu_seal.gather_blocks(tail, new, slots, froms, toks)
    assert finite and x.shape == (2, 2, 8, 4)
    assert torch.equal(x[0], torch.cat([tail[2, :, :5], new[3:6].transpose(0, 1)], dim=1))
    assert torch.equal(x[1], new[12:20].transpose(0, 1))
    new[14, 1, 2] = float("inf")
    assert not cpu_seal.gather_blocks(tail, new, slots, froms, toks)[1]


@pytest.mark.parametrize(
    ("slots", "froms", "toks"),
    [([3], [2], [0]), ([0], [9], [0]), ([0], [0], [13]), ([0], [2], [-1])],  # slot, tail rows, step rows, negative
)
def test_gather_blocks_refuses_rows_outside_its_inputs(slots, froms, toks):
    from kvpack.errors import ShapeError

    with pytest.raises(ShapeError, match="outside"):
        cpu_seal.gather_blocks(torch.zeros(3, 2, 8, 4), torch.zeros(20, 2, 4), *map(np.array, (slots, froms, toks)))


@pytest.mark.parametrize(
    ("slots", "froms", "toks"),
    [([3], [2], [0]), ([0], [9], [0]), ([0], [0], [13]), ([0], [2], [-1]), ([-1], [1], [0])],
)
def test_seal_step_refuses_rows_outside_its_inputs_and_writes_nothing(slots, froms, toks):
    """The step's seal checks its indices in the compiled call (slot, tail rows, step rows, negatives): a typed
    error, and every page row as it was. A block with no tail rows reads no slot (any slot passes)."""
    from kvpack.errors import ShapeError

    fmt = PRESETS["int8"].with_block_size(8)
    h, t, d = 2, 8, 64
    tails = (torch.randn(3, h, t, d), torch.randn(3, h, t, d))
    new = (torch.randn(20, h, d), torch.randn(20, h, d))
    widths = {p: [w.shape[1] for w in _expected(torch.randn(1, h, t, d), spec)] for p, spec in
              (("k", fmt.key), ("v", fmt.value))}  # fmt: skip
    rows = tuple(tuple(torch.full((4, w), 7, dtype=torch.uint8) for w in widths[p]) for p in "kv")
    before = [r.clone() for part in rows for r in part]
    args = (*map(np.array, (slots, froms, toks)), np.array([1]), (fmt.key, fmt.value), rows)
    with pytest.raises(ShapeError, match="outside"):
        cpu_seal.seal_step(tails, new, *args)
    assert all(torch.equal(a, b) for a, b in zip(before, [r for part in rows for r in part]))
    assert cpu_seal.seal_step(tails, new, np.array([-1]), np.array([0]), np.array([12]), np.array([1]),
                              (fmt.key, fmt.value), rows)  # fmt: skip
    assert not all(torch.equal(a, b) for a, b in zip(before, [r for part in rows for r in part]))


def test_step_writes_seal_and_write_rows_in_one_call_or_refuse_with_nothing_written():
    """``StepWrites``: a step's seal and tail rows in one compiled call give the bytes of ``seal_step`` then
    ``write_rows``; an index outside the tails or the step's rows (a sealed block's or a tail row's) is a typed
    error, and a non-finite value in a sealed block returns False: in each case no page row and no tail changed."""
    from kvpack.errors import ShapeError

    fmt = PRESETS["int4"].with_block_size(8)
    h, t, d = 2, 8, 64
    g = torch.Generator().manual_seed(3)
    widths = {p: [w.shape[1] for w in _expected(torch.randn(1, h, t, d), spec)] for p, spec in
              (("k", fmt.key), ("v", fmt.value))}  # fmt: skip

    def state():
        tails = (torch.randn(3, h, t, d, generator=g), torch.randn(3, h, t, d, generator=g))
        rows = tuple(tuple(torch.full((4, w), 7, dtype=torch.uint8) for w in widths[p]) for p in "kv")
        return tails, rows

    i64 = functools.partial(np.array, dtype=np.int64)
    new = (torch.randn(20, h, d, generator=g), torch.randn(20, h, d, generator=g))
    seal = (i64([2]), i64([5]), i64([0]), i64([1]))  # slot 2's 5 tail rows and the step's rows 0-2 into page 1
    rows_to = (i64([3, 4]), i64([0, 0]), i64([6, 7]))  # step rows 3 and 4 to slot 0 at 6 and 7
    (tails_a, rows_a), (tails_b, rows_b) = state(), state()
    for x, y in zip(
        (*tails_a, *[r for part in rows_a for r in part]), (*tails_b, *[r for part in rows_b for r in part])
    ):
        y.copy_(x)
    assert cpu_seal.StepWrites(tails_a, rows_a, (fmt.key, fmt.value))(cpu_seal.row_arrays(*new), *seal, *rows_to)
    assert cpu_seal.seal_step(tails_b, new, *seal, (fmt.key, fmt.value), rows_b)
    cpu_seal.write_rows(tails_b, new, *rows_to)
    for x, y in zip(
        (*tails_a, *[r for part in rows_a for r in part]), (*tails_b, *[r for part in rows_b for r in part])
    ):
        assert torch.equal(x, y)

    bad_new = (new[0].clone(), new[1].clone())
    bad_new[1][1, 0, 5] = float("nan")
    cases = [
        ("sealed blocks", new, (i64([3]), i64([5]), i64([0]), i64([1])), rows_to),  # slot outside the tails
        ("tail rows", new, seal, (i64([3, 20]), i64([0, 0]), i64([6, 7]))),  # a step row that does not exist
        ("tail rows", new, seal, (i64([3]), i64([0]), i64([8]))),  # an offset past the block
        (None, bad_new, seal, rows_to),  # a NaN in the sealed block's values
    ]
    for what, step_new, step_seal, step_rows in cases:
        tails, rows = state()
        before = [x.clone() for x in (*tails, *[r for part in rows for r in part])]
        writes = cpu_seal.StepWrites(tails, rows, (fmt.key, fmt.value))
        if what is None:
            assert not writes(cpu_seal.row_arrays(*step_new), *step_seal, *step_rows)
        else:
            with pytest.raises(ShapeError, match=what):
                writes(cpu_seal.row_arrays(*step_new), *step_seal, *step_rows)
        after = (*tails, *[r for part in rows for r in part])
        assert all(torch.equal(a, b) for a, b in zip(before, after)), what


REFINED = ["int4:channel:asym:fp16:o5r", "int4:channel:sym:fp16:o4r", "int2:channel:asym:fp16:o3r",
           "int8:channel:asym:fp16:o6r", "int8:channel:sym:fp16:o4qr", "int4:channel:asym:fp16:o6qr"]  # fmt: skip


@pytest.mark.parametrize("spec", REFINED)
@pytest.mark.parametrize("shape", [(3, 2, 64, 64), (2, 1, 16, 320)])  # head_dim 320: int16 channel indices
def test_refined_channels_take_the_compiled_seal_and_write_the_torch_seals_bytes(spec, shape):
    """A refined key spec (``o<k>r``, ``o<k>qr``) seals as without its kept channels, then
    :func:`cpu_seal.refine_blocks` writes the refinement codes and channel indices: every byte equals the torch
    seal's (:func:`kvpack.cache.write.seal_outliers`), ties in the channel ranking included (two equal channels,
    channels no query reads)."""
    from kvpack.cache.write import seal_outliers

    q = parse_format(f"k={spec},v=int8").key
    assert cpu_seal.supports(q)
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g) * 3
    x[..., 5] += 40.0
    x[..., 9] = x[..., 8]  # a tie: the lower channel is kept first
    x[0, 0, :, 7] = 2.5  # a constant channel
    energy = torch.rand(shape[1], shape[-1], generator=g) * 2
    energy[:, :3] = 0.0  # channels no query reads: ties broken by the spread
    k, nb = shape[0], shape[0] + 3
    ids = np.random.default_rng(1).permutation(nb)[:k].astype(np.int64)
    qt, _, (res, idx) = seal_outliers(x, q, None, None, energy if q.query_ranked else None)
    want = [t.contiguous().view(torch.uint8).reshape(k, -1) for t in (qt.data, qt.scale, res, idx)]
    rows = [_rows(nb, w.shape[1]) for w in want]
    zero = _rows(nb, want[1].shape[1])
    data, scale, res_rows, idx_rows = (r[0] for r in rows)
    assert cpu_seal.seal_blocks(x, q, ids, data, scale, zero[0] if q.has_zero else None)
    cpu_seal.refine_blocks(x, q, ids, (data, scale, zero[0] if q.has_zero else None), (res_rows, idx_rows),
                           energy if q.query_ranked else None)  # fmt: skip
    for (r, buf), w, name in zip(rows, want, ("payload", "scales", "refinement codes", "indices")):
        assert torch.equal(r[torch.from_numpy(ids)], w), f"{spec}: {name} differ"
        assert (buf[:, -8:] == POISON).all(), "a write strayed past its row"
