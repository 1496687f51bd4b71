"""Testing helpers: the three kinds of tolerance, and random paged caches built from the primitives.

* bit-exact (:func:`assert_bitexact`) for packing and anything that moves stored bytes;
* a signal-to-noise floor in dB per format (:data:`SNR_FLOOR_DB`, :func:`snr_db`) for quantize->dequantize;
* kernel vs oracle within a stated ``atol``/``rtol`` (:func:`assert_close`).
"""

from __future__ import annotations

import torch

from kvpack.formats import KVFormat, QuantSpec
from kvpack.kernels.views import PagedKV
from kvpack.outliers import index_dtype, quantize_outliers, residual_dtype
from kvpack.quant import payload_torch_dtype, quantize, scale_torch_dtype, snr_db
from kvpack.rotation import key_rotation, rotate, unrotate

__all__ = [
    "SNR_FLOOR_DB",
    "assert_bitexact",
    "assert_close",
    "cpu_kernel_tolerance",
    "random_paged_kv",
    "realistic_keys",
    "sink_attention_oracle",
    "snr_db",
]

# Quantize->dequantize floors on realistic_keys() data (Gaussian plus persistent outlier channels),
# per spec string. Measured values sit a few dB above; a floor breaking means a real regression.
SNR_FLOOR_DB: dict[str, float] = {
    "fp16": 60.0,
    "bf16": 45.0,
    "int8:channel:sym:fp16": 38.0,
    "int8:token:sym:fp16": 28.0,
    "fp8_e4m3:head:fp16": 28.0,
    "fp8_e5m2:head:fp16": 22.0,
    "int4:channel:asym:fp16": 18.0,
    "int4:g32:asym:fp16": 16.0,
    "int2:channel:asym:fp16": 5.0,
    "int2:g32:asym:fp16": 3.0,  # measured 5.1-5.2 dB: 5.0 sat within noise of it
}


def assert_bitexact(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Same shape, same dtype, same bytes."""
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    a = actual.contiguous().view(torch.uint8) if actual.element_size() == 1 else actual
    e = expected.contiguous().view(torch.uint8) if expected.element_size() == 1 else expected
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{msg} {len(bad)} elements differ, first at {bad[0].tolist()}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, msg: str = "") -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` everywhere, and no NaN/inf in ``actual``."""
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{msg} non-finite values in the result"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    if (err > bound).any():
        i = int((err - bound).argmax())
        raise AssertionError(
            f"{msg} max abs error {float(err.max()):.3g}; worst at flat index {i}: "
            f"{float(a.flatten()[i]):.6g} vs {float(e.flatten()[i]):.6g} (atol={atol}, rtol={rtol})"
        )


# The CPU kernel against the reference on the same stored bytes (derivations: tests/test_kernel_cpu.py):
# the float path differs by summation order; the integer path rounds the folded query and the weights to
# int16; fp8 codes on the integer path also round each code to a 12-bit grid of the format's largest value.
FLOAT_PATH_TOL = (2e-4, 2e-3)
INT_PATH_TOL = (1e-3, 1e-2)
FP8_INT_PATH_TOL = (2e-2, 5e-2)
# The CPU chunk kernel (kvpack.kernels.cpu_chunk) against the reference: scores at float32 accuracy, weights and
# values rounded to bfloat16 once (relative 2**-9; derivation and measurements: tests/test_kernel_cpu_chunk.py).
CPU_CHUNK_TOL = (1.2e-2, 1e-2)


def cpu_kernel_tolerance(kv: PagedKV, base: tuple[float, float] = FLOAT_PATH_TOL) -> tuple[float, float]:
    """``(atol, rtol)`` for the CPU kernel on ``kv`` against the reference, on the path it takes here: ``base``
    (the float path; pass a wider one for half-precision queries), widened to :data:`INT_PATH_TOL` when the
    integer path reads integer codes, or to :data:`FP8_INT_PATH_TOL` when it reads fp8 codes."""
    from kvpack.kernels import cpu_decode

    nbm = cpu_decode._nb()
    wide = None
    for spec, data, role in ((kv.format.key, kv.k_data, "key"), (kv.format.value, kv.v_data, "value")):
        p = cpu_decode._params(spec, kv, data, role)
        if p[nbm.P_DOT]:
            fp8 = p[nbm.P_KIND] in (nbm.E4M3, nbm.E5M2)
            wide = FP8_INT_PATH_TOL if fp8 or wide == FP8_INT_PATH_TOL else INT_PATH_TOL
    if wide is None:
        return base
    return max(base[0], wide[0]), max(base[1], wide[1])


def realistic_keys(
    *shape: int, outlier_channels: int = 4, outlier_scale: float = 12.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Gaussian ``[..., H, T, D]`` float32 with a few persistent large channels per head, as keys have."""
    x = torch.randn(*shape, generator=generator)
    d = shape[-1]
    h = shape[-3]
    for head in range(h):
        idx = torch.randperm(d, generator=generator)[:outlier_channels]
        x[..., head, :, idx] = x[..., head, :, idx] * outlier_scale + outlier_scale / 2
    return x


def _poison_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose values make any stray read visible (NaN for floats, extreme codes otherwise)."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.uint8 and dtype.itemsize == 1:
        return torch.full(shape, 0xFF, dtype=torch.uint8)
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=torch.int8)
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)  # fp8: 0x7f is NaN in e4m3


def _pool(spec: QuantSpec, blocks: list[torch.Tensor], ids: list[int], num_blocks: int, d: int):
    """Quantize each ``[H, B, D]`` block and scatter it into poisoned pools at ``ids``.

    Returns ``(data, scale, zero, outlier, outlier_idx)``; the last two are ``None`` unless the spec keeps
    outlier channels (then residuals and indices are chosen per block at seal time).
    """
    h, b = blocks[0].shape[0], blocks[0].shape[1] if blocks else (0, 0)
    outlier = outlier_idx = None
    if spec.has_outliers:
        obs = [quantize_outliers(x, spec) for x in blocks]
        qts = [ob.qt for ob in obs]
        outlier = _poison_like((num_blocks, h, b, spec.residual_width), residual_dtype(spec))
        idt = index_dtype(d)
        # out-of-range channel indices: a kernel that reads the null block's indices would fail loudly
        outlier_idx = torch.full((num_blocks, h, spec.outliers), 0xFF if idt == torch.uint8 else 0x7FFF, dtype=idt)
        for ob, i in zip(obs, ids):
            outlier[i] = ob.residual
            outlier_idx[i] = ob.idx
    else:
        qts = [quantize(x, spec) for x in blocks]
    data = _poison_like((num_blocks, h, b, spec.packed_head_dim(d)), payload_torch_dtype(spec))
    scale = zero = None
    shape = spec.scale_shape(h, b, d)
    if shape is not None:
        sdt = scale_torch_dtype(spec.scale_dtype)
        scale = (
            _poison_like((num_blocks, *shape), sdt)
            if sdt.is_floating_point
            else torch.full((num_blocks, *shape), 254, dtype=sdt)
        )
        if spec.has_zero:
            zero = _poison_like((num_blocks, *shape), scale_torch_dtype(spec.zero_dtype))
    for qt, i in zip(qts, ids):
        data[i] = qt.data
        if scale is not None:
            scale[i] = qt.scale
        if zero is not None:
            zero[i] = qt.zero
    return data, scale, zero, outlier, outlier_idx


def random_paged_kv(
    fmt: KVFormat,
    seq_lens: list[int],
    kv_heads: int = 2,
    head_dim: int = 64,
    tail_dtype: torch.dtype = torch.float32,
    shuffle: bool = True,
    spare_blocks: int = 3,
    seed: int = 0,
    sink: int = 0,
) -> tuple[PagedKV, list[torch.Tensor], list[torch.Tensor]]:
    """A :class:`PagedKV` with fresh random (never zero) keys and values, built with the primitives.

    Block ids are shuffled when ``shuffle`` (so the paged gather is really exercised); the null block,
    spare blocks and tail slots past each sequence's length are poisoned (NaN or extreme codes). A key spec
    with outlier channels gets ``k_outlier`` / ``k_outlier_idx`` pools (channels chosen per block at seal
    time), poisoned the same way (NaN residuals, out-of-range indices).

    With ``sink = S > 0`` (the format is given that sink) the view gets ``sink_k`` / ``sink_v``
    ``[batch, H, S, D]``: for positions ``p < min(S, sealed tokens)`` fresh random rows that differ from the
    block rows (a kernel that reads block 0 instead of the sink fails), NaN for the other positions (a kernel
    that reads the sink for a tail position fails). The returned keys and values hold the sink rows there.

    Returns:
        ``(kv, keys, values)``: the view, and per sequence the full-precision ``[H, seq_len, D]`` float32
        keys and values that were stored (before quantization).
    """
    g = torch.Generator().manual_seed(seed)
    sink = sink or fmt.sink
    if sink and fmt.sink != sink:
        fmt = fmt.with_sink(sink)
    b = fmt.block_size
    sink_k = sink_v = None
    if sink:
        sink_k = torch.full((len(seq_lens), kv_heads, sink, head_dim), float("nan"), dtype=tail_dtype)
        sink_v = sink_k.clone()
    total = sum(n // b for n in seq_lens)
    num_blocks = 1 + total + spare_blocks
    ids = list(range(1, num_blocks))
    if shuffle:
        ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
    max_blocks = max(1, max(n // b for n in seq_lens) + 1)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    tail_k = torch.full((len(seq_lens), kv_heads, b, head_dim), float("nan"), dtype=tail_dtype)
    tail_v = tail_k.clone()
    keys, values, kblocks, vblocks, used = [], [], [], [], []
    cursor = 0
    for row, n in enumerate(seq_lens):
        k = realistic_keys(kv_heads, n, head_dim, generator=g)
        v = torch.randn(kv_heads, n, head_dim, generator=g)
        if fmt.key.rotate:  # stored keys are k @ R; the natural keys returned are what the storage holds
            k = rotate(k, key_rotation(head_dim))
        k, v = k.to(tail_dtype).float(), v.to(tail_dtype).float()  # representable in the tail dtype
        nb, t = divmod(n, b)
        kr, vr = k, v  # what a reader must see: the sink rows replace the first sealed positions
        s = min(sink, nb * b)
        if s:
            sk = (3 * torch.randn(kv_heads, s, head_dim, generator=g)).to(tail_dtype)
            sv = (3 * torch.randn(kv_heads, s, head_dim, generator=g)).to(tail_dtype)
            sink_k[row, :, :s], sink_v[row, :, :s] = sk, sv
            kr, vr = k.clone(), v.clone()
            kr[:, :s], vr[:, :s] = sk.float(), sv.float()
        keys.append(unrotate(kr, key_rotation(head_dim)) if fmt.key.rotate else kr)
        values.append(vr)
        for j in range(nb):
            kblocks.append(k[:, j * b : (j + 1) * b])
            vblocks.append(v[:, j * b : (j + 1) * b])
            used.append(ids[cursor])
            tables[row, j] = ids[cursor]
            cursor += 1
        tail_k[row, :, :t] = k[:, nb * b :].to(tail_dtype)
        tail_v[row, :, :t] = v[:, nb * b :].to(tail_dtype)
    if not kblocks:  # keep shapes valid when nothing is sealed
        kblocks = [torch.randn(kv_heads, b, head_dim, generator=g)]
        vblocks = [torch.randn(kv_heads, b, head_dim, generator=g)]
        used = [ids[0]]
    kd, ks, kz, ko, koi = _pool(fmt.key, kblocks, used, num_blocks, head_dim)
    vd, vs, vz, _, _ = _pool(fmt.value, vblocks, used, num_blocks, head_dim)
    kv = PagedKV(
        format=fmt,
        head_dim=head_dim,
        k_data=kd,
        k_scale=ks,
        k_zero=kz,
        v_data=vd,
        v_scale=vs,
        v_zero=vz,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        tail_k=tail_k,
        tail_v=tail_v,
        k_outlier=ko,
        k_outlier_idx=koi,
        key_rotation=key_rotation(head_dim) if fmt.key.rotate else None,
        sink_k=sink_k,
        sink_v=sink_v,
    )
    return kv, keys, values


def sink_attention_oracle(q: torch.Tensor, kv: PagedKV, window: int | None = None) -> torch.Tensor:
    """Decode attention over a view with sink rows, from first principles (float64), for kernel tests.

    The history is :func:`kvpack.kernels.reference.dense_history` of the view *without* its sink, with the
    first ``min(S, n_sealed)`` positions replaced by the sink rows, masked by ``start_pos`` and the window;
    independent of how any backend (the reference included) implements sinks.

    Args:
        q: ``[batch, Hq, D]``, any float dtype.
        kv: the view (``kv.sink_k`` / ``kv.sink_v`` set).
        window: the sliding window of the call, ``None`` for none.

    Returns:
        ``[batch, Hq, D]`` float32; zeros for a row with nothing to attend.
    """
    import dataclasses

    from kvpack.kernels import reference

    plain = dataclasses.replace(kv, sink_k=None, sink_v=None)
    batch, hq, d = q.shape
    group = hq // kv.kv_heads
    out = torch.zeros(batch, hq, d, dtype=torch.float64)
    for row in range(batch):
        k, v = (t.double() for t in reference.dense_history(plain, row))  # [H, n, D]
        n = k.shape[1]
        s = min(kv.sink, n // kv.block_size * kv.block_size)
        k[:, :s], v[:, :s] = kv.sink_k[row, :, :s].double(), kv.sink_v[row, :, :s].double()
        lo = 0 if kv.start_pos is None else int(kv.start_pos[row])
        lo = lo if window is None else max(lo, n - window)
        if lo >= n:
            continue
        k, v = k[:, lo:].repeat_interleave(group, 0), v[:, lo:].repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[row].double(), k) / d**0.5, dim=-1)
        out[row] = torch.einsum("hn,hnd->hd", w, v)
    return out.float()
