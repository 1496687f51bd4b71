"""The ``attn_implementation="kvpack"`` side of the transformers integration: the attention and mask functions.

transformers calls :func:`kvpack_mask` (registered in ``AttentionMaskInterface``) once per forward with the 2-D
padding mask; it returns a :class:`PaddingInfo` (each sequence's first real position). Each attention module then
calls :func:`kvpack_attention` (registered in ``AttentionInterface``) with the :class:`PackedKV` handle that
:meth:`kvpack.integrations.transformers.KVPackCache.update` returned in place of dense keys and values:

* one new token per sequence (a decode step): the fused decode kernel, :func:`kvpack.kernels.decode_attention`;
* a few that all lie in each sequence's tail (the candidates of assisted generation, a short chunk), on the CPU:
  the same kernel once, the positions as more query heads, each cut to its own history (:func:`_fused_positions`);
* several (prefill, a question after a cached document, longer verifications):
  :func:`chunk_attention`: the fused multi-query kernel (:func:`kvpack.kernels.chunk_attention`) where one can
  run, else SDPA over the history dequantized once per sequence.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvpack import kernels
from kvpack.errors import ConfigError, ShapeError, UnsupportedError
from kvpack.kernels.reference import attention_mask, check_query, row_history
from kvpack.kernels.views import PagedKV

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PackedKV",
    "PaddingInfo",
    "chunk_attention",
    "dequantized_chunk_attention",
    "kvpack_attention",
    "kvpack_mask",
    "register",
]

ATTN_IMPLEMENTATION = "kvpack"
_QUERY_CHUNK = 512  # queries per SDPA call in the chunk path: bounds the [Hq, chunk, seq_len] score scratch


# ----------------------------------------------------------------------------------------------------
# What flows from the cache and the mask function to the attention function


@dataclass(frozen=True)
class PaddingInfo:
    """The attention mask as the kvpack attention function consumes it.

    Attributes:
        start_pos: ``[batch]``, dtype ``torch.int32``: each sequence's first real (non-padding) position; ``None``
            when nothing is padded.
    """

    start_pos: torch.Tensor | None = None


_WRONG_ATTENTION = (
    "a kvpack cache hands packed K/V handles to the 'kvpack' attention function, but this model runs another "
    "attention implementation; call model.set_attn_implementation('kvpack') (kvpack.hf.cache_for does it). A model "
    "whose attention is its own code, not transformers' attention interface (GPT-J, Falcon, Bloom), cannot read a "
    "kvpack cache at all: kvpack's vLLM backend serves such models (docs/vllm.md)"
)


class WrongAttentionError(ConfigError, AttributeError):
    """A model's code used a :class:`PackedKV` as a tensor (an attribute such as ``.to`` or ``.transpose``).

    Also an ``AttributeError``, so ``hasattr`` and ``getattr(..., default)`` on a handle keep their meaning."""


def _wrong_attention(*_: Any, **__: Any) -> None:
    raise ConfigError(_WRONG_ATTENTION)


class PackedKV:
    """Handle to one layer of a :class:`KVPackCache`, returned by ``update()`` in place of dense keys/values.

    It stands where transformers' attention functions expect ``[batch, kv_heads, seq_len, head_dim]`` tensors;
    only :func:`kvpack_attention` reads it. Any torch operation on it (another attention implementation) raises
    :class:`~kvpack.errors.ConfigError` saying how to switch the model to ``attn_implementation="kvpack"``.
    """

    __slots__ = ("cache", "layer_idx", "new_tokens")

    def __init__(self, cache: Any, layer_idx: int, new_tokens: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.new_tokens = new_tokens

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, kv_heads, seq_len, head_dim)`` of the layer's history, as a dense cache would report it."""
        c = self.cache
        return (len(c.seq_ids), c.kv_heads, c.layer_seq_len(self.layer_idx), c.head_dim)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _wrong_attention()

    __getitem__ = _wrong_attention

    def __getattr__(self, name: str) -> Any:  # only for names the handle lacks: tensor methods
        if name.startswith("__"):
            raise AttributeError(name)
        raise WrongAttentionError(f"{_WRONG_ATTENTION} (it asked the handle for {name!r})")

    def __repr__(self) -> str:
        return f"PackedKV(layer={self.layer_idx}, shape={self.shape}, format={self.cache.format_name})"


# ----------------------------------------------------------------------------------------------------
# Attention


def chunk_attention(
    q: torch.Tensor, kv: PagedKV, sm_scale: float | None = None, window: int | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Attention of the last ``T`` positions of each sequence over its cached history (quantized blocks + tail).

    The contract of :func:`kvpack.kernels.reference.paged_attention_reference` (causal, ``window``,
    ``kv.start_pos``, fully masked rows give zeros). Runs the fused chunk kernel
    (:func:`kvpack.kernels.run_chunk_backend`) when the dispatcher finds one that can run this case
    (``backend``: ``"auto"``, or a forced ``"cpu"`` / ``"triton"``); otherwise (``"reference"``, or no fused
    kernel: the dispatcher's one-time warning says why in ``auto`` mode) :func:`dequantized_chunk_attention`.

    Args:
        q: ``[batch, T, Hq, D]``, float; ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's paged cache, the chunk's own tokens already appended.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: sliding window (positions ``> p - window`` are attended).
        backend: the cache's kernel choice.

    Returns:
        ``[batch, T, Hq, D]`` in ``q.dtype``.
    """
    name = _chunk_backend(q, kv, window, backend)
    if name is None:
        return dequantized_chunk_attention(q, kv, sm_scale, window)
    return kernels.run_chunk_backend(name, q, kv, sm_scale, window)


def _chunk_backend(q: torch.Tensor, kv: PagedKV, window: int | None, backend: str) -> str | None:
    """The fused chunk backend to run, or None for the dequantize-then-SDPA path
    (:func:`kvpack.kernels.fused_chunk_backend`)."""
    return kernels.fused_chunk_backend(q, kv, window, backend)


def dequantized_chunk_attention(
    q: torch.Tensor, kv: PagedKV, sm_scale: float | None = None, window: int | None = None
) -> torch.Tensor:
    """:func:`chunk_attention` without a fused kernel: the history is dequantized once per sequence and
    queries run through ``torch.nn.functional.scaled_dot_product_attention`` in chunks, so a 4k-token prefill
    needs scratch for ``[Hq, 512, seq_len]`` scores, not ``[Hq, T, seq_len]``. Arguments as :func:`chunk_attention`."""
    check_query(q, kv)
    batch, t, hq, d = q.shape
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group = hq // kv.kv_heads
    out = torch.empty(batch, t, hq, d, dtype=q.dtype, device=q.device)
    for row in range(batch):
        k, v, start = row_history(kv, row, t, group)  # [Hq, n, D] float32
        n = k.shape[1]
        qr = q[row].transpose(0, 1).float()  # [Hq, T, D]
        for c0 in range(0, t, _QUERY_CHUNK):
            c1 = min(t, c0 + _QUERY_CHUNK)
            mask = attention_mask(n, n - t + c0, n - t + c1, window, start, q.device)
            res = torch.nn.functional.scaled_dot_product_attention(
                qr[:, c0:c1], k, v, attn_mask=mask, scale=sm_scale
            )  # [Hq, c, D]
            res = torch.where(mask.any(-1).view(1, -1, 1), res, torch.zeros((), dtype=res.dtype, device=res.device))
            out[row, c0:c1] = res.transpose(0, 1).to(q.dtype)
    return out


def _decode_backend(cache: Any, layer: int, q: torch.Tensor, kv: PagedKV, window: int | None) -> tuple[str, Any]:
    """The decode backend for this layer, chosen once per cache (format, dtypes and device do not change
    between steps): the dispatcher's choice, with its one-time warning when it falls back to the reference."""
    key = (layer, q.dtype, q.device.type)
    hit = cache.backend_choice.get(key)
    if hit is None:
        name = kernels.choose_backend(q, kv, window, cache.backend)
        hit = cache.backend_choice[key] = (name, functools.partial(kernels.run_backend, name))
    return hit


# A forward of up to this many new tokens that all lie in each sequence's tail runs the CPU decode kernel once, the
# positions as query heads (``tail_cut``), rather than the chunk kernel, which decodes every block into floats for
# any number of queries: four queries of 32 int8 sequences of 250-450 tokens on two threads take 1.1 ms there
# against 4.1 ms (python benchmarks/cpu_few_queries.py --format int8 --threads 2).
FUSED_QUERIES = 8


def _fused_positions(
    cache: Any, layer: int, query: torch.Tensor, kv: PagedKV, window: int | None, scaling: float | None
) -> torch.Tensor | None:
    """``[batch, T, Hq, D]``: the ``T`` new positions' attention (``query`` ``[batch, Hq, T, D]``) in one CPU decode
    call, position ``t`` as query heads cut ``T - 1 - t`` places before the last; None where that cannot run (more
    than :data:`FUSED_QUERIES` positions, a window, a query in a block this forward sealed, another backend)."""
    b, t = query.shape[0], query.shape[2]
    if t > FUSED_QUERIES or window is not None or query.device.type != "cpu":
        return None
    if bool((kv.seq_lens % kv.block_size < t - 1).any()):  # the first query lies before the tail
        return None
    if _decode_backend(cache, layer, query[:, :, -1], kv, window)[0] != "cpu":
        return None
    cut = torch.arange(t - 1, -1, -1, dtype=torch.int32).expand(b, -1).contiguous()
    return kernels.decode_positions(query.transpose(1, 2), kv, cut, scaling)


def _start_pos(attention_mask: Any) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if isinstance(attention_mask, PaddingInfo):
        return attention_mask.start_pos
    raise UnsupportedError(
        "the kvpack attention takes the 2-D padding mask transformers builds from attention_mask (left padding); "
        f"it got a {type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}, "
        "probably a custom 4-D mask: pass a 2-D attention_mask instead",
        ["custom 4-D attention masks are not supported"],
    )


def kvpack_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function ``attn_implementation="kvpack"``.

    Args:
        module: the attention module (``module.layer_idx`` names the layer; unused, the handle knows it).
        query: ``[batch, Hq, T, D]``, the new positions' queries after RoPE.
        key, value: the :class:`PackedKV` handle returned by :meth:`KVPackCache.update`.
        attention_mask: a :class:`PaddingInfo` (from :func:`kvpack_mask`) or ``None``.
        scaling: softmax scale (``module.scaling``).
        sliding_window: the layer's window when the model passes it (checked against the cache's).

    Returns:
        ``([batch, T, Hq, D] output in query.dtype, None)``: attention weights are never materialized.
    """
    if not isinstance(key, PackedKV):
        from kvpack.integrations.transformers import cache_kwarg

        raise ConfigError(
            "attn_implementation='kvpack' reads a kvpack cache, but this forward got dense keys (no cache, "
            f"another Cache class, or a cache under another keyword); pass {cache_kwarg(module)}="
            "kvpack.hf.cache_for(model) or switch back with model.set_attn_implementation('sdpa')"
        )
    reasons = []
    if softcap is not None:
        reasons.append(f"attention logit soft-capping (softcap={softcap})")
    if kwargs.get("s_aux") is not None:
        reasons.append("attention sinks (s_aux)")
    if reasons:
        raise UnsupportedError("the kvpack attention cannot run this model: " + "; ".join(reasons), reasons)
    cache, layer = key.cache, key.layer_idx
    window = cache.windows[layer]
    if sliding_window is not None and window != sliding_window:
        raise ConfigError(
            f"layer {layer} attends over a window of {sliding_window} but the cache was built with "
            f"{window}; build the cache from this model's config"
        )
    t = query.shape[2]
    if t != key.new_tokens:
        raise ShapeError(f"layer {layer}: {t} queries for {key.new_tokens} new tokens in the cache")
    kv = cache.view(layer, _start_pos(attention_mask))
    if t == 1:
        q = query[:, :, 0]  # [batch, Hq, D]
        name, run = _decode_backend(cache, layer, q, kv, window)
        out = run(q, kv, scaling, window, None)
        cache.decode_backends[name] += 1
        if name != "reference":
            cache.fused_decode_calls += 1
        return out.unsqueeze(1), None  # [batch, 1, Hq, D]
    out = _fused_positions(cache, layer, query, kv, window, scaling)
    if out is not None:
        cache.fused_position_calls += 1
        return out, None
    cache.chunk_calls += 1
    return chunk_attention(query.transpose(1, 2), kv, scaling, window, cache.backend), None


def kvpack_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> PaddingInfo:
    """transformers mask function for ``attn_implementation="kvpack"``: the padding mask as start positions.

    Args:
        attention_mask: ``[batch, seq_len]`` bool, ``True`` on real tokens (all positions so far, the new
            ones included), or ``None``.

    Returns:
        A :class:`PaddingInfo`; causality and sliding windows are applied by the kernels themselves.

    Raises:
        UnsupportedError: padding other than on the left, or custom mask overlays (bidirectional blocks,
            image-token masks), which the packed kernels do not express.
    """
    if use_vmap:
        raise UnsupportedError(
            "the kvpack attention supports causal and sliding-window masks with left padding; this model adds a "
            "custom mask overlay (bidirectional or image-token attention)",
            ["custom mask overlays are not supported"],
        )
    if attention_mask is None:
        return PaddingInfo(None)
    am = attention_mask.to(torch.bool)
    if am.dim() != 2:
        raise UnsupportedError(
            f"expected a 2-D padding mask, got shape {tuple(am.shape)}", ["custom attention masks are not supported"]
        )
    length = am.shape[1]
    real = am.sum(dim=1)
    start = torch.where(real > 0, am.int().argmax(dim=1), torch.full_like(real, length))
    if bool((real != length - start).any()):
        raise UnsupportedError(
            "the attention_mask has padding after real tokens (right padding or holes); kvpack supports left "
            "padding only: set tokenizer.padding_side = 'left'",
            ["only left padding is supported"],
        )
    if not bool(start.any()):
        return PaddingInfo(None)
    return PaddingInfo(start.to(torch.int32))


def register() -> None:
    """Register ``"kvpack"`` in transformers' attention and mask registries (idempotent; done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpack_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpack_mask)
