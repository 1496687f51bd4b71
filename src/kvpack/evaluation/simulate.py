"""The ``simulate`` engine: a transformers cache whose contents equal kvpack's, computed with plain tensors.

Tokens land in a full-precision tail; when ``block_size`` tokens complete a block, the block is replaced by
``quant.dequantize(quant.quantize(block))``: the very values kvpack's paged cache reconstructs from that
block's payload and scales. Attention then runs through the model's own attention function (sdpa), so the
numbers are those of kvpack's cache with a different (unfused) kernel. A format with ``sink = S`` keeps
positions ``< S`` as they entered (what kvpack's cache reads from its sink buffer) after the round trip. A format
that names its tail dtype (``tail=fp16``) has every token rounded to it as it enters, as kvpack's tail does (for
rotated keys kvpack rounds the rotated key: the two differ by a rounding of a rounding).

Why keep it next to the real engine: it takes a different format per layer (one layer quantized at a time,
for the per-layer sensitivity sweep), any transformers attention implementation, and any model the real
integration does not support yet. It is labelled ``simulate`` wherever its numbers are reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvpack.cache.write import seal_outliers
from kvpack.calibration.static import LayerScales, seal_with_static
from kvpack.errors import ConfigError
from kvpack.formats import KVFormat
from kvpack.outliers import apply_kept
from kvpack.quant import dequantize, quantize, tail_torch_dtype
from kvpack.rotation import key_rotation, rotate, unrotate

if TYPE_CHECKING:
    from kvpack.calibration.artifact import CalibratedScales

__all__ = ["SimulatedCache", "roundtrip_blocks"]


def roundtrip_blocks(
    x: torch.Tensor,
    spec,
    block_size: int,
    scales: LayerScales | None = None,
    energy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize and dequantize whole blocks of ``x``.

    Args:
        x: ``[batch, kv_heads, n * block_size, head_dim]``, float.
        spec: the :class:`kvpack.formats.QuantSpec` of the blocks.
        block_size: tokens per block.
        scales: the layer's calibrated scales when ``spec`` is static (required then).
        energy: ``[kv_heads, head_dim]`` float32, the layer's query statistics when ``spec`` ranks its outlier
            channels by the queries (required then).

    Returns:
        The reconstructed ``[batch, kv_heads, n * block_size, head_dim]`` in ``x.dtype``.
    """
    b, h, t, d = x.shape
    n = t // block_size
    blocks = x.reshape(b, h, n, block_size, d).permute(0, 2, 1, 3, 4)  # [batch, n, H, B, D]
    flat = blocks.reshape(b * n, h, block_size, d)
    r = key_rotation(d, x.device) if spec.rotate else None
    if r is not None:  # the cache stores k @ R; the model reads the unrotated reconstruction
        flat = rotate(flat.float(), r)
    if spec.static and scales is None:
        raise ConfigError(f"{spec} takes calibrated scales and none were given to the simulate engine")
    if spec.outliers:  # the cache's own seal; channels chosen per block, as without a calibration artifact
        qt, _, (residual, idx) = seal_outliers(flat, spec, scales, None, energy)
        rec = apply_kept(dequantize(qt, torch.float32), residual, idx, spec, qt.scale)
    elif spec.static:
        rec = dequantize(seal_with_static(flat, spec, scales)[0], torch.float32)
    else:
        rec = dequantize(quantize(flat, spec), torch.float32)
    if r is not None:
        rec = unrotate(rec, r)
    rec = rec.reshape(b, n, h, block_size, d)
    return rec.permute(0, 2, 1, 3, 4).reshape(b, h, t, d).to(x.dtype)


def sink_keys(k: torch.Tensor, spec) -> torch.Tensor:
    """Keys ``[..., S, D]`` as kvpack's sink buffer returns them: as they are, or for a rotating key spec
    stored as ``k @ R`` in ``k.dtype`` and read back unrotated (float32 math, cast to ``k.dtype``)."""
    if not spec.rotate:
        return k
    r = key_rotation(k.shape[-1], k.device)
    return unrotate(rotate(k.float(), r).to(k.dtype).float(), r).to(k.dtype)


def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class SimulatedLayer(DynamicLayer):
        """A DynamicLayer that seals every completed block with the format's quantize -> dequantize."""

        def __init__(
            self,
            fmt: KVFormat | None,
            zero_keys: bool = False,
            key_scales: LayerScales | None = None,
            value_scales: LayerScales | None = None,
            key_energy: torch.Tensor | None = None,
        ):
            super().__init__()
            self.fmt = fmt
            self.zero_keys = zero_keys
            self.key_scales = key_scales
            self.value_scales = value_scales
            self.key_energy = key_energy  # [kv_heads, head_dim]: o<k>q ranks outlier channels by it
            self.sealed = 0  # tokens already replaced by their reconstruction

        def update(self, key_states, value_states, *args, **kwargs):
            if self.fmt is not None and self.fmt.tail is not None:  # the format's own tail dtype: rounded on entry
                tail = tail_torch_dtype(self.fmt, key_states.dtype)
                key_states = key_states.to(tail).to(key_states.dtype)
                value_states = value_states.to(tail).to(value_states.dtype)
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if self.fmt is None:
                return keys, values
            b = self.fmt.block_size
            full = keys.shape[-2] // b * b
            if full > self.sealed:
                s = slice(self.sealed, full)
                k_rec = self.seal_keys(keys, s)
                if self.zero_keys:  # the planted broken format of the tests
                    k_rec = torch.zeros_like(k_rec)
                v_rec = roundtrip_blocks(values[..., s, :], self.fmt.value, b, self.value_scales)
                n_sink = min(self.fmt.sink, full) - self.sealed
                if n_sink > 0:  # the sink positions: read back exactly as they entered the cache
                    k_rec[..., :n_sink, :] = sink_keys(keys[..., self.sealed : self.sealed + n_sink, :], self.fmt.key)
                    v_rec[..., :n_sink, :] = values[..., self.sealed : self.sealed + n_sink, :]
                self.keys = torch.cat([keys[..., : self.sealed, :], k_rec, keys[..., full:, :]], dim=-2)
                self.values = torch.cat([values[..., : self.sealed, :], v_rec, values[..., full:, :]], dim=-2)
                self.sealed = full
            return self.keys, self.values

        def seal_keys(self, keys: torch.Tensor, s: slice) -> torch.Tensor:
            """The reconstruction of the whole blocks ``keys[..., s, :]`` (``[batch, kv_heads, T, head_dim]``) as the
            format's sealed payload gives them back; a subclass may seal them another way."""
            return roundtrip_blocks(
                keys[..., s, :], self.fmt.key, self.fmt.block_size, self.key_scales, self.key_energy
            )

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            if self.fmt is not None:
                n = self.get_seq_length()
                # kept tokens of a cut block are back in the tail with their reconstructed values (as in kvpack)
                self.sealed = min(self.sealed, n // self.fmt.block_size * self.fmt.block_size)

    return SimulatedLayer


def SimulatedCache(
    formats: Sequence[KVFormat | None],
    zero_keys: bool = False,
    scales: Sequence[CalibratedScales | None] | None = None,
    query_energy: torch.Tensor | None = None,
):
    """A transformers ``Cache`` with one simulated layer per entry of ``formats`` (``None``: full precision).

    Args:
        formats: one format per model layer.
        zero_keys: test hook: sealed keys become zeros (a planted broken format that must be caught).
        scales: one entry per layer: the calibrated scales of a static format (layer ``i`` takes its own
            layer's scales), ``None`` for others.
        query_energy: ``[layers, kv_heads, head_dim]`` float32, a calibration artifact's query statistics: layers
            whose key spec ranks outlier channels by the queries (``o<k>q``) need it.
    """
    from transformers.cache_utils import Cache

    layer = _layer_class()
    scales = list(scales) if scales is not None else [None] * len(formats)
    if len(scales) != len(formats):
        raise ConfigError(f"{len(scales)} scale entries for {len(formats)} layers; give one per layer (or None)")
    layers = []
    for i, (f, sc) in enumerate(zip(formats, scales, strict=True)):
        ks = sc.key.layer(i) if sc is not None and sc.key is not None else None
        vs = sc.value.layer(i) if sc is not None and sc.value is not None else None
        ranked = f is not None and f.query_ranked
        if ranked and query_energy is None:
            raise ConfigError(
                f"layer {i}'s format {f.name!r} ranks outlier key channels by the queries; give the calibration "
                "artifact's query statistics (kvpack calibrate --out DIR, then --calibration DIR)"
            )
        layers.append(layer(f, zero_keys, ks, vs, query_energy[i] if ranked else None))
    return Cache(layers=layers)
