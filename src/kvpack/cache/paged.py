"""`PagedKVCache`: the paged, quantized K/V cache of all layers of a model.

Per layer: packed payload and scale pools (:class:`~kvpack.cache.storage.BlockStorage`) and, per sequence,
a full-precision tail of one block. One :class:`~kvpack.cache.pool.BlockPool` serves all layers: a block
id names that block in every layer's pools.

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

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpack.cache.calibrated import channels_digest, resolve_calibration, resolve_outlier_channels, scales_digest
from kvpack.cache.pool import NULL_BLOCK, BlockPool
from kvpack.cache.prefix import ROOT, block_key, chain_keys
from kvpack.cache.sink import PrefixSinks
from kvpack.cache.storage import BlockStorage
from kvpack.calibration.artifact import Artifact, CalibratedScales
from kvpack.calibration.static import DEFAULT_CLIP_THRESHOLD, ClipMonitor
from kvpack.errors import ConfigError, SequenceError, ShapeError
from kvpack.formats import KVFormat, parse_format
from kvpack.kernels.views import PagedKV
from kvpack.rotation import key_rotation

__all__ = ["PagedKVCache"]

_TAIL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class _Seq:
    """Host-side state of one sequence (its lengths live in the cache's ``[L, slots]`` array)."""

    sid: int
    slot: int
    blocks: list[int] = field(default_factory=list)  # logical block -> block id (0: released by the window)
    tokens: list[int] = field(default_factory=list)  # recorded token ids (may run ahead of the cache)
    keys: list[bytes] = field(default_factory=list)  # prefix keys of the first len(keys) blocks
    impure: set[int] = field(default_factory=set)  # blocks re-sealed from crop-returned values
    released: int = 0  # leading blocks released by the sliding window
    prefix_len: int = 0  # tokens reused from cached blocks at add_sequence
    offloaded: bool = False


@dataclass
class _Rows:
    """A batch of sequences resolved to tail slots (cached per seq_ids tuple until the layout changes)."""

    version: int
    seqs: list[_Seq]
    slots: np.ndarray  # [batch] int64
    slots_t: torch.Tensor  # [batch] int64 on the cache device
    start: int | None  # first slot when the slots are consecutive (views are then slices, not copies)


class PagedKVCache:
    """The paged quantized K/V cache of ``num_layers`` layers.

    Args:
        fmt: a :class:`KVFormat` or a format string (``"int8"``, ``"k8v4,block=32"``, ...).
        num_layers, kv_heads, head_dim: the model's cache geometry.
        num_blocks: blocks in the pool, the null block 0 included; each block holds ``fmt.block_size``
            tokens of every layer.
        tail_dtype: dtype of the full-precision tails (float32, float16 or bfloat16). Incoming keys and
            values are cast to it first, so sealing quantizes the tail-dtype values.
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
        self.format = parse_format(fmt) if isinstance(fmt, str) else fmt
        if not isinstance(self.format, KVFormat):
            raise ConfigError(f"fmt must be a KVFormat or a format string, got {type(fmt).__name__}")
        for name, val in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, int) or val <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {val!r}")
        if not isinstance(max_seqs, int) or max_seqs <= 0:
            raise ConfigError(f"max_seqs must be a positive integer, got {max_seqs!r}")
        self.format.check(head_dim)
        if seal_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"seal_backend must be 'auto', 'torch' or 'triton', got {seal_backend!r}")
        self.seal_backend = seal_backend
        if tail_dtype not in _TAIL_DTYPES:
            raise ConfigError(f"tail_dtype must be torch.float32, float16 or bfloat16, got {tail_dtype}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.clip_monitor = ClipMonitor(num_layers, clip_threshold)  # counts of static sealing (drift detector)
        self.block_size = self.format.block_size
        self.tail_dtype = tail_dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        geometry = (num_layers, kv_heads, head_dim, self.device)
        self.calibration = resolve_calibration(self.format, calibration, *geometry)
        # [L, H, k] int64 calibrated outlier key channels, or None: chosen per block at seal time
        self.outlier_channels = resolve_outlier_channels(self.format, calibration, *geometry)
        # [D, D] float32: keys are stored as k @ R (tails and blocks; kvpack.rotation), or None
        self.key_rotation = key_rotation(head_dim, self.device) if self.format.key.rotate else None
        self.windows = self._parse_window(window, num_layers)
        # a block leaves every layer's window only if every layer has one
        self.release_window = None if None in self.windows else max(self.windows)
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.storage = BlockStorage(self.format, num_layers, kv_heads, head_dim, num_blocks, self.device)
        self.salt = f"{self.format.spec_string()}|kv_heads={kv_heads}|head_dim={head_dim}"
        if self.calibration is not None:  # blocks sealed with other scales hold other bytes: never share them
            self.salt += f"|scales={scales_digest(self.calibration)}"
        if self.outlier_channels is not None:
            self.salt += f"|outliers={channels_digest(self.outlier_channels)}"
        b = self.block_size
        self._tail_k = torch.zeros(num_layers, max_seqs, kv_heads, b, head_dim, dtype=tail_dtype, device=self.device)
        self._tail_v = torch.zeros_like(self._tail_k)
        # [L, slots, H, S, D] in the tail dtype: each sequence's first S positions, or None without a sink
        self._sink_k = self._sink_v = None
        if self.sink:
            shape = (num_layers, max_seqs, kv_heads, self.sink, head_dim)
            self._sink_k = torch.zeros(shape, dtype=tail_dtype, device=self.device)
            self._sink_v = torch.zeros_like(self._sink_k)
        self.prefix_sinks = PrefixSinks(self.pool)  # sink rows of registered first blocks (prefix sharing)
        self._lens = torch.zeros(num_layers, max_seqs, dtype=torch.int32)  # host; [L, slots]
        self._lens_np = self._lens.numpy()
        self._tables = torch.zeros(max_seqs, 4, dtype=torch.int32)  # host; [slots, width]
        self._tables_np = self._tables.numpy()
        self._free_slots = list(range(max_seqs))
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._layout_version = 0
        self._rows_cache: dict[tuple[int, ...], _Rows] = {}
        self._views: dict[tuple[int, tuple[int, ...]], tuple[int, PagedKV]] = {}
        from kvpack.cache.offload import HostTier

        self.host = HostTier()
        self._seal_reasons: dict = {}  # (spec, dtype, device) -> why the Triton seal cannot run

    def __repr__(self) -> str:
        return (
            f"PagedKVCache({self.format.name!r}, layers={self.num_layers}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, blocks={self.pool.num_used} used / {self.num_blocks - 1}, "
            f"sequences={len(self._seqs)}, device={self.device})"
        )

    @staticmethod
    def _parse_window(window, num_layers: int) -> list[int | None]:
        ws = [window] * num_layers if window is None or isinstance(window, int) else list(window)
        if len(ws) != num_layers:
            raise ConfigError(f"window needs one entry per layer ({num_layers}), got {len(ws)}")
        for w in ws:
            if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
                raise ConfigError(f"a window must be a positive number of tokens or None, got {w!r}")
        return ws

    # -- sequences ----------------------------------------------------------------------------------
    @property
    def seq_ids(self) -> list[int]:
        """Ids of the live sequences, in creation order."""
        return list(self._seqs)

    def add_sequence(self, token_ids: Sequence[int] | torch.Tensor | None = None) -> int:
        """Start a sequence; returns its id.

        With ``token_ids`` (the prompt), the longest run of its full blocks found in the prefix cache is
        reused by reference in every layer, and the sequence starts at that length
        (:meth:`cached_prefix_len`). At most ``(len(token_ids) - 1) // block_size`` blocks are reused, so at
        least one prompt token is left to run through the model (its logits are needed). The ids are
        recorded, so the sequence's own blocks become shareable once sealed.
        """
        tokens = self._token_list(token_ids)
        b = self.block_size
        hits: list[tuple[bytes, int]] = []
        parent = ROOT
        for j in range(max(0, len(tokens) - 1) // b):
            key = block_key(parent, tokens[j * b : (j + 1) * b], self.salt)
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append((key, block))
            parent = key
        sink = self.prefix_sinks.get(hits[0][1]) if hits and self.sink else None
        if hits and self.sink and sink is None:  # no sink rows kept for that first block: nothing to reuse
            hits = []
        slot = self._take_slot()
        for _, block in hits:
            self.pool.incref(block)
        if sink is not None:
            self._sink_k[:, slot], self._sink_v[:, slot] = sink
        seq = _Seq(self._next_id, slot, [h[1] for h in hits], tokens, [h[0] for h in hits])
        seq.prefix_len = len(hits) * b
        self._next_id += 1
        self._seqs[seq.sid] = seq
        self._lens_np[:, slot] = seq.prefix_len
        self._ensure_width(len(seq.blocks))
        self._tables_np[slot, : len(seq.blocks)] = seq.blocks
        self._layout_changed()
        return seq.sid

    def cached_prefix_len(self, sid: int) -> int:
        """Tokens the sequence got from shared cached blocks when it was added (all layers)."""
        return self._seq(sid, allow_offloaded=True).prefix_len

    def append_tokens(self, sid: int, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Record token ids of a sequence, so its sealed blocks get prefix keys and become shareable.

        Ids may be recorded before or after the matching keys and values are appended; a block is
        registered once it is sealed in every layer and its ids are known.
        """
        seq = self._seq(sid, allow_offloaded=True)
        seq.tokens.extend(self._token_list(token_ids))
        self._register(seq)

    def seq_len(self, sid: int, layer: int = 0) -> int:
        """Tokens of sequence ``sid`` in ``layer`` (sealed plus tail, released ones included)."""
        seq = self._seq(sid, allow_offloaded=True)
        return int(self._lens_np[self._check_layer(layer), seq.slot])

    def token_ids(self, sid: int) -> list[int]:
        """The token ids recorded for a sequence (a copy)."""
        return list(self._seq(sid, allow_offloaded=True).tokens)

    def is_offloaded(self, sid: int) -> bool:
        return self._seq(sid, allow_offloaded=True).offloaded

    def fork(self, sid: int) -> int:
        """A new sequence sharing ``sid``'s sealed blocks (reference counts) with a copy of its tails.

        Needs no pool block, so it never raises :class:`PoolExhaustedError`.
        """
        src = self._seq(sid)
        slot = self._take_slot()
        for block in src.blocks:
            self.pool.incref(block)
        for t in self._slot_buffers():
            t[:, slot] = t[:, src.slot]
        self._lens_np[:, slot] = self._lens_np[:, src.slot]
        self._tables_np[slot] = self._tables_np[src.slot]
        seq = _Seq(
            self._next_id, slot, list(src.blocks), list(src.tokens), list(src.keys), set(src.impure), src.released
        )
        seq.prefix_len = src.prefix_len
        self._next_id += 1
        self._seqs[seq.sid] = seq
        self._layout_changed()
        return seq.sid

    def free(self, sid: int) -> None:
        """Release a sequence: its blocks lose a reference (cached ones stay for prefix reuse)."""
        seq = self._seq(sid, allow_offloaded=True)
        for block in seq.blocks:
            self.pool.release(block)
        if seq.offloaded:
            self.host.drop(sid)
        self._lens_np[:, seq.slot] = 0
        self._tables_np[seq.slot] = 0
        heapq.heappush(self._free_slots, seq.slot)
        del self._seqs[sid]
        self._layout_changed()

    def crop(self, sid: int, n: int) -> None:
        """Roll sequence ``sid`` back to its first ``n`` tokens in every layer (e.g. rejected draft tokens).

        Inside the tail this just shortens it. Inside a sealed block, the block's kept tokens return to
        the tail as their dequantized values and the block loses this sequence's reference; later blocks
        are released. Raises :class:`SequenceError` (nothing changed) when ``n`` is negative, beyond the
        length, or reaches back before positions the sliding window already released.
        """
        seq = self._seq(sid)
        lens = self._lens_np[:, seq.slot]
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
                    k[:, :, :s] = self._sink_k[sealed, seq.slot, :, :s]
                    v[:, :, :s] = self._sink_v[sealed, seq.slot, :, :s]
                self._tail_k[sealed, seq.slot, :, :r] = k
                self._tail_v[sealed, seq.slot, :, :r] = v
                seq.impure.add(j)
        for block in seq.blocks[j:]:
            self.pool.release(block)
        del seq.blocks[j:]
        self._tables_np[seq.slot, j:] = 0
        lens[:] = n
        del seq.tokens[n:]
        del seq.keys[j:]
        seq.prefix_len = min(seq.prefix_len, n)
        self._layout_changed()

    def reorder(self, seq_ids: Sequence[int], src: Sequence[int] | torch.Tensor) -> None:
        """Beam-search reorder: row ``i`` of ``seq_ids`` becomes a copy of row ``src[i]`` (same ids).

        Sealed blocks are shared by reference; tails, lengths and recorded tokens are copied.
        """
        rows = self._rows(seq_ids)
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
        dst = torch.from_numpy(rows.slots).to(self.device)
        from_slots = rows.slots[src_idx]
        src_t = torch.from_numpy(from_slots).to(self.device)
        for t in self._slot_buffers():
            t[:, dst] = t[:, src_t]
        self._lens_np[:, rows.slots] = self._lens_np[:, from_slots]
        self._tables_np[rows.slots] = self._tables_np[from_slots]
        for seq, i in zip(rows.seqs, src_idx):
            blocks, tokens, keys, impure, released, prefix_len = olds[i]
            seq.blocks, seq.tokens, seq.keys, seq.impure = list(blocks), list(tokens), list(keys), set(impure)
            seq.released, seq.prefix_len = released, prefix_len
        self._layout_changed()

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
        from kvpack.cache.write import append

        append(self, layer, seq_ids, k, v)

    def view(self, layer: int, seq_ids: Sequence[int]) -> PagedKV:
        """The kernel-facing :class:`PagedKV` of one layer for a batch (rows in ``seq_ids`` order).

        When the sequences sit in consecutive tail slots (the usual case: a batch added in order) the
        view's tails, block tables and lengths are slices of the cache's own arrays, built once and
        cached; on the CPU they stay current as the cache grows. Otherwise they are gathered copies.
        Take the view after appending the step's tokens. ``block_tables`` entries at or past a row's
        ``seq_len // block_size`` may hold ids other layers already sealed this step: never read them.
        """
        self._check_layer(layer)
        key = (layer, self._key(seq_ids))
        hit = self._views.get(key)
        if hit is not None and hit[0] == self._layout_version:
            return hit[1]
        rows = self._rows(seq_ids)
        self._ensure_width(1)
        if rows.start is not None:
            sl = slice(rows.start, rows.start + len(rows.seqs))
            tables, lens = self._tables[sl], self._lens[layer, sl]
            tail_k, tail_v = self._tail_k[layer, sl], self._tail_v[layer, sl]
        else:
            idx = torch.from_numpy(rows.slots)
            tables, lens = self._tables.index_select(0, idx), self._lens[layer].index_select(0, idx)
            tail_k, tail_v = self._tail_k[layer, rows.slots_t], self._tail_v[layer, rows.slots_t]
        sink_k = sink_v = None
        if self.sink:  # slices or gathered copies, like the tails
            at = sl if rows.start is not None else rows.slots_t
            sink_k, sink_v = self._sink_k[layer, at], self._sink_v[layer, at]
        st = self.storage
        kv = PagedKV(
            format=self.format,
            head_dim=self.head_dim,
            k_data=st.k_data[layer],
            k_scale=None if st.k_scale is None else st.k_scale[layer],
            k_zero=None if st.k_zero is None else st.k_zero[layer],
            v_data=st.v_data[layer],
            v_scale=None if st.v_scale is None else st.v_scale[layer],
            v_zero=None if st.v_zero is None else st.v_zero[layer],
            k_outlier=None if st.k_outlier is None else st.k_outlier[layer],
            k_outlier_idx=None if st.k_outlier_idx is None else st.k_outlier_idx[layer],
            key_rotation=self.key_rotation,
            block_tables=tables.to(self.device),
            seq_lens=lens.to(self.device),
            tail_k=tail_k,
            tail_v=tail_v,
            sink_k=sink_k,
            sink_v=sink_v,
        )
        if rows.start is not None and self.device.type == "cpu":  # live slices: valid until the layout changes
            self._views[key] = (self._layout_version, kv)
        return kv

    def dense(self, layer: int, sid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of one sequence in one layer: two ``[H, n, D]`` float32 (debug, tests).

        Positions released by the sliding window come back as zeros; with a sink, positions below
        ``min(sink, sealed tokens)`` come from the sink buffer (exactly what kernels read).
        """
        from kvpack.kernels.reference import dense_history

        return dense_history(self.view(layer, [sid]), 0)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (pass it to the attention kernel), or None."""
        return self.windows[self._check_layer(layer)]

    def offload(self, sid: int) -> int:
        """Move the sequence's exclusively owned sealed blocks to the host tier; returns bytes moved.

        Their pool blocks are released; shared blocks and the tail stay. The sequence cannot be viewed,
        appended, forked or cropped until :meth:`restore`.
        """
        from kvpack.cache.offload import offload

        return offload(self, sid)

    def restore(self, sid: int) -> int:
        """Bring an offloaded sequence's blocks back (new block ids, identical bytes); returns bytes moved."""
        from kvpack.cache.offload import restore

        return restore(self, sid)

    def memory_report(self):
        """Per-layer and total byte accounting: a :class:`~kvpack.cache.report.MemoryReport`."""
        from kvpack.cache.report import memory_report

        return memory_report(self)

    def problems(self) -> list[str]:
        """Consistency checks (empty list when consistent): reference counts equal the references held by
        block tables, nothing leaked, tables mirror the sequences, lengths in step."""
        from kvpack.cache.report import problems

        return problems(self)

    # -- internals ----------------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    @staticmethod
    def _token_list(token_ids) -> list[int]:
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

    def _seq(self, sid: int, allow_offloaded: bool = False) -> _Seq:
        seq = self._seqs.get(sid) if isinstance(sid, (int, np.integer)) else None
        if seq is None:
            if isinstance(sid, (int, np.integer)) and 0 <= sid < self._next_id:
                raise SequenceError(f"sequence {sid} was already freed")
            raise SequenceError(f"unknown sequence id {sid!r}; live ids are {self.seq_ids}")
        if seq.offloaded and not allow_offloaded:
            raise SequenceError(f"sequence {sid} is offloaded to the host tier; call cache.restore({sid}) first")
        return seq

    @staticmethod
    def _key(seq_ids) -> tuple[int, ...]:
        if isinstance(seq_ids, torch.Tensor):
            return tuple(seq_ids.tolist())
        if isinstance(seq_ids, (int, np.integer)):
            raise ShapeError("seq_ids must be a sequence of ids (wrap a single id in a list)")
        return tuple(seq_ids)

    def _rows(self, seq_ids) -> _Rows:
        key = self._key(seq_ids)
        rows = self._rows_cache.get(key)
        if rows is not None and rows.version == self._layout_version:
            return rows
        if not key:
            raise ShapeError("seq_ids is empty; pass at least one sequence id")
        if len(set(key)) != len(key):
            raise SequenceError(f"seq_ids holds a sequence twice: {list(key)}")
        seqs = [self._seq(s) for s in key]
        slots = np.array([s.slot for s in seqs], dtype=np.int64)
        start = int(slots[0]) if np.array_equal(slots, np.arange(slots[0], slots[0] + len(slots))) else None
        rows = _Rows(self._layout_version, seqs, slots, torch.from_numpy(slots).to(self.device), start)
        self._rows_cache[key] = rows
        return rows

    def _layout_changed(self) -> None:
        self._layout_version += 1
        if len(self._rows_cache) > 256:
            self._rows_cache.clear()
            self._views.clear()

    @property
    def sink(self) -> int:
        """Positions at the start of each sequence kept in full precision (``format.sink``; 0 without)."""
        return self.format.sink

    def _slot_buffers(self) -> list[torch.Tensor]:
        """The per-sequence buffers ``[L, slots, ...]`` a sequence's slot owns: tails, and sinks when kept."""
        return [t for t in (self._tail_k, self._tail_v, self._sink_k, self._sink_v) if t is not None]

    def _take_slot(self) -> int:
        if not self._free_slots:
            self._grow_slots(2 * self._lens.shape[1])
        return heapq.heappop(self._free_slots)

    def _grow_slots(self, n: int) -> None:
        old = self._lens.shape[1]

        def grown(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = n
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out.narrow(dim, 0, old).copy_(t)
            return out

        self._tail_k, self._tail_v = grown(self._tail_k, 1), grown(self._tail_v, 1)
        if self.sink:
            self._sink_k, self._sink_v = grown(self._sink_k, 1), grown(self._sink_v, 1)
        self._lens = grown(self._lens, 1)
        self._lens_np = self._lens.numpy()
        self._tables = grown(self._tables, 0)
        self._tables_np = self._tables.numpy()
        for s in range(old, n):
            heapq.heappush(self._free_slots, s)
        self._layout_changed()

    def _ensure_width(self, width: int) -> None:
        """Make the block table at least ``width`` entries wide (doubling)."""
        cur = self._tables.shape[1]
        if width <= cur:
            return
        new = max(width, 2 * cur)
        t = torch.zeros(self._tables.shape[0], new, dtype=torch.int32)
        t[:, :cur] = self._tables
        self._tables, self._tables_np = t, t.numpy()
        self._layout_changed()

    def _register(self, seq: _Seq) -> None:
        """Give prefix keys to the sequence's blocks sealed in every layer whose token ids are known."""
        b = self.block_size
        upto = min(int(self._lens_np[:, seq.slot].min()) // b, len(seq.tokens) // b)
        if upto <= len(seq.keys):
            return
        parent = seq.keys[-1] if seq.keys else ROOT
        for j, key in enumerate(chain_keys(seq.tokens[: upto * b], b, self.salt, parent, len(seq.keys)), len(seq.keys)):
            seq.keys.append(key)
            if seq.blocks[j] != NULL_BLOCK and j not in seq.impure:
                self.pool.register(seq.blocks[j], key)
                if j == 0:
                    self._keep_prefix_sink(seq)

    def _keep_prefix_sink(self, seq: _Seq) -> None:
        """After block 0 of ``seq`` is (re-)registered: keep its sink rows beside it for prefix sharing."""
        if self.sink and seq.blocks and seq.keys:
            self.prefix_sinks.keep(seq.blocks[0], seq.keys[0], self._sink_k[:, seq.slot], self._sink_v[:, seq.slot])
