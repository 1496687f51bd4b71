"""`PagedKVCache`: the paged, quantized K/V cache of all layers of a model.

Per layer: packed payload and scale pools (:class:`~kvpack.cache.storage.BlockStorage`) and, per sequence,
a full-precision tail of one block. One :class:`~kvpack.cache.pool.BlockPool` serves all layers: a block
id names that block in every layer's pools.

The cache is a facade over public parts, which the modules doing the heavy work take as arguments: the
frozen :class:`~kvpack.cache.config.CacheConfig`, the :class:`~kvpack.cache.slots.SlotTable` (sequences,
tails, sinks, lengths, block tables), the pool and the packed pools, the
:class:`~kvpack.cache.prefix.PrefixIndex`, the host tier (:mod:`kvpack.cache.offload`) and the seal state
(:mod:`kvpack.cache.write`); :mod:`kvpack.cache.memory` reports on them.

The step rule. A model appends layer by layer within a forward pass, so the layers of a sequence are at
different lengths mid-step. The rule that keeps them in step: **layer 0 leads**. An append to layer 0
starts a step and needs every layer of the sequence at the same length; an append to any other layer may
only bring it up to layer 0's length. The first layer to seal a block allocates its id; the others seal
into the same id. Breaking the rule raises :class:`SequenceError` and changes nothing.

Crop inside a sealed block: the kept tokens of that block return to the tail as their *dequantized*
values (with the outlier residuals of keys added, cast to the tail dtype), and the block is released.
Such a block is never registered for prefix sharing when it is sealed again (it no longer holds exactly
the quantized original tokens).

Attention sinks (a format with ``sink = S > 0``): per layer a sink buffer ``[slots, H, S, D]`` in the tail
dtype beside the tails holds each sequence's first ``S`` positions exactly as they entered the tail (keys
rotated when the key spec rotates); views hand it to kernels as ``PagedKV.sink_k / sink_v``, which read
positions ``p < min(S, sealed tokens)`` from it instead of block 0. Block 0 is sealed as usual. The sink
rows follow the sequence through fork, reorder, crop (cropped positions are rewritten by the next append;
kept ones return to the tail exactly) and offload (they stay in the slot, like the tail). For prefix
sharing, the sink rows of every registered first block are kept beside it (:mod:`kvpack.cache.sink`), so a
sequence that reuses that block gets them too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvpack.cache import memory, write
from kvpack.cache import offload as tier
from kvpack.cache.config import CacheConfig
from kvpack.cache.memory import MemoryReport
from kvpack.cache.offload import HostTier
from kvpack.cache.pool import BlockPool
from kvpack.cache.prefix import PrefixIndex
from kvpack.cache.sink import PrefixSinks
from kvpack.cache.slots import SlotTable, batch_key
from kvpack.cache.storage import BlockStorage
from kvpack.calibration.artifact import Artifact, CalibratedScales
from kvpack.calibration.static import DEFAULT_CLIP_THRESHOLD, ClipMonitor
from kvpack.errors import ConfigError, SequenceError, ShapeError
from kvpack.formats import KVFormat
from kvpack.kernels.reference import dense_history
from kvpack.kernels.views import PagedKV

__all__ = ["PagedKVCache"]

_MAX_VIEWS = 256  # cached views before the view cache is cleared


class PagedKVCache:
    """The paged quantized K/V cache of ``num_layers`` layers.

    Args:
        fmt: a :class:`KVFormat` or a format string (``"int8"``, ``"k8v4,block=32"``, ...).
        num_layers, kv_heads, head_dim: the model's cache geometry.
        num_blocks: blocks in the pool, the null block 0 included; each block holds ``fmt.block_size``
            tokens of every layer.
        tail_dtype: dtype of the full-precision tails (float32, float16 or bfloat16); a format that names its
            own (``fmt.tail``, ``int8,tail=fp16``) takes that instead. Incoming keys and values are cast to it
            first, so sealing quantizes the tail-dtype values.
        device: where pools and tails live.
        window: sliding window: ``None`` (full attention), an int for every layer, or one entry per layer
            (``None`` entries allowed). Blocks that have left the window of *every* layer are released.
        max_seqs: initial number of tail slots (grown by doubling when more sequences are added).
        seal_backend: who quantizes full tails: ``"torch"`` (:func:`kvpack.quant.quantize`), ``"triton"``
            (:mod:`kvpack.kernels.triton_seal`, the same bytes in one kernel launch per spec; raises
            :class:`UnsupportedError` when it cannot), or ``"auto"``: Triton for a CUDA cache when it can,
            torch otherwise. Static specs always seal with torch (the Triton seal chooses block-local scales).
        calibration: the static scales of a format with ``static`` specs:
            ``load_artifact(dir, model=config).scales_for(fmt)`` (a :class:`~kvpack.calibration.CalibratedScales`)
            or the :class:`~kvpack.calibration.Artifact` itself. Required for such a format, refused for
            any other (:class:`CalibrationError`), and checked against ``[num_layers, Hs, 1, Cs]``. For a
            format with outlier key channels, an ``Artifact`` also supplies the channels (the top-k of the
            observed key abs-max per layer and head, copied into every sealed block; without one they are
            chosen per block at seal time); such a format may take an artifact without being static.
        clip_threshold: fraction of a layer's sealed values that may clip (fall outside the calibrated range)
            before ``clip_monitor`` warns (:class:`~kvpack.calibration.CalibrationDriftWarning`).

    Attributes: ``config`` (the :class:`~kvpack.cache.config.CacheConfig`; ``format``, ``num_layers``,
    ``kv_heads``, ``head_dim``, ``block_size``, ``tail_dtype``, ``device``, ``windows``, ``seal_backend``,
    ``calibration``, ``outlier_channels``, ``key_rotation`` and ``salt`` are its fields), ``slots`` (the
    :class:`~kvpack.cache.slots.SlotTable`), ``pool``, ``storage``, ``prefix`` (the
    :class:`~kvpack.cache.prefix.PrefixIndex`), ``prefix_sinks``, ``host`` and ``clip_monitor``.
    """

    def __init__(
        self,
        fmt: KVFormat | str,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        *,
        tail_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        window: int | Sequence[int | None] | None = None,
        max_seqs: int = 8,
        seal_backend: str = "auto",
        calibration: CalibratedScales | Artifact | None = None,
        clip_threshold: float = DEFAULT_CLIP_THRESHOLD,
    ) -> None:
        if not isinstance(max_seqs, int) or max_seqs <= 0:
            raise ConfigError(f"max_seqs must be a positive integer, got {max_seqs!r}")
        cfg = CacheConfig.create(
            fmt,
            num_layers,
            kv_heads,
            head_dim,
            tail_dtype=tail_dtype,
            device=device,
            window=window,
            seal_backend=seal_backend,
            calibration=calibration,
        )
        self.config = cfg
        self.format, self.num_layers, self.kv_heads, self.head_dim = cfg.format, num_layers, kv_heads, head_dim
        self.block_size, self.tail_dtype, self.device = cfg.block_size, cfg.tail_dtype, cfg.device
        self.seal_backend, self.calibration, self.salt = cfg.seal_backend, cfg.calibration, cfg.salt
        self.outlier_channels = cfg.outlier_channels  # [L, H, k] int64, or None: chosen per block at seal time
        self.key_rotation = cfg.key_rotation  # [D, D] float32: keys are stored as k @ R, or None
        self.windows, self.release_window = list(cfg.windows), cfg.release_window
        self.clip_monitor = ClipMonitor(num_layers, clip_threshold)  # counts of static sealing (drift detector)
        self.seal_state = write.SealState(self.clip_monitor)
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.storage = BlockStorage(cfg.format, num_layers, kv_heads, head_dim, num_blocks, cfg.device)
        self.slots = SlotTable(
            num_layers, kv_heads, cfg.block_size, head_dim, sink=cfg.sink, dtype=cfg.tail_dtype, device=cfg.device,
            num_slots=max_seqs,
        )  # fmt: skip
        self.prefix_sinks = PrefixSinks(self.pool)  # sink rows of registered first blocks (prefix sharing)
        self.prefix = PrefixIndex(self.pool, cfg.salt, cfg.block_size, self.prefix_sinks if cfg.sink else None)
        self.host = HostTier()
        self._views: dict[tuple[int, tuple[int, ...]], tuple[int, PagedKV]] = {}

    def __repr__(self) -> str:
        return (
            f"PagedKVCache({self.format.name!r}, layers={self.num_layers}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, blocks={self.pool.num_used} used / {self.num_blocks - 1}, "
            f"sequences={len(self.slots.seqs)}, device={self.device})"
        )

    @property
    def sink(self) -> int:
        """Positions at the start of each sequence kept in full precision (``format.sink``; 0 without)."""
        return self.config.sink

    # -- sequences ----------------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        """Ids of the live sequences, in creation order."""
        return list(self.slots.seqs)

    def add_sequence(self, token_ids: Sequence[int] | torch.Tensor | None = None) -> int:
        """Start a sequence; returns its id.

        With ``token_ids`` (the prompt), the longest run of its full blocks found in the prefix cache is
        reused by reference in every layer, and the sequence starts at that length
        (:meth:`cached_prefix_len`). At most ``(len(token_ids) - 1) // block_size`` blocks are reused, so at
        least one prompt token is left to run through the model (its logits are needed). The ids are
        recorded, so the sequence's own blocks become shareable once sealed.
        """
        tokens = self._token_list(token_ids)
        hits = self.prefix.lookup(tokens)
        sink = self.prefix_sinks.get(hits[0][1]) if hits and self.sink else None
        for _, block in hits:
            self.pool.incref(block)
        seq = self.slots.add([h[1] for h in hits], tokens, [h[0] for h in hits])
        if sink is not None:
            self.slots.sink_k[:, seq.slot], self.slots.sink_v[:, seq.slot] = sink
        return seq.sid

    def cached_prefix_len(self, sid: int) -> int:
        """Tokens the sequence got from shared cached blocks when it was added (all layers)."""
        return self.slots.seq(sid, allow_offloaded=True).prefix_len

    def append_tokens(self, sid: int, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Record token ids of a sequence, so its sealed blocks get prefix keys and become shareable.

        Ids may be recorded before or after the matching keys and values are appended; a block is
        registered once it is sealed in every layer and its ids are known.
        """
        seq = self.slots.seq(sid, allow_offloaded=True)
        seq.tokens.extend(self._token_list(token_ids))
        self.prefix.register(self.slots, seq)

    def seq_len(self, sid: int, layer: int = 0) -> int:
        """Tokens of sequence ``sid`` in ``layer`` (sealed plus tail, released ones included)."""
        seq = self.slots.seq(sid, allow_offloaded=True)
        return int(self.slots.lens_np[self.config.check_layer(layer), seq.slot])

    def token_ids(self, sid: int) -> list[int]:
        """The token ids recorded for a sequence (a copy)."""
        return list(self.slots.seq(sid, allow_offloaded=True).tokens)

    def is_offloaded(self, sid: int) -> bool:
        return self.slots.seq(sid, allow_offloaded=True).offloaded

    def fork(self, sid: int) -> int:
        """A new sequence sharing ``sid``'s sealed blocks (reference counts) with a copy of its tails.

        Needs no pool block, so it never raises :class:`PoolExhaustedError`.
        """
        src = self.slots.seq(sid)
        for block in src.blocks:
            self.pool.incref(block)
        return self.slots.fork(src).sid

    def free(self, sid: int) -> None:
        """Release a sequence: its blocks lose a reference (cached ones stay for prefix reuse)."""
        seq = self.slots.seq(sid, allow_offloaded=True)
        for block in seq.blocks:
            self.pool.release(block)
        if seq.offloaded:
            self.host.drop(sid)
        self.slots.remove(seq)

    def crop(self, sid: int, n: int) -> None:
        """Roll sequence ``sid`` back to its first ``n`` tokens in every layer (e.g. rejected draft tokens).

        Inside the tail this just shortens it. Inside a sealed block, the block's kept tokens return to
        the tail as their dequantized values and the block loses this sequence's reference; later blocks
        are released. Raises :class:`SequenceError` (nothing changed) when ``n`` is negative, beyond the
        length, or reaches back before positions the sliding window already released.
        """
        st = self.slots
        seq = st.seq(sid)
        lens = st.lens_np[:, seq.slot]
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            raise SequenceError(f"crop length must be an integer, got {n!r}")
        n, nmin, nmax = int(n), int(lens.min()), int(lens.max())
        if n < 0 or n > nmax:
            raise SequenceError(f"cannot crop sequence {sid} to {n} tokens: it holds {nmax}; use 0 <= n <= {nmax}")
        if n > nmin:
            raise SequenceError(
                f"cannot crop sequence {sid} to {n} tokens: it is mid-step (layers hold {nmin}..{nmax} tokens); "
                f"crop to at most {nmin} or append the remaining layers first"
            )
        b = self.block_size
        if seq.released and n - self.release_window + 1 < seq.released * b:
            lowest = seq.released * b + self.release_window - 1
            raise SequenceError(
                f"cannot crop sequence {sid} to {n} tokens: the sliding window already released positions "
                f"before {seq.released * b}, which the next token would attend; crop to at least {lowest}"
            )
        j, r = divmod(n, b)
        # the tail block keeps its mark when r > 0 (its tail values may already be crop-returned)
        seq.impure = {i for i in seq.impure if i < j or (i == j and r > 0)}
        if r and j < len(seq.blocks):
            sealed = torch.from_numpy(np.nonzero(lens // b > j)[0]).to(self.device)
            if sealed.numel():  # layers that sealed block j: its kept tokens return to their tails
                k, v = self.storage.dequantize_block(seq.blocks[j], sealed)  # [layers, H, B, D]
                k, v = k[:, :, :r].to(self.tail_dtype), v[:, :, :r].to(self.tail_dtype)
                if j == 0 and self.sink:  # sink positions return exactly as they were appended
                    s = min(self.sink, r)
                    k[:, :, :s] = st.sink_k[sealed, seq.slot, :, :s]
                    v[:, :, :s] = st.sink_v[sealed, seq.slot, :, :s]
                st.tail_k[sealed, seq.slot, :, :r] = k
                st.tail_v[sealed, seq.slot, :, :r] = v
                seq.impure.add(j)
        for block in seq.blocks[j:]:
            self.pool.release(block)
        del seq.blocks[j:]
        st.tables_np[seq.slot, j:] = 0
        lens[:] = n
        del seq.tokens[n:]
        del seq.keys[j:]
        seq.prefix_len = min(seq.prefix_len, n)
        st.changed()

    def reorder(self, seq_ids: Sequence[int], src: Sequence[int] | torch.Tensor) -> None:
        """Beam-search reorder: row ``i`` of ``seq_ids`` becomes a copy of row ``src[i]`` (same ids).

        Sealed blocks are shared by reference; tails, lengths and recorded tokens are copied.
        """
        rows = self.slots.batch(seq_ids)
        src_idx = [int(i) for i in (src.tolist() if isinstance(src, torch.Tensor) else src)]
        if len(src_idx) != len(rows.seqs) or any(not 0 <= i < len(rows.seqs) for i in src_idx):
            raise ShapeError(f"src must hold {len(rows.seqs)} row indices in [0, {len(rows.seqs)}), got {src_idx}")
        if all(i == s for i, s in enumerate(src_idx)):
            return
        olds = [(s.blocks, s.tokens, s.keys, s.impure, s.released, s.prefix_len) for s in rows.seqs]
        for i in src_idx:
            for block in olds[i][0]:
                self.pool.incref(block)
        for blocks, *_ in olds:
            for block in blocks:
                self.pool.release(block)
        self.slots.copy_slots(rows.slots, rows.slots[src_idx])
        for seq, i in zip(rows.seqs, src_idx):
            blocks, tokens, keys, impure, released, prefix_len = olds[i]
            seq.blocks, seq.tokens, seq.keys, seq.impure = list(blocks), list(tokens), list(keys), set(impure)
            seq.released, seq.prefix_len = released, prefix_len
        self.slots.changed()

    # -- write path, views, reports (the heavy parts live in their own modules) ---------------------
    def append(self, layer: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` new tokens to each sequence of a batch in one layer; full tails are sealed.

        Args:
            layer: the layer (layer 0 leads each step; see the module docstring).
            seq_ids: ``batch`` distinct live sequence ids.
            k, v: ``[batch, kv_heads, T, head_dim]`` keys (after RoPE) and values, floating point, on the
                cache device, ``T >= 1``.

        Every tail that fills is sealed in one batched quantize call (a prefill of N tokens seals its
        N // B blocks at once). Errors (:class:`ShapeError`, :class:`SequenceError`,
        :class:`PoolExhaustedError`, :class:`NonFiniteError` naming layer, sequence, head and position)
        are raised before anything changes.
        """
        write.append(
            self.config, self.slots, self.pool, self.storage, self.prefix, self.seal_state, layer, seq_ids, k, v
        )

    def view(self, layer: int, seq_ids: Sequence[int]) -> PagedKV:
        """The kernel-facing :class:`PagedKV` of one layer for a batch (rows in ``seq_ids`` order).

        When the sequences sit in consecutive tail slots (the usual case: a batch added in order) the
        view's tails, block tables and lengths are slices of the cache's own arrays, built once and
        cached; on the CPU they stay current as the cache grows. Otherwise they are gathered copies.
        Take the view after appending the step's tokens. ``block_tables`` entries at or past a row's
        ``seq_len // block_size`` may hold ids other layers already sealed this step: never read them.
        """
        self.config.check_layer(layer)
        st = self.slots
        key = (layer, batch_key(seq_ids))
        hit = self._views.get(key)
        if hit is not None and hit[0] == st.version:
            return hit[1]
        rows = st.batch(seq_ids)
        st.ensure_width(1)
        if rows.start is not None:
            sl = slice(rows.start, rows.start + len(rows.seqs))
            tables, lens = st.tables[sl], st.lens[layer, sl]
            tail_k, tail_v = st.tail_k[layer, sl], st.tail_v[layer, sl]
        else:
            idx = torch.from_numpy(rows.slots)
            tables, lens = st.tables.index_select(0, idx), st.lens[layer].index_select(0, idx)
            tail_k, tail_v = st.tail_k[layer, rows.slots_t], st.tail_v[layer, rows.slots_t]
        sink_k = sink_v = None
        if self.sink:  # slices or gathered copies, like the tails
            at = sl if rows.start is not None else rows.slots_t
            sink_k, sink_v = st.sink_k[layer, at], st.sink_v[layer, at]
        pools = self.storage
        kv = PagedKV(
            format=self.format,
            head_dim=self.head_dim,
            k_data=pools.k_data[layer],
            k_scale=None if pools.k_scale is None else pools.k_scale[layer],
            k_zero=None if pools.k_zero is None else pools.k_zero[layer],
            v_data=pools.v_data[layer],
            v_scale=None if pools.v_scale is None else pools.v_scale[layer],
            v_zero=None if pools.v_zero is None else pools.v_zero[layer],
            k_outlier=None if pools.k_outlier is None else pools.k_outlier[layer],
            k_outlier_idx=None if pools.k_outlier_idx is None else pools.k_outlier_idx[layer],
            key_rotation=self.key_rotation,
            block_tables=tables.to(self.device),
            seq_lens=lens.to(self.device),
            tail_k=tail_k,
            tail_v=tail_v,
            sink_k=sink_k,
            sink_v=sink_v,
        )
        if rows.start is not None and self.device.type == "cpu":  # live slices: valid until the layout changes
            if len(self._views) > _MAX_VIEWS:
                self._views.clear()
            self._views[key] = (st.version, kv)
        return kv

    def dense(self, layer: int, sid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of one sequence in one layer: two ``[H, n, D]`` float32 (debug, tests).

        Positions released by the sliding window come back as zeros; with a sink, positions below
        ``min(sink, sealed tokens)`` come from the sink buffer (exactly what kernels read).
        """
        return dense_history(self.view(layer, [sid]), 0)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (pass it to the attention kernel), or None."""
        return self.windows[self.config.check_layer(layer)]

    def offload(self, sid: int) -> int:
        """Move the sequence's exclusively owned sealed blocks to the host tier; returns bytes moved.

        Their pool blocks are released; shared blocks and the tail stay. The sequence cannot be viewed,
        appended, forked or cropped until :meth:`restore`.
        """
        return tier.offload(self.slots, self.pool, self.storage, self.host, sid)

    def restore(self, sid: int) -> int:
        """Bring an offloaded sequence's blocks back (new block ids, identical bytes); returns bytes moved."""
        return tier.restore(self.slots, self.pool, self.storage, self.host, self.prefix, sid)

    def memory_report(self) -> MemoryReport:
        """Per-layer and total byte accounting: a :class:`~kvpack.cache.memory.MemoryReport`."""
        return memory.memory_report(
            self.config, self.slots, self.pool, self.storage, self.host, self.prefix_sinks, self.clip_monitor
        )

    def problems(self) -> list[str]:
        """Consistency checks (empty list when consistent): reference counts equal the references held by
        block tables, nothing leaked, tables mirror the sequences, lengths in step."""
        return memory.problems(self.slots, self.pool, self.host)

    # -- internals ----------------------------------------------------------------------------------
    @staticmethod
    def _token_list(token_ids: Sequence[int] | torch.Tensor | None) -> list[int]:
        if token_ids is None:
            return []
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1 or token_ids.is_floating_point():
                raise ShapeError(
                    f"token_ids must be a 1-D integer tensor, got {tuple(token_ids.shape)} {token_ids.dtype}"
                )
            return token_ids.tolist()
        out = list(token_ids)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in out):
            raise ShapeError("token_ids must be a sequence of integers")
        return [int(t) for t in out]
