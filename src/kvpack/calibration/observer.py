"""Streaming statistics of keys (after RoPE) and values, per layer, kv head and channel.

:class:`KVObserver` keeps, for every layer and for keys and values separately, the per-channel abs-max,
minimum, maximum and sum of squares, plus a per-channel histogram of magnitudes from which percentiles are
read at the end. Nothing is kept per token, so memory does not grow with the amount of calibration text.

The histogram bins are read straight from the float32 bit pattern: the exponent plus the top
:data:`SUB_BITS` mantissa bits, i.e. 32 log-spaced bins per octave over ``[2**-16, 2**16)`` (a bin is
2.2 % wide). A percentile is reported as the upper edge of the bin where the cumulative count reaches it,
capped at the exact abs-max, so it never underestimates the true percentile and overestimates it by at
most one bin.

Keys are seen after RoPE through a transformers cache whose ``update`` records statistics
(:func:`observing_cache`): the cache is the host's extension point, no model code is touched. Queries (as the
attention reads them: after QK-norm and RoPE) are seen through a registered attention function
(:func:`observing_attention`); of them only the mean square per kv head and channel is kept (the energy a
query-ranked outlier spec, ``o<k>q``, ranks key channels by).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpack.errors import CalibrationError, NonFiniteError, ShapeError

__all__ = [
    "NUM_BINS",
    "SUB_BITS",
    "KVObserver",
    "RoleStats",
    "bin_upper_edges",
    "magnitude_bins",
    "observing_attention",
    "observing_cache",
]

SUB_BITS = 5  # mantissa bits per bin: 32 bins per octave
_EXP_LO, _EXP_HI = -16, 16  # magnitudes binned in [2**-16, 2**16); the first and last bins catch the rest
NUM_BINS = (_EXP_HI - _EXP_LO) << SUB_BITS
_BIN_BASE = (127 + _EXP_LO) << SUB_BITS  # biased exponent and mantissa bits of 2**-16, in bin units


def magnitude_bins(a: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each magnitude.

    Args:
        a: non-negative magnitudes, any shape, float32.

    Returns:
        int64, same shape, in ``[0, NUM_BINS)``.
    """
    bits = a.contiguous().view(torch.int32) >> (23 - SUB_BITS)
    return (bits.long() - _BIN_BASE).clamp(0, NUM_BINS - 1)


def bin_upper_edges() -> torch.Tensor:
    """Upper edge of every bin, float32 ``[NUM_BINS]`` (the last one is ``inf``: it also holds overflow)."""
    idx = torch.arange(1, NUM_BINS + 1, dtype=torch.int64) + _BIN_BASE
    edges = (idx << (23 - SUB_BITS)).to(torch.int32).view(torch.float32).clone()
    edges[-1] = float("inf")
    return edges


@dataclass
class RoleStats:
    """Statistics of keys or values for every layer.

    Attributes:
        absmax: ``[layers, kv_heads, head_dim]`` float32, largest magnitude per channel.
        min: ``[layers, kv_heads, head_dim]`` float32, smallest value per channel.
        max: ``[layers, kv_heads, head_dim]`` float32, largest value per channel.
        rms: ``[layers, kv_heads, head_dim]`` float32, root mean square per channel.
        pair_absmax: ``[layers, kv_heads, head_dim]`` float32, largest norm of the RoPE pair a channel belongs
            to (channel ``i`` and ``i + head_dim/2``, the rotate-half pairing of Llama-style models). RoPE
            rotates each pair by a position-dependent angle, so this bounds the channel at *every*
            position, including positions longer than the calibration windows.
        tokens: ``[layers]`` int64, tokens observed per layer (each channel saw that many values).
        percentiles: percentile (e.g. ``99.9``) -> ``[layers, kv_heads, head_dim]`` float32 magnitude.
    """

    absmax: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    rms: torch.Tensor
    pair_absmax: torch.Tensor
    tokens: torch.Tensor
    percentiles: dict[float, torch.Tensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.absmax.shape[0]

    def select(self, layers: Sequence[int]) -> RoleStats:
        """The statistics of ``layers`` only, in that order."""
        idx = torch.as_tensor(list(layers), dtype=torch.long)
        return RoleStats(
            *(t[idx] for t in (self.absmax, self.min, self.max, self.rms, self.pair_absmax, self.tokens)),
            percentiles={p: t[idx] for p, t in self.percentiles.items()},
        )

    def magnitude(self, source: str) -> torch.Tensor:
        """Per-channel range ``[layers, kv_heads, head_dim]`` for ``source``: ``"absmax"``, ``"rope"`` (the
        RoPE pair bound, :attr:`pair_absmax`) or ``"p<P>"``."""
        if source == "absmax":
            return self.absmax
        if source == "rope":
            return self.pair_absmax
        p = parse_source(source)
        if p not in self.percentiles:
            have = ", ".join(f"p{q:g}" for q in sorted(self.percentiles)) or "none"
            raise CalibrationError(
                f"the artifact holds no {source} statistic (it has absmax and {have}); "
                f"recalibrate with --percentile {p:g}"
            )
        return self.percentiles[p]


SOURCES_HELP = "'absmax', 'rope' (RoPE pair bound) or 'p<percentile>' (e.g. p99.9)"


def parse_source(source: str) -> float:
    """``"p99.9"`` -> ``99.9``; :class:`CalibrationError` for a malformed source."""
    try:
        if not source.startswith("p"):
            raise ValueError
        p = float(source[1:])
    except ValueError:
        raise CalibrationError(f"unknown range source {source!r}; use {SOURCES_HELP}") from None
    if not 0.0 < p < 100.0:
        raise CalibrationError(f"percentile must be in (0, 100), got {p:g}; use 'absmax' for the maximum")
    return p


class _LayerAccumulator:
    """Running statistics of one role in one layer."""

    def __init__(self, kv_heads: int, head_dim: int, histogram: bool, device: torch.device) -> None:
        shape = (kv_heads, head_dim)
        self.absmax = torch.zeros(shape, dtype=torch.float32, device=device)
        self.min = torch.full(shape, float("inf"), dtype=torch.float32, device=device)
        self.max = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)
        self.sumsq = torch.zeros(shape, dtype=torch.float64, device=device)
        self.pair = torch.zeros(shape, dtype=torch.float32, device=device)
        self.tokens = 0
        channels = kv_heads * head_dim
        self.hist = torch.zeros(channels * NUM_BINS, dtype=torch.int32, device=device) if histogram else None

    def add(self, x: torch.Tensor) -> None:
        # x: [B, H, T, D] -> per channel over B*T values
        xf = x.detach().float()
        h, d = xf.shape[1], xf.shape[3]
        flat = xf.permute(1, 3, 0, 2).reshape(h, d, -1).contiguous()  # [H, D, N], N = batch * tokens
        self.absmax = torch.maximum(self.absmax, flat.abs().amax(-1))
        self.min = torch.minimum(self.min, flat.amin(-1))
        self.max = torch.maximum(self.max, flat.amax(-1))
        self.sumsq += flat.double().pow(2).sum(-1)
        half = d // 2
        pair = (flat[:, :half].pow(2) + flat[:, half : 2 * half].pow(2)).sqrt().amax(-1)  # [H, D/2]
        pair = torch.cat([pair, pair, self.absmax[:, 2 * half :]], -1)  # an odd head_dim's last channel: itself
        self.pair = torch.maximum(self.pair, torch.maximum(pair, self.absmax))
        self.tokens += flat.shape[-1]
        if self.hist is not None:
            bins = magnitude_bins(flat.abs()).reshape(h * d, -1)
            bins += torch.arange(h * d, device=bins.device).unsqueeze(1) * NUM_BINS  # channel-major flat index
            bins = bins.flatten()
            self.hist.index_add_(0, bins, torch.ones(1, dtype=torch.int32, device=bins.device).expand(bins.numel()))

    def percentile(self, p: float, edges: torch.Tensor) -> torch.Tensor:
        assert self.hist is not None
        counts = self.hist.reshape(*self.absmax.shape, NUM_BINS).long()
        cum = counts.cumsum(-1)
        target = torch.full((*self.absmax.shape, 1), max(1, math.ceil(p / 100.0 * self.tokens)), dtype=torch.long)
        idx = torch.searchsorted(cum, target.to(cum.device)).squeeze(-1).clamp(max=NUM_BINS - 1)
        return torch.minimum(edges.to(idx.device)[idx], self.absmax)


class KVObserver:
    """Collects :class:`RoleStats` for keys and values from ``observe`` calls, layer by layer.

    Args:
        percentiles: magnitudes percentiles to report, each in (0, 100); empty disables the histograms
            (saves ``4 * layers * kv_heads * head_dim * NUM_BINS`` bytes per role).
    """

    def __init__(self, percentiles: Sequence[float] = (99.9, 99.99)) -> None:
        for p in percentiles:
            if not 0.0 < float(p) < 100.0:
                raise CalibrationError(f"percentile must be in (0, 100), got {p}; use abs-max for the maximum")
        self.percentiles = tuple(sorted({float(p) for p in percentiles}))
        self._keys: dict[int, _LayerAccumulator] = {}
        self._values: dict[int, _LayerAccumulator] = {}
        self._queries: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (sum of q^2 [H, D] float64, count)

    def observe_queries(self, layer_idx: int, query_states: torch.Tensor, kv_heads: int) -> None:
        """Add one batch of one layer's queries.

        Args:
            layer_idx: the layer.
            query_states: ``[batch, heads, tokens, head_dim]`` floating point, as the attention reads them.
            kv_heads: the layer's kv heads; query head ``h`` reads kv head ``h // (heads // kv_heads)``.

        Raises:
            ShapeError: wrong rank or dtype, heads not a multiple of ``kv_heads``, or a shape that differs from
                earlier calls of this layer.
            NonFiniteError: NaN or inf in the batch; nothing is recorded.
        """
        q = query_states
        if q.dim() != 4 or not q.is_floating_point():
            raise ShapeError(
                f"query_states must be a float tensor [batch, heads, tokens, head_dim], got {tuple(q.shape)}"
            )
        b, hq, t, d = q.shape
        if kv_heads <= 0 or hq % kv_heads:
            raise ShapeError(f"{hq} query heads do not split over {kv_heads} kv heads")
        if not torch.isfinite(q).all():
            raise NonFiniteError(
                f"non-finite queries in layer {layer_idx}; calibration text must run cleanly through the model",
                [{"layer": layer_idx}],
            )
        sq = q.detach().double().square().reshape(b, kv_heads, hq // kv_heads, t, d).sum(dim=(0, 2, 3))  # [H, D]
        n = b * (hq // kv_heads) * t
        old = self._queries.get(layer_idx)
        if old is not None and tuple(old[0].shape) != tuple(sq.shape):
            raise ShapeError(
                f"layer {layer_idx} queries were observed as kv_heads x head_dim {tuple(old[0].shape)}, now "
                f"{tuple(sq.shape)}; use one observer per model"
            )
        self._queries[layer_idx] = (sq, n) if old is None else (old[0] + sq, old[1] + n)

    def query_energy(self) -> torch.Tensor | None:
        """The queries' mean square per layer, kv head and channel, ``[layers, kv_heads, head_dim]`` float32
        (each kv head's query heads averaged); ``None`` when no query was observed.

        Raises:
            CalibrationError: some layers' queries were observed and others' not (their keys were).
        """
        if not self._queries:
            return None
        n = max(max(self._queries), max(self._keys, default=-1)) + 1
        missing = [i for i in range(n) if i not in self._queries]
        if missing:
            raise CalibrationError(
                f"queries of layers {missing} were never observed while others were; every attention layer must "
                "go through the observing attention function"
            )
        return torch.stack([(s / c).float() for s, c in (self._queries[i] for i in range(n))]).cpu()

    def observe(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add one batch of one layer.

        Args:
            layer_idx: the layer.
            key_states: ``[batch, kv_heads, tokens, head_dim]`` floating point, after RoPE.
            value_states: ``[batch, kv_heads, tokens, head_dim]`` floating point.

        Raises:
            ShapeError: wrong rank, non-float dtype, or a shape that differs from earlier calls of this layer.
            NonFiniteError: NaN or inf in the batch (layer and role named); nothing is recorded.
        """
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dim() != 4 or not t.is_floating_point():
                raise ShapeError(
                    f"{name} must be a float tensor [batch, kv_heads, tokens, head_dim], got {tuple(t.shape)} {t.dtype}"
                )
            if not torch.isfinite(t).all():
                bad = (~torch.isfinite(t)).nonzero()[0].tolist()
                raise NonFiniteError(
                    f"non-finite {name} in layer {layer_idx} at batch {bad[0]}, head {bad[1]}, position {bad[2]}, "
                    f"channel {bad[3]}; calibration text must run cleanly through the model",
                    [{"layer": layer_idx, "head": bad[1], "position": bad[2], "channel": bad[3]}],
                )
        for store, t in ((self._keys, key_states), (self._values, value_states)):
            acc = store.get(layer_idx)
            if acc is None:
                acc = store[layer_idx] = _LayerAccumulator(t.shape[1], t.shape[3], bool(self.percentiles), t.device)
            elif tuple(acc.absmax.shape) != (t.shape[1], t.shape[3]):
                raise ShapeError(
                    f"layer {layer_idx} was observed with kv_heads x head_dim {tuple(acc.absmax.shape)}, "
                    f"now {(t.shape[1], t.shape[3])}; use one observer per model"
                )
            acc.add(t)

    @property
    def num_layers(self) -> int:
        return len(self._keys)

    def _finalize(self, store: dict[int, _LayerAccumulator]) -> RoleStats:
        if not store:
            raise CalibrationError("nothing was observed; run calibration text through the model first")
        n = max(store) + 1
        missing = [i for i in range(n) if i not in store]
        if missing:
            raise CalibrationError(f"layers {missing} were never observed; every attention layer needs statistics")
        shapes = {tuple(store[i].absmax.shape) for i in range(n)}
        if len(shapes) != 1:
            raise CalibrationError(f"layers differ in kv_heads x head_dim {sorted(shapes)}; not supported yet")
        accs = [store[i] for i in range(n)]
        tokens = torch.tensor([a.tokens for a in accs], dtype=torch.int64)
        rms = torch.stack([(a.sumsq / a.tokens).sqrt().float() for a in accs])
        edges = bin_upper_edges()
        pct = {p: torch.stack([a.percentile(p, edges) for a in accs]).cpu() for p in self.percentiles}
        return RoleStats(
            absmax=torch.stack([a.absmax for a in accs]).cpu(),
            min=torch.stack([a.min for a in accs]).cpu(),
            max=torch.stack([a.max for a in accs]).cpu(),
            rms=rms.cpu(),
            pair_absmax=torch.stack([a.pair for a in accs]).cpu(),
            tokens=tokens,
            percentiles=pct,
        )

    def stats(self) -> tuple[RoleStats, RoleStats]:
        """``(keys, values)`` statistics of everything observed so far."""
        return self._finalize(self._keys), self._finalize(self._values)


def observing_cache(observer: KVObserver, config: object = None) -> object:
    """A transformers ``DynamicCache`` whose ``update`` first hands keys (after RoPE) and values to ``observer``.

    Pass it as ``model(input_ids, cache=..., use_cache=True)`` (``past_key_values=...`` before transformers 5.24;
    :func:`kvpack.integrations.transformers.cache_kwarg` names the keyword). Imports transformers when called.
    """
    from transformers import DynamicCache

    class _ObservingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            observer.observe(layer_idx, key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _ObservingCache(config=config)


def observing_attention(observer: KVObserver, model: Any) -> Callable[[], None]:
    """Route ``model``'s attention through a function that hands each layer's queries to ``observer`` and then
    runs SDPA (the forward pass is unchanged). Returns the function that restores the previous implementation.

    Imports transformers when called. A model whose attention layers do not call the attention interface is
    left as it is: no query is observed, and :meth:`KVObserver.query_energy` is ``None``.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def observe(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is not None:  # a layer that does not say which it is: its queries stay unobserved
            observer.observe_queries(layer, query, key.shape[1])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_OBSERVE, observe)
    AttentionMaskInterface.register(_OBSERVE, sdpa_mask)
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    model.set_attn_implementation(_OBSERVE)
    return lambda: model.set_attn_implementation(previous)


_OBSERVE = "kvpack_observe"
