"""Hugging Face transformers integration: a ``Cache`` backed by :class:`kvpack.cache.PagedKVCache`.

How it plugs in (transformers 5.x, through its extension points only; no model code is copied):

* :class:`KVPackCache` is a ``transformers.Cache`` with one :class:`KVPackLayer` per decoder layer. All layers
  store into one :class:`~kvpack.cache.PagedKVCache`; a batch row is one kvpack sequence. ``update()`` appends
  the new keys and values (after RoPE) and returns a :class:`PackedKV` handle instead of dense tensors.
* The attention function :func:`kvpack_attention` is registered as ``attn_implementation="kvpack"`` in
  transformers' ``AttentionInterface``. It receives the handle where other implementations receive dense
  keys and values, and reads the packed cache: one new token per sequence runs the fused decode kernel
  (:func:`kvpack.kernels.decode_attention`); several (prefill, a question after a cached document, the
  candidate tokens of assisted generation) attend to the *quantized* history through the chunk path,
  which dequantizes sealed blocks on the fly and never keeps a full-precision copy; on the CPU, a few that all
  lie in the tail (assisted generation's candidates) go through the fused decode kernel once, as query heads.
* :func:`kvpack_mask` is registered in ``AttentionMaskInterface`` under the same name. transformers calls it
  with the 2-D padding mask; it hands the attention function a :class:`PaddingInfo` with each sequence's
  first real position (left padding), which becomes :attr:`kvpack.kernels.PagedKV.start_pos`.

Only this folder imports transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from kvpack import kernels
from kvpack.cache import MemoryReport
from kvpack.errors import ConfigError, PoolExhaustedError, ShapeError, UnsupportedError
from kvpack.formats import KVFormat, parse_format
from kvpack.integrations.hf_attention import (
    ATTN_IMPLEMENTATION,
    PackedKV,
    PaddingInfo,
    chunk_attention,
    kvpack_attention,
    kvpack_mask,
    register,
)
from kvpack.kernels.views import PagedKV
from kvpack.modelspecs import config_kv_heads
from kvpack.plans import LayerPlan, is_plan, parse_plan

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KVPackCache",
    "KVPackLayer",
    "PackedKV",
    "PaddingInfo",
    "cache_for",
    "cache_kwarg",
    "chunk_attention",
    "kvpack_attention",
    "kvpack_mask",
    "model_geometry",
    "register",
]

DEFAULT_MAX_TOKENS = 8192
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# The keyword a forward takes its Cache under: ``cache`` from transformers 5.24, ``past_key_values`` before.
_CACHE_KWARGS = ("cache", "past_key_values")

register()  # "kvpack" is a valid attn_implementation as soon as this module is imported


def _plain_tensors(method: Callable) -> Callable:
    """Run a state-changing cache method with autograd off and outside inference mode.

    The paged cache updates its pools in place for its whole life. Tensors created under
    ``torch.inference_mode()`` cannot be updated in place outside it, and ``generate`` runs under ``no_grad``
    while users often prefill under ``inference_mode``: so the cache's own tensors are always made, and
    written, as plain tensors (reading inference tensors there is allowed).
    """

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------------------------------
# Which keyword carries the cache


def cache_kwarg(model: Any) -> str:
    """The keyword ``model`` takes its cache under: ``"cache"`` (transformers >= 5.24) or ``"past_key_values"``.

    Read from the signature of ``model.forward`` (a causal LM, its base model or one attention module), then of
    its ``prepare_inputs_for_generation``; a forward that takes neither by name (only ``**kwargs``) gets the
    name this transformers version uses. ``generate`` accepts the same keyword as the forward. Use it as
    ``model.generate(**inputs, **{cache_kwarg(model): cache})``: a wrong name is swallowed by the forward's
    ``**kwargs`` in older versions, and the model then silently runs a fresh ``DynamicCache``.
    """
    for name in ("forward", "prepare_inputs_for_generation"):
        params = _parameters(getattr(model, name, None))
        for kwarg in _CACHE_KWARGS:
            if kwarg in params:
                return kwarg
    return _library_cache_kwarg()


def _parameters(fn: Any) -> Any:
    if fn is None:
        return {}
    try:
        return inspect.signature(fn).parameters  # follows __wrapped__ (transformers' deprecate_kwarg)
    except (TypeError, ValueError):
        return {}


@functools.cache
def _library_cache_kwarg() -> str:
    from transformers import GenerationMixin

    params = _parameters(GenerationMixin.prepare_inputs_for_generation)
    return "cache" if "cache" in params else "past_key_values"


# ----------------------------------------------------------------------------------------------------
# The cache


class KVPackLayer(CacheLayerMixin):
    """One decoder layer's view of a :class:`KVPackCache` (the storage is shared by all layers)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, parent: KVPackCache, layer_idx: int, window: int | None) -> None:
        super().__init__()
        self.parent = parent
        self.layer_idx = layer_idx
        self.window = window
        self.is_sliding = window is not None
        self.is_initialized = True

    # Everything stateful is done once for all layers by the parent (sequences span layers).
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.parent.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.parent.layer_seq_len(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        return None

    def batch_repeat_interleave(self, repeats: int) -> None:
        return None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        return None

    def __repr__(self) -> str:
        kind = f"sliding window {self.window}" if self.is_sliding else "full"
        return f"KVPackLayer({self.layer_idx}, {kind})"


def _text_config(config: PreTrainedConfig) -> PreTrainedConfig:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def model_geometry(config: PreTrainedConfig) -> tuple[int, int, int, list[int | None]]:
    """``(num_layers, kv_heads, head_dim, windows)`` of a decoder, from its config.

    ``windows[i]`` is layer ``i``'s sliding window, ``None`` for full attention.

    Raises:
        UnsupportedError: a layer type kvpack cannot store (linear attention, chunked attention, ...).
    """
    cfg = _text_config(config)
    heads = getattr(cfg, "num_attention_heads", None)
    # vLLM's rules too (Falcon-7B's multi_query is one kv head whatever num_kv_heads says)
    kv_heads = config_kv_heads(cfg.to_dict()) if hasattr(cfg, "to_dict") else None
    kv_heads = kv_heads or getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        raise ConfigError(f"cannot read kv_heads / head_dim from the {type(cfg).__name__}; is it a decoder config?")
    layer_types, layer_kwargs = get_layer_types_and_kwargs(cfg)
    reasons = [f"layer {i} is {t!r}" for i, t in enumerate(layer_types) if t not in _SUPPORTED_LAYER_TYPES]
    if reasons:
        raise UnsupportedError(
            "kvpack stores full and sliding-window attention layers only: " + "; ".join(reasons[:4]), reasons
        )
    windows = [
        kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(layer_types, layer_kwargs)
    ]
    return len(layer_types), int(kv_heads), int(head_dim), windows


class KVPackCache(Cache):
    """A transformers ``Cache`` whose layers store into one kvpack :class:`~kvpack.cache.PagedKVCache`.

    Use it with ``attn_implementation="kvpack"`` (see :func:`cache_for`, which also switches the model). The
    paged storage is created on the first ``update()``, when the batch size (beams included), dtype and device
    are known; a row of the batch is one kvpack sequence. Beam search reorders rows by reference (sealed
    blocks are shared, never copied; only tails are); ``crop`` (assisted generation) rolls sequences back.

    Args:
        config: the model config (layers, kv_heads, head_dim and sliding windows are read from it).
        format: a preset name (``"int4"``, ``"int8"``, ``"fp16"``, ...) or a custom format string or
            :class:`~kvpack.formats.KVFormat`, or a per-layer plan (``"int4/int8[0,5-6]"``,
            :mod:`kvpack.plans`): each format's layers then get their own pool.
        max_tokens: tokens one sequence may reach (prompt plus new tokens); default the model's
            ``max_position_embeddings`` capped at 8192.
        batch_size: the least number of sequences to size the pool for; it is sized at the first forward for
            ``max(batch_size, rows of that batch)`` sequences of ``max_tokens`` (rows count beams).
        backend: decode kernel backend: ``"auto"`` (fused kernel, else the reference with a one-time warning
            saying why), ``"cpu"``, ``"triton"`` or ``"reference"``.
        tail_dtype: dtype of the full-precision tail; default the dtype of the first keys. A format that names
            its own (``int8,tail=fp16``) takes that instead.
        num_blocks: override the pool size (blocks, the null block included).
        calibration: a calibration artifact (its directory, or a loaded :class:`~kvpack.calibration.Artifact`,
            checked against ``config``'s fingerprint) or :class:`~kvpack.calibration.CalibratedScales`: the
            static scales of a format with ``static`` specs (required for one: refused here, before anything
            runs, when missing), the outlier key channels of a format with ``o<N>`` keys (otherwise chosen
            per block at seal time), and the query statistics of one with ``o<N>q`` keys (required). Passed to
            :class:`~kvpack.cache.PagedKVCache`; a per-layer plan takes an artifact only, each of its formats
            that needs one (static, ``o<N>q``) the rows of its own layers.

    Attributes:
        fused_decode_calls: decode-attention calls (one per layer per step) that ran a fused kernel.
        decode_backends: ``Counter`` of backend names used by decode steps.
        fused_position_calls: attention calls over a few new tokens in each sequence's tail (the candidates of
            assisted generation) that ran the fused CPU decode kernel once, the positions as query heads.
        chunk_calls: attention calls over several new tokens (prefill, chunks, longer verifications).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        format: str | KVFormat | LayerPlan = "int4",
        *,
        max_tokens: int | None = None,
        batch_size: int = 1,
        backend: str = "auto",
        tail_dtype: torch.dtype | None = None,
        num_blocks: int | None = None,
        calibration: Any = None,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim, self.windows = model_geometry(config)
        plan = parse_plan(format) if is_plan(format) else None
        self.format = plan.base if plan is not None else parse_format(format)
        # one format per layer: a per-layer plan (kvpack.plans) stores each format's layers in their own pool
        self.layer_formats = plan.formats(self.num_layers) if plan is not None else [self.format] * self.num_layers
        self.plan = plan if plan is not None and not plan.is_uniform else None
        for f in {f.name: f for f in self.layer_formats}.values():
            f.check(self.head_dim)
        if self.plan is not None:  # each distinct format's layers take their rows of the artifact
            self.calibration = _resolve_plan_calibration(
                calibration, config, self.layer_formats, self.kv_heads, self.head_dim
            )
        else:
            self.calibration = _resolve_calibration(
                calibration, config, self.format, self.num_layers, self.kv_heads, self.head_dim
            )
        cfg = _text_config(config)
        if max_tokens is None:
            max_tokens = min(
                int(getattr(cfg, "max_position_embeddings", None) or DEFAULT_MAX_TOKENS), DEFAULT_MAX_TOKENS
            )
        for name, n in (("max_tokens", max_tokens), ("batch_size", batch_size)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {n!r}")
        if backend != "auto" and backend not in kernels.BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}; use 'auto' or one of {', '.join(kernels.BACKENDS)}")
        self.max_tokens = int(max_tokens)
        self.min_sequences = int(batch_size)
        self.backend = backend
        self.tail_dtype = tail_dtype
        self.num_blocks = num_blocks
        self.paged = None  # kvpack.cache.PagedKVCache, created on the first update
        self.seq_ids: list[int] = []
        self.fused_decode_calls = 0
        self.decode_backends: Counter[str] = Counter()
        self.fused_position_calls = 0
        self.chunk_calls = 0
        self.backend_choice: dict[tuple, tuple[str, Callable]] = {}  # (layer, q dtype, device) -> backend
        self.previous_attn_implementation: str | None = None  # set by cache_for
        layers = [KVPackLayer(self, i, w) for i, w in enumerate(self.windows)]
        super().__init__(layers=layers)

    # -- sizing and storage -------------------------------------------------------------------------
    @property
    def format_name(self) -> str:
        """The format's name, or the per-layer plan's."""
        return self.plan.name if self.plan is not None else self.format.name

    def blocks_needed(self, sequences: int, fmt: KVFormat | None = None) -> int:
        """Pool size for ``sequences`` sequences of ``max_tokens``: their blocks, one spare each, the null block
        (in blocks of ``fmt``, default the cache's format)."""
        per_seq = math.ceil(self.max_tokens / (fmt or self.format).block_size) + 1
        return sequences * per_seq + 1

    @_plain_tensors
    def _create(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        from kvpack.cache import PagedKVCache

        sequences = max(self.min_sequences, batch)
        if self.plan is not None:
            from kvpack.cache.layered import LayeredKVCache

            self.paged = LayeredKVCache(
                self.layer_formats,
                self.kv_heads,
                self.head_dim,
                lambda fmt: self.num_blocks or self.blocks_needed(sequences, fmt),
                window=self.windows,
                calibration=self.calibration,
                tail_dtype=self.tail_dtype or dtype,
                device=device,
            )
            return
        num_blocks = self.num_blocks or self.blocks_needed(sequences)
        self.paged = PagedKVCache(
            self.format,
            self.num_layers,
            self.kv_heads,
            self.head_dim,
            num_blocks,
            tail_dtype=self.tail_dtype or dtype,
            device=device,
            window=self.windows,
            calibration=self.calibration,
        )

    @_plain_tensors
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[PackedKV, PackedKV]:
        """Append ``[batch, kv_heads, T, head_dim]`` keys and values to layer ``layer_idx``; return handles."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ShapeError(
                f"keys and values must both be [batch, kv_heads, T, head_dim], got {tuple(key_states.shape)} "
                f"and {tuple(value_states.shape)}"
            )
        batch, heads, t, d = key_states.shape
        if heads != self.kv_heads or d != self.head_dim:
            raise ShapeError(
                f"this cache was built for kv_heads={self.kv_heads}, head_dim={self.head_dim} but layer {layer_idx} "
                f"sent {heads} heads of {d}; build the cache from this model's config"
            )
        if self.paged is None:
            self._create(batch, key_states.dtype, key_states.device)
        if not self.seq_ids:
            self.seq_ids = [self.paged.add_sequence() for _ in range(batch)]
        elif batch != len(self.seq_ids):
            raise ShapeError(
                f"this cache holds {len(self.seq_ids)} sequences but layer {layer_idx} sent a batch of {batch}; "
                "use one cache per batch (or cache.reset())"
            )
        try:
            self.paged.append(layer_idx, self.seq_ids, key_states, value_states)
        except PoolExhaustedError as e:
            raise PoolExhaustedError(
                f"{e}. The cache was sized for {max(self.min_sequences, batch)} sequences of {self.max_tokens} "
                "tokens: build a bigger one, e.g. kvpack.hf.cache_for(model, max_tokens=..., batch_size=...) with "
                "max_tokens >= prompt + new tokens and batch_size >= batch x num_beams"
            ) from e
        handle = PackedKV(self, layer_idx, t)
        return handle, handle

    def layer_seq_len(self, layer_idx: int) -> int:
        """Tokens held by the layer (pads included), the same for every row of the batch."""
        if self.paged is None or not self.seq_ids:
            return 0
        return int(self.paged.seq_len(self.seq_ids[0], layer=layer_idx))

    def view(self, layer_idx: int, start_pos: torch.Tensor | None = None) -> PagedKV:
        """The kernel-facing :class:`PagedKV` of one layer for the whole batch."""
        kv = self.paged.view(layer_idx, self.seq_ids)
        if start_pos is not None:
            kv = dataclasses.replace(kv, start_pos=start_pos.to(device=kv.device, dtype=torch.int32))
        return kv

    # -- transformers' Cache API, done once for all layers ------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer_seq_len(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @_plain_tensors
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues row ``beam_idx[i]``. Sealed blocks are shared by reference (never
        copied); only the one-block tails are copied."""
        if not self.seq_ids:
            return
        self.paged.reorder(self.seq_ids, beam_idx.to("cpu"))

    @_plain_tensors
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` (contrastive search)."""
        if self.seq_ids:
            self._replace_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    @_plain_tensors
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times, in place (forks: sealed blocks shared)."""
        if self.seq_ids:
            self._replace_rows([i for i in range(len(self.seq_ids)) for _ in range(repeats)])

    def _replace_rows(self, order: list[int]) -> None:
        """New rows: row ``j`` is a fork of old row ``order[j]``; old sequences are freed afterwards."""
        old = self.seq_ids
        if any(not 0 <= i < len(old) for i in order):
            raise ShapeError(f"row indices must be in [0, {len(old)}), got {order}")
        new: list[int] = []
        try:
            for i in order:
                new.append(self.paged.fork(old[i]))
        except Exception:
            for sid in new:  # leave the cache as it was
                self.paged.free(sid)
            raise
        for sid in old:
            self.paged.free(sid)
        self.seq_ids = new

    @_plain_tensors
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every sequence (transformers passes a negative count;
        a positive value is the length to keep, as in transformers' legacy call)."""
        if not self.seq_ids:
            return
        current = self.layer_seq_len(0)
        keep = current + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, current)
        if keep < 0:
            raise ShapeError(f"cannot remove {-tokens_to_remove} tokens from sequences of {current}")
        if keep == current:
            return
        for sid in self.seq_ids:
            self.paged.crop(sid, keep)

    @_plain_tensors
    def reset(self) -> None:
        """Free every sequence (the pool and its blocks stay allocated for the next generation)."""
        if self.paged is not None:
            for sid in self.seq_ids:
                self.paged.free(sid)
        self.seq_ids = []

    def activate_past_recording(self) -> None:
        """Nothing to do: kvpack keeps what a crop needs (transformers calls this before assisted decoding)."""
        return None

    @property
    def batch_size(self) -> int:
        """Sequences held (rows of the batch), ``-1`` before the first update."""
        return len(self.seq_ids) if self.seq_ids else -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    # -- reporting ----------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport | None:
        """The paged cache's :class:`~kvpack.cache.MemoryReport`; ``None`` before the first update."""
        return None if self.paged is None else self.paged.memory_report()

    def bytes_summary(self) -> dict[str, int]:
        """``used_bytes`` (payload, scales, tails of live sequences), ``allocated_bytes`` (the whole pool),
        ``fp16_bytes`` (the same live tokens as plain fp16 K/V) and ``live_tokens`` (summed over layers)."""
        report = self.memory_report()
        if report is None:
            return {"used_bytes": 0, "allocated_bytes": 0, "fp16_bytes": 0, "live_tokens": 0}
        t = report.total
        return {
            "used_bytes": t.used_bytes,
            "allocated_bytes": t.allocated_bytes,
            "fp16_bytes": 2 * self.kv_heads * self.head_dim * 2 * t.live_tokens,
            "live_tokens": t.live_tokens,
        }

    def __repr__(self) -> str:
        return (
            f"KVPackCache(format={self.format_name!r}, layers={self.num_layers}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, sequences={len(self.seq_ids)})"
        )


def _load_calibration(calibration: Any, config: PreTrainedConfig) -> Any:
    """``calibration`` loaded (a path, with :func:`~kvpack.calibration.load_artifact`) and, for an
    :class:`Artifact`, checked against the model's fingerprint; anything else as it is."""
    from pathlib import Path

    from kvpack.calibration.artifact import Artifact, load_artifact

    if isinstance(calibration, (str, Path)):
        return load_artifact(calibration, model=config)
    if isinstance(calibration, Artifact):
        calibration.check_model(config)
    return calibration


def _check_format_calibration(fmt: KVFormat, calibration: Any, num_layers: int, kv_heads: int, head_dim: int) -> None:
    """Refuse now what a paged cache of ``fmt`` would refuse at its first update: a static format without scales,
    an artifact the format ignores, scales or statistics of another shape, no query statistics for ``o<N>q``."""
    from kvpack.cache.calibrated import resolve_calibration, resolve_outlier_channels, resolve_query_energy

    cpu = torch.device("cpu")
    for resolve in (resolve_calibration, resolve_outlier_channels, resolve_query_energy):
        resolve(fmt, calibration, num_layers, kv_heads, head_dim, cpu)


def _resolve_calibration(
    calibration: Any, config: PreTrainedConfig, fmt: KVFormat, num_layers: int, kv_heads: int, head_dim: int
) -> Any:
    """The calibration a :class:`KVPackCache` hands its paged cache, loaded and checked now (fail closed):
    :func:`_load_calibration`, then :func:`_check_format_calibration`, before the model runs."""
    calibration = _load_calibration(calibration, config)
    _check_format_calibration(fmt, calibration, num_layers, kv_heads, head_dim)
    return calibration


def _resolve_plan_calibration(
    calibration: Any, config: PreTrainedConfig, layer_formats: list[KVFormat], kv_heads: int, head_dim: int
) -> Any:
    """The artifact a per-layer plan's :class:`~kvpack.cache.layered.LayeredKVCache` hands its parts, loaded and
    checked now: every format of the plan that needs one (static specs, ``o<N>q``) is checked against its layers'
    rows, as its part will be at the first update.

    Raises:
        CalibrationError: a format that needs an artifact without one, an artifact no format of the plan takes,
            one made for another model, or one that does not fit a format (scales of another spec, no query
            statistics).
    """
    from kvpack.cache.layered import LayeredKVCache

    calibration = _load_calibration(calibration, config)
    if calibration is not None:
        LayeredKVCache.check_calibration(calibration, layer_formats)  # an artifact, taken by some format
    for fmt in {f.spec_string(): f for f in layer_formats}.values():
        if fmt.needs_artifact:
            layers = [i for i, f in enumerate(layer_formats) if f == fmt]
            part = None if calibration is None else calibration.select_layers(layers)
            _check_format_calibration(fmt, part, len(layers), kv_heads, head_dim)
    return calibration


def _check_attention_interface(model: Any) -> None:
    """Refuse a model whose attention layers compute attention in their own code (GPT-J, Falcon, Bloom in
    transformers 5) rather than through transformers' attention interface, where ``attn_implementation="kvpack"``
    plugs in: such a layer would treat the cache's packed handles as tensors.

    A model class declares the interface (``_supports_attention_backend``), or its module looks the function up
    in ``ALL_ATTENTION_FUNCTIONS`` (some that use it, such as StableLM, do not declare it).

    Raises:
        UnsupportedError: the model does not attend through the interface.
    """
    cls = type(model)
    if getattr(cls, "_supports_attention_backend", False):
        return
    # the modules of the model's own classes (a transformers model's, remote code's, a user's), not those of the
    # shared bases (PreTrainedModel, GenerationMixin, torch's Module), which say nothing about this model
    names = {c.__module__ for c in cls.__mro__}
    own = [n for n in names if n.startswith(("transformers.models.", "transformers_modules.")) or
           not n.startswith(("transformers", "torch", "builtins"))]  # fmt: skip
    if any(hasattr(sys.modules.get(n), "ALL_ATTENTION_FUNCTIONS") for n in own):
        return
    raise UnsupportedError(
        f"{cls.__name__} computes attention in its own code, not through transformers' attention interface, so "
        "attn_implementation='kvpack' cannot read a kvpack cache there; kvpack's vLLM backend serves such models "
        "(it attends in vLLM's layers; docs/vllm.md lists the attention options it refuses)",
        [f"{cls.__name__}: no attention interface"],
    )


def cache_for(
    model: Any,
    format: str | KVFormat | LayerPlan = "int4",
    max_tokens: int | None = None,
    batch_size: int = 1,
    *,
    backend: str = "auto",
    num_blocks: int | None = None,
    calibration: Any = None,
) -> KVPackCache:
    """A :class:`KVPackCache` for ``model``, and the model switched to ``attn_implementation="kvpack"``.

    Then ``model.generate(**inputs, cache=cache)`` (``past_key_values=cache`` before transformers 5.24;
    :func:`cache_kwarg` says which). The switch changes the model object: to go back, call
    ``model.set_attn_implementation("sdpa")`` (or whatever it used, saved in ``cache.previous_attn_implementation``).

    Args:
        model: a transformers causal LM (decoder with full and/or sliding-window attention layers).
        format: a preset (``"int4"``, ``"int8"``, ``"fp8"``, ``"fp16"``, ...), a custom format string, or a
            per-layer plan (``"int4/int8[0,5-6]"``, :mod:`kvpack.plans`).
        max_tokens: tokens one sequence may reach (prompt + new tokens); default
            ``min(max_position_embeddings, 8192)``.
        batch_size: the least number of sequences to size the pool for (the first forward's rows, beams
            included, are always covered).
        backend: decode backend, ``"auto"`` by default (the fused kernel, else the reference with a warning).
        num_blocks: override the pool size in blocks.
        calibration: a calibration artifact directory (``kvpack calibrate --out DIR``) or a loaded
            :class:`~kvpack.calibration.Artifact`: static scales for a ``static`` format, outlier key channels
            for a format with ``o<N>`` keys (e.g. ``"fp8-o4"``), query statistics for one with ``o<N>q`` keys;
            see :class:`KVPackCache`.

    Raises:
        UnsupportedError: the model has layers kvpack cannot store (linear or chunked attention).
        FormatError: the format cannot store this head_dim.
        CalibrationError: a static format without an artifact, an artifact for another model, or one the
            format would ignore.
    """
    _check_attention_interface(model)
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    cache = KVPackCache(
        config,
        format,
        max_tokens=max_tokens,
        batch_size=batch_size,
        backend=backend,
        tail_dtype=getattr(model, "dtype", None),
        num_blocks=num_blocks,
        calibration=calibration,
    )
    if previous != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache.previous_attn_implementation = previous if previous != ATTN_IMPLEMENTATION else "sdpa"
    return cache
