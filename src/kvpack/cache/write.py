"""The write path of :class:`~kvpack.cache.PagedKVCache`: append, seal, scatter.

:func:`append` takes the cache's parts: its :class:`~kvpack.cache.config.CacheConfig`, the
:class:`~kvpack.cache.slots.SlotTable` (tails, sinks, lengths, block tables), the block pool, the packed
pools, the prefix index (sealed blocks get their keys) and a :class:`SealState`.

Plain tensor code over the whole batch: index arrays are built with numpy (one entry per written token or
sealed block, never a Python loop over tokens or elements), tensors move with one gather / scatter per
kind, and every block sealed by the call is quantized in one :func:`kvpack.quant.quantize` call for keys
and one for values (:func:`kvpack.calibration.seal_with_static` for a ``static`` spec, whose clipped
count goes to ``SealState.clip_monitor`` after the commit; :func:`seal_outliers` for keys with outlier
channels, whose residuals and indices are written next to the payload). All checks and the quantization
run before the first write, so an error leaves the cache as it was.

Positions of one row, relative to its tail: the tail holds ``r = n % B`` tokens, the new token ``t`` lands
at ``p = r + t``; the row seals ``s = (r + T) // B`` blocks. Block 0 of the append is the old tail plus the
first ``B - r`` new tokens; blocks ``1..s-1`` are new tokens only; tokens with ``p >= s * B`` form the new
tail at slot ``p - s * B``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpack.cache.config import CacheConfig
from kvpack.cache.pool import BlockPool
from kvpack.cache.prefix import PrefixIndex
from kvpack.cache.slots import Batch, SlotTable
from kvpack.cache.storage import BlockStorage
from kvpack.calibration.static import ClipMonitor, LayerScales, seal_with_static
from kvpack.errors import (
    CalibrationError,
    NonFiniteError,
    PoolExhaustedError,
    SequenceError,
    ShapeError,
    UnsupportedError,
)
from kvpack.formats import QuantSpec
from kvpack.outliers import (
    check_channels,
    outlier_mask,
    outlier_residual,
    quantize_kept,
    query_ranked_channels,
    seal_time_channels,
)
from kvpack.quant import QuantizedTensor, _raise_non_finite, all_finite, quantize
from kvpack.rotation import rotate

__all__ = ["SealState", "append", "seal", "seal_outliers"]


@dataclass
class SealState:
    """What sealing keeps from one append to the next.

    Attributes:
        clip_monitor: counts of static sealing per layer (the drift detector).
        triton_reasons: ``(spec, dtype, device) -> reasons`` the Triton seal cannot quantize such blocks
            (empty: it can), asked once per key.
    """

    clip_monitor: ClipMonitor
    triton_reasons: dict[tuple, list[str]] = field(default_factory=dict)


def _check_kv(config: CacheConfig, k: torch.Tensor, v: torch.Tensor, batch: int) -> None:
    expected = f"[batch={batch}, kv_heads={config.kv_heads}, T>=1, head_dim={config.head_dim}]"
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor {expected}, got {type(x).__name__}")
        if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != config.kv_heads or x.shape[3] != config.head_dim:
            raise ShapeError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
        if x.shape[2] < 1:
            raise ShapeError(f"{name} holds no token (T = 0); expected {expected}")
        if not x.is_floating_point():
            raise ShapeError(f"{name} must be a floating-point tensor (float32, float16, bfloat16), got {x.dtype}")
        if x.device != config.device:
            raise ShapeError(f"{name} is on {x.device} but the cache lives on {config.device}; move it there first")
    if k.shape != v.shape:
        raise ShapeError(f"k and v must have the same shape {expected}, got {tuple(k.shape)} and {tuple(v.shape)}")


def _check_step(table: SlotTable, layer: int, rows: Batch, n_old: np.ndarray, t: int) -> None:
    """Layer 0 starts a step with every layer in step; the others follow up to layer 0's length."""
    lens = table.lens_np
    if lens.shape[0] == 1:
        return
    if layer == 0:
        bad = lens[1:, rows.slots] != n_old
        if bad.any():
            li, i = (int(x[0]) for x in np.nonzero(bad))
            raise SequenceError(
                f"layer 0 of sequence {rows.seqs[i].sid} starts a new step at {int(n_old[i])} tokens but layer "
                f"{li + 1} holds {int(lens[li + 1, rows.slots[i]])}; append every layer of the previous step "
                "first (layer 0 leads each step, the other layers follow with the same tokens)"
            )
    else:
        lead = lens[0, rows.slots]
        over = n_old + t > lead
        if over.any():
            i = int(np.nonzero(over)[0][0])
            raise SequenceError(
                f"layer {layer} of sequence {rows.seqs[i].sid} would hold {int(n_old[i]) + t} tokens, past layer "
                f"0's {int(lead[i])}; each step appends to layer 0 first, then the other layers catch up to it"
            )


def _window_releases(config: CacheConfig, rows: Batch, n_old: np.ndarray) -> list[tuple[int, int]]:
    """``(row, new released count)`` for rows with blocks that left every layer's window.

    Block ``j`` is released once ``(j + 1) * B <= n_old - W + 1``: no query of this step (the earliest
    is at ``n_old``) or later attends it.
    """
    cut = np.maximum(n_old - config.release_window + 1, 0) // config.block_size
    return [(int(i), int(cut[i])) for i in np.nonzero(cut > [s.released for s in rows.seqs])[0]]


def _pairs(sealing: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, j)`` of every block sealed: each sealing row's block 0 first, then the blocks ``j >= 1``."""
    more = s[sealing] - 1
    extra_rows = np.repeat(sealing, more)
    extra_j = np.arange(int(more.sum())) - np.repeat(np.cumsum(more) - more, more) + 1
    return np.concatenate([sealing, extra_rows]), np.concatenate([np.zeros(len(sealing), np.int64), extra_j])


def _gather_blocks(
    tail: torch.Tensor, x: torch.Tensor, slots: np.ndarray, r: np.ndarray, sealing: np.ndarray, pair_row, pair_j
) -> torch.Tensor:
    """The ``[n, H, B, D]`` blocks to seal, in pair order, from a layer's tail ``[S, H, B, D]`` and the
    appended tokens ``x`` ``[batch, H, T, D]`` (already in the tail dtype)."""
    dev = x.device
    b = tail.shape[2]
    rs = r[sealing]
    sl = slots[sealing]
    if (np.diff(sl) == 1).all():  # consecutive slots (a batch in step): a plain slice copy
        first = tail[int(sl[0]) : int(sl[-1]) + 1].clone()  # [ns, H, B, D]
    else:
        first = tail.index_select(0, torch.from_numpy(sl).to(dev))
    cnt = b - rs  # new tokens completing each old tail
    a = np.repeat(np.arange(len(sealing)), cnt)
    t = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    ta, tt = torch.from_numpy(a).to(dev), torch.from_numpy(t).to(dev)
    first[ta, :, torch.from_numpy(rs[a] + t).to(dev)] = x[torch.from_numpy(sealing[a]).to(dev), :, tt]
    n0 = len(sealing)
    if len(pair_row) == n0:
        return first
    er = pair_row[n0:]
    tok = (pair_j[n0:] * b - r[er])[:, None] + np.arange(b)  # [M, B] token index inside the append
    rest = x[torch.from_numpy(er).to(dev)[:, None], :, torch.from_numpy(tok).to(dev)]  # [M, B, H, D]
    return torch.cat([first, rest.transpose(1, 2)])


def _seal_reasons(state: SealState, blocks: torch.Tensor, spec: QuantSpec) -> list[str]:
    """Why the Triton seal cannot quantize these blocks (cached per spec, dtype and device)."""
    key = (spec, blocks.dtype, blocks.device)
    reasons = state.triton_reasons.get(key)
    if reasons is None:
        try:  # triton is optional: imported only when a seal may use it
            from kvpack.kernels import triton_seal

            reasons = list(triton_seal.reasons_unsupported(blocks, spec))
        except ImportError as e:
            reasons = [f"the Triton seal is not installed ({e}); pip install 'kvpack[triton]'"]
        state.triton_reasons[key] = reasons
    return reasons


def seal_outliers(
    blocks: torch.Tensor,
    spec: QuantSpec,
    scales: LayerScales | None = None,
    channels: torch.Tensor | None = None,
    energy: torch.Tensor | None = None,
) -> tuple[QuantizedTensor, int, tuple[torch.Tensor, torch.Tensor]]:
    """Seal keys with outlier channels, always in torch: choose (or take) the channels, quantize with the
    kept channels left out of the scales (:func:`kvpack.outliers.quantize_kept`; with static ``scales`` when
    the spec is static), and keep the residuals. ``clipped`` counts the other channels only.

    Args:
        blocks: ``[n, H, B, D]`` full blocks.
        channels: ``[H, k]`` calibrated channels of this layer, or ``None`` to choose per block.
        energy: ``[H, D]`` float32, the queries' mean square per channel of this layer (a calibration
            artifact's): a query-ranked spec (``o<k>q``) needs it and chooses per block by it
            (:func:`kvpack.outliers.query_ranked_channels`).

    Raises:
        CalibrationError: a query-ranked spec without ``energy``.

    Returns ``(qt, clipped, (residual [n, H, B, k] float16, idx [n, H, k]))``.
    """
    if not all_finite(blocks):  # before the channel choice: a NaN must be reported, not filled
        _raise_non_finite(blocks)
    if spec.query_ranked:
        if energy is None:
            raise CalibrationError(
                f"{spec} ranks its outlier channels by the queries, and no query statistics were given; pass a "
                "calibration artifact made by `kvpack calibrate` (calibration=DIR)"
            )
        channels = query_ranked_channels(blocks, spec.outliers, energy, not spec.has_zero)
    elif channels is None:
        channels = seal_time_channels(blocks, spec.outliers)
    check_channels(channels, blocks)
    if spec.refined:
        # block-local per-channel scales: a kept channel is its own scale group, quantized under its own scale as
        # without outliers, and keeps its own code (quantize_kept gives exactly these bytes, at ten times the cost)
        qt = quantize(blocks, spec)
        return qt, 0, outlier_residual(blocks, qt, channels)
    if spec.static:
        laid, _ = seal_with_static(blocks, spec, scales)  # checks the scales and lays them out per block
        qt = quantize_kept(blocks, spec, channels, laid.scale, laid.zero)
        lo, hi = scales.limits()
        outside = (blocks.float() < lo) | (blocks.float() > hi)
        clipped = int((outside & ~outlier_mask(channels, blocks)).sum())  # kept channels never clip
    else:
        qt, clipped = quantize_kept(blocks, spec, channels), 0
    return qt, clipped, outlier_residual(blocks, qt, channels)


def seal(
    backend: str, state: SealState, blocks: torch.Tensor, spec: QuantSpec, scales: LayerScales | None = None
) -> tuple[QuantizedTensor, int]:
    """Quantize ``[n, H, B, D]`` full blocks with seal backend ``backend`` (``"auto"``, ``"torch"`` or
    ``"triton"``; the same bytes either way).

    A ``static`` spec is sealed with ``scales`` (one layer's calibrated scales) by
    :func:`~kvpack.calibration.seal_with_static`, always in torch (the Triton seal chooses block-local
    scales). Returns ``(qt, clipped)``: ``clipped`` counts values outside the calibrated range (0 otherwise).
    Specs with outlier channels go through :func:`seal_outliers` instead.
    """
    if spec.static:
        return seal_with_static(blocks, spec, scales)
    if spec.is_passthrough or backend == "torch" or (backend == "auto" and not blocks.is_cuda):
        return quantize(blocks, spec), 0
    reasons = _seal_reasons(state, blocks, spec)
    if not reasons:
        from kvpack.kernels.triton_seal import seal_blocks

        return seal_blocks(blocks, spec), 0
    if backend == "triton":
        raise UnsupportedError(
            f"seal_backend='triton' cannot seal {spec}: " + "; ".join(reasons) + "; use seal_backend='auto'", reasons
        )
    return quantize(blocks, spec), 0


def _quantize(config: CacheConfig, state: SealState, blocks, spec, what, layer, rows, n_old, pair_row, pair_j, b):
    """``(qt, clipped, outlier)`` of the blocks being sealed; ``outlier`` is ``(residual, idx)`` or ``None``."""
    scales = getattr(config.calibration, what).layer(layer) if spec.static else None
    try:
        if spec.has_outliers:
            channels = None if config.outlier_channels is None else config.outlier_channels[layer]
            energy = None if config.query_energy is None else config.query_energy[layer]
            return seal_outliers(blocks, spec, scales, channels, energy)
        return (*seal(config.seal_backend, state, blocks, spec, scales), None)
    except NonFiniteError as e:
        where = []
        for w in e.where:
            i = w["index"][0]
            row = int(pair_row[i])
            pos = (int(n_old[row]) // b + int(pair_j[i])) * b + w["position"]
            where.append({"layer": layer, "sequence": rows.seqs[row].sid, "head": w["head"], "position": pos})
        first = where[0]
        raise NonFiniteError(
            f"non-finite {what} at layer {layer}, sequence {first['sequence']}, head {first['head']}, position "
            f"{first['position']} while sealing; nothing was written (the block stays unsealed). The model produced "
            "NaN/inf; check the inputs, or use bfloat16/float32 activations if fp16 overflowed",
            where,
        ) from None


def _raise_non_finite_append(config: CacheConfig, layer: int, rows: Batch, n_old: np.ndarray, *pairs) -> None:
    """The :class:`NonFiniteError` of an append whose keys or values (``(given, as stored)`` pairs, each
    ``[batch, H, T, D]``) are not finite once in the tail dtype; names the first place and the cause."""
    for what, (given, stored) in zip(("key", "value"), pairs):
        bad = (~torch.isfinite(stored)).nonzero()
        if not len(bad):
            continue
        where = [
            {"layer": layer, "sequence": rows.seqs[int(i)].sid, "head": int(h), "position": int(n_old[int(i)]) + int(t)}
            for i, h, t, _ in bad.tolist()
        ]
        first = where[0]
        at = f"layer {layer}, sequence {first['sequence']}, head {first['head']}, position {first['position']}"
        if bool(torch.isfinite(given).all()):
            top = float(given.abs().max())
            fix = (
                f"format {config.format.name!r} names its tail dtype: use tail=bf16 (float32's range) or drop 'tail='"
                if config.format.tail is not None
                else "Create the cache with tail_dtype=torch.float32 or torch.bfloat16, or scale the inputs down"
            )
            raise NonFiniteError(
                f"{what} at {at} overflows the cache's {str(config.tail_dtype).replace('torch.', '')} tail (largest "
                f"magnitude {top:.4g}); nothing was stored. {fix}",
                where,
            )
        raise NonFiniteError(
            f"non-finite {what} at {at} (NaN or inf in the appended tokens); nothing was stored. The model produced "
            "NaN/inf; check the inputs, or use bfloat16/float32 activations if fp16 overflowed",
            where,
        )


def append(
    config: CacheConfig,
    table: SlotTable,
    pool: BlockPool,
    storage: BlockStorage,
    prefix: PrefixIndex,
    state: SealState,
    layer: int,
    seq_ids: Sequence[int] | torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Append ``T`` new tokens to each sequence of a batch in one layer; full tails are sealed.

    Args:
        config: the cache's config; ``table``, ``pool``, ``storage``, ``prefix``, ``state``: its parts.
        layer, seq_ids: the layer and ``batch`` distinct live sequence ids.
        k, v: ``[batch, kv_heads, T, head_dim]`` keys (after RoPE) and values, floating point, on the cache
            device, ``T >= 1``.

    See :meth:`kvpack.cache.PagedKVCache.append` (errors are raised before anything changes).
    """
    layer = config.check_layer(layer)
    rows = table.batch(seq_ids)
    _check_kv(config, k, v, len(rows.seqs))
    t_new = k.shape[2]
    b = config.block_size
    slots = rows.slots
    n_old = table.lens_np[layer, rows.slots].astype(np.int64)
    _check_step(table, layer, rows, n_old, t_new)
    k_in = k
    if config.key_rotation is not None:  # stored keys are k @ R (a NaN spreads over its token's channels)
        k = rotate(k, config.key_rotation)
    kc = k if k.dtype == config.tail_dtype else k.to(config.tail_dtype)
    vc = v if v.dtype == config.tail_dtype else v.to(config.tail_dtype)
    # the tail is read in full precision by every kernel: refuse NaN/inf (or an overflow of the tail dtype)
    # here, before anything is stored, exactly as sealing would
    if not (all_finite(kc) and all_finite(vc)):
        _raise_non_finite_append(config, layer, rows, n_old, (k_in, kc), (v, vc))
    r = n_old % b
    s = (r + t_new) // b
    sealing = np.nonzero(s)[0]
    releases = _window_releases(config, rows, n_old) if layer == 0 and config.release_window is not None else []

    # -- plan and quantize: nothing is written before this block completes --------------------------
    if sealing.size:
        pair_row, pair_j = _pairs(sealing, s)
        logical = n_old[pair_row] // b + pair_j
        fresh = sum(int(lb) >= len(rows.seqs[i].blocks) for i, lb in zip(pair_row, logical))
        if fresh:
            dropped = Counter(blk for i, cut in releases for blk in rows.seqs[i].blocks[rows.seqs[i].released : cut])
            returning = sum(1 for blk, c in dropped.items() if blk and pool.ref_count(blk) == c)
            if fresh > pool.num_available + returning:
                raise PoolExhaustedError(
                    f"appending {t_new} token(s) to {len(slots)} sequence(s) seals {fresh} new block(s) but only "
                    f"{pool.num_available + returning} of {pool.num_blocks - 1} are available; nothing was changed. "
                    "Free, crop or offload sequences, or create the cache with more num_blocks"
                )
        tail_k, tail_v = table.tail_k[layer], table.tail_v[layer]
        blocks_k = _gather_blocks(tail_k, kc, slots, r, sealing, pair_row, pair_j)
        blocks_v = _gather_blocks(tail_v, vc, slots, r, sealing, pair_row, pair_j)
        args = (layer, rows, n_old, pair_row, pair_j, b)
        kq, clipped_k, k_outlier = _quantize(config, state, blocks_k, config.format.key, "key", *args)
        vq, clipped_v, _ = _quantize(config, state, blocks_v, config.format.value, "value", *args)

    # -- commit -------------------------------------------------------------------------------------
    for i, cut in releases:
        seq = rows.seqs[i]
        for j in range(seq.released, cut):
            pool.release(seq.blocks[j])
            seq.blocks[j] = 0
        table.tables_np[seq.slot, seq.released : cut] = 0
        seq.released = cut
    if sealing.size:
        table.ensure_width(int(logical.max()) + 1)
        tables = table.tables_np
        ids = []
        for i, lb in zip(pair_row.tolist(), logical.tolist()):
            seq = rows.seqs[i]
            if lb == len(seq.blocks):  # the first layer to seal this block allocates it
                seq.blocks.append(pool.allocate())
                tables[seq.slot, lb] = seq.blocks[lb]
            ids.append(seq.blocks[lb])
        storage.write(layer, torch.tensor(ids, dtype=torch.int64, device=config.device), kq, vq, k_outlier)
    _write_tails(table, layer, rows, kc, vc, r, s)
    if config.sink and (n_old < config.sink).any():
        _write_sink(table, layer, rows, kc, vc, n_old)
    table.lens_np[layer, rows.slots] += t_new
    for i in sealing.tolist():
        prefix.register(table, rows.seqs[i])
    if sealing.size and config.calibration is not None:  # last: the append is complete even if the warning raises
        fmt = config.format
        sealed = blocks_k.numel() * fmt.key.static + blocks_v.numel() * fmt.value.static
        state.clip_monitor.record(layer, clipped_k + clipped_v, sealed)


def _write_sink(table: SlotTable, layer: int, rows: Batch, kc, vc, n_old: np.ndarray) -> None:
    """Appended positions ``p < S`` also go to the sink buffer ``[slots, H, S, D]`` (keys as the tail holds
    them: rotated when the key spec rotates, in the tail dtype)."""
    t_new = kc.shape[2]
    p = n_old[:, None] + np.arange(t_new)  # [batch, T] positions of the new tokens
    ri, ti = np.nonzero(p < table.sink_k.shape[3])
    dev = kc.device
    ri_t, ti_t = torch.from_numpy(ri).to(dev), torch.from_numpy(ti).to(dev)
    slot_t, pos_t = torch.from_numpy(rows.slots[ri]).to(dev), torch.from_numpy(p[ri, ti]).to(dev)
    table.sink_k[layer][slot_t, :, pos_t] = kc[ri_t, :, ti_t]
    table.sink_v[layer][slot_t, :, pos_t] = vc[ri_t, :, ti_t]


def _write_tails(table: SlotTable, layer: int, rows: Batch, kc, vc, r: np.ndarray, s: np.ndarray) -> None:
    """Tokens past the sealed blocks go to the tails (slot ``p - s * B``)."""
    tail_k, tail_v = table.tail_k[layer], table.tail_v[layer]
    dev = kc.device
    t_new = kc.shape[2]
    if t_new == 1:  # decode: one token per row, at slot r of every row that did not seal
        keep = np.nonzero(s == 0)[0]
        if keep.size == len(r) and rows.start is not None and (r == r[0]).all():
            # a batch in step (the usual case): one strided copy, no index tensors
            a, o = rows.start, int(r[0])
            tail_k[a : a + len(r), :, o : o + 1].copy_(kc)
            tail_v[a : a + len(r), :, o : o + 1].copy_(vc)
            return
        if keep.size == len(r):
            slot_t, off_t = rows.slots_t, torch.from_numpy(r).to(dev)
            tail_k[slot_t, :, off_t] = kc[:, :, 0]
            tail_v[slot_t, :, off_t] = vc[:, :, 0]
            return
        ri, ti, off = keep, np.zeros_like(keep), r[keep]
    else:
        cut = s * table.block_size
        p = r[:, None] + np.arange(t_new)
        ri, ti = np.nonzero(p >= cut[:, None])
        off = p[ri, ti] - cut[ri]
    if ri.size == 0:
        return
    ri_t, ti_t = torch.from_numpy(ri).to(dev), torch.from_numpy(ti).to(dev)
    slot_t, off_t = torch.from_numpy(rows.slots[ri]).to(dev), torch.from_numpy(off).to(dev)
    tail_k[slot_t, :, off_t] = kc[ri_t, :, ti_t]
    tail_v[slot_t, :, off_t] = vc[ri_t, :, ti_t]
