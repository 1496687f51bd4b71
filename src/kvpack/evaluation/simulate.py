"""The ``simulate`` engine: a transformers cache whose contents equal kvpack's, computed with plain tensors.

Tokens land in a full-precision tail; when ``block_size`` tokens complete a block, the block is replaced by
``quant.dequantize(quant.quantize(block))``: the very values kvpack's paged cache reconstructs from that
block's payload and scales. Attention then runs through the model's own attention function (sdpa), so the
numbers are those of kvpack's cache with a different (unfused) kernel.

Why keep it next to the real engine: it takes a different format per layer (one layer quantized at a time,
for the per-layer sensitivity sweep), any transformers attention implementation, and any model the real
integration does not support yet. It is labelled ``simulate`` wherever its numbers are reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpack.formats import KVFormat
from kvpack.quant import dequantize, quantize

__all__ = ["SimulatedCache", "roundtrip_blocks"]


def roundtrip_blocks(x: torch.Tensor, spec, block_size: int) -> torch.Tensor:
    """Quantize and dequantize whole blocks of ``x``.

    Args:
        x: ``[batch, kv_heads, n * block_size, head_dim]``, float.
        spec: the :class:`kvpack.formats.QuantSpec` of the blocks.
        block_size: tokens per block.

    Returns:
        The reconstructed ``[batch, kv_heads, n * block_size, head_dim]`` in ``x.dtype``.
    """
    b, h, t, d = x.shape
    n = t // block_size
    blocks = x.reshape(b, h, n, block_size, d).permute(0, 2, 1, 3, 4)  # [batch, n, H, B, D]
    rec = dequantize(quantize(blocks, spec), torch.float32)
    return rec.permute(0, 2, 1, 3, 4).reshape(b, h, t, d).to(x.dtype)


def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class SimulatedLayer(DynamicLayer):
        """A DynamicLayer that seals every completed block with the format's quantize -> dequantize."""

        def __init__(self, fmt: KVFormat | None, zero_keys: bool = False):
            super().__init__()
            self.fmt = fmt
            self.zero_keys = zero_keys
            self.sealed = 0  # tokens already replaced by their reconstruction

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if self.fmt is None:
                return keys, values
            b = self.fmt.block_size
            full = keys.shape[-2] // b * b
            if full > self.sealed:
                s = slice(self.sealed, full)
                k_rec = roundtrip_blocks(keys[..., s, :], self.fmt.key, b)
                if self.zero_keys:  # the planted broken format of the tests
                    k_rec = torch.zeros_like(k_rec)
                v_rec = roundtrip_blocks(values[..., s, :], self.fmt.value, b)
                self.keys = torch.cat([keys[..., : self.sealed, :], k_rec, keys[..., full:, :]], dim=-2)
                self.values = torch.cat([values[..., : self.sealed, :], v_rec, values[..., full:, :]], dim=-2)
                self.sealed = full
            return self.keys, self.values

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            if self.fmt is not None:
                n = self.get_seq_length()
                # kept tokens of a cut block are back in the tail with their reconstructed values (as in kvpack)
                self.sealed = min(self.sealed, n // self.fmt.block_size * self.fmt.block_size)

    return SimulatedLayer


def SimulatedCache(formats: Sequence[KVFormat | None], zero_keys: bool = False):
    """A transformers ``Cache`` with one simulated layer per entry of ``formats`` (``None``: full precision).

    Args:
        formats: one format per model layer.
        zero_keys: test hook: sealed keys become zeros (a planted broken format that must be caught).
    """
    from transformers.cache_utils import Cache

    layer = _layer_class()
    return Cache(layers=[layer(f, zero_keys) for f in formats])
