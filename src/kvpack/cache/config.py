"""`CacheConfig`: what a :class:`~kvpack.cache.PagedKVCache` was built with, checked once and frozen.

The write path, the offload tier and the memory report read the cache's geometry, format and sealing
choices from here, so they take a config (and the state parts they touch) instead of the cache itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvpack.cache.calibrated import (
    channels_digest,
    energy_digest,
    resolve_calibration,
    resolve_outlier_channels,
    resolve_query_energy,
    scales_digest,
)
from kvpack.calibration.artifact import Artifact, CalibratedScales
from kvpack.errors import ConfigError, ShapeError
from kvpack.formats import KVFormat, parse_format
from kvpack.quant import tail_torch_dtype
from kvpack.rotation import key_rotation

__all__ = ["SEAL_BACKENDS", "TAIL_DTYPES", "CacheConfig"]

TAIL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEAL_BACKENDS = ("auto", "torch", "triton")


def _parse_window(window: int | Sequence[int | None] | None, num_layers: int) -> tuple[int | None, ...]:
    ws = [window] * num_layers if window is None or isinstance(window, int) else list(window)
    if len(ws) != num_layers:
        raise ConfigError(f"window needs one entry per layer ({num_layers}), got {len(ws)}")
    for w in ws:
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise ConfigError(f"a window must be a positive number of tokens or None, got {w!r}")
    return tuple(ws)


@dataclass(frozen=True, eq=False)
class CacheConfig:
    """The fixed facts of one cache (see :class:`~kvpack.cache.PagedKVCache` for the arguments).

    Attributes:
        format: the storage format.
        num_layers, kv_heads, head_dim: the cache geometry.
        tail_dtype: dtype of tails and sinks (float32, float16 or bfloat16).
        device: where pools, tails and sinks live (``cuda:N``, never bare ``cuda``).
        windows: the sliding window of each layer, or ``None`` (full attention).
        seal_backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        calibration: the checked static scales (on ``device``), or ``None``.
        outlier_channels: ``[L, H, k]`` int64 calibrated outlier key channels, or ``None``: chosen per block
            at seal time.
        query_energy: ``[L, H, D]`` float32, the queries' mean square per channel (a calibration artifact's), by
            which a query-ranked key spec (``o<k>q``) ranks each block's outlier channels; ``None`` otherwise.
        key_rotation: ``[D, D]`` float32 on ``device``: keys are stored as ``k @ R``; ``None`` without rotation.
        salt: names the storage in prefix keys (format, geometry, scale and channel digests), so blocks of
            other storage never match.
    """

    format: KVFormat
    num_layers: int
    kv_heads: int
    head_dim: int
    tail_dtype: torch.dtype
    device: torch.device
    windows: tuple[int | None, ...]
    seal_backend: str
    calibration: CalibratedScales | None
    outlier_channels: torch.Tensor | None
    query_energy: torch.Tensor | None
    key_rotation: torch.Tensor | None
    salt: str

    @classmethod
    def create(
        cls,
        fmt: KVFormat | str,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        tail_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        window: int | Sequence[int | None] | None = None,
        seal_backend: str = "auto",
        calibration: CalibratedScales | Artifact | None = None,
    ) -> CacheConfig:
        """Check the arguments (:class:`ConfigError`, :class:`CalibrationError`) and resolve the derived parts."""
        fmt = parse_format(fmt) if isinstance(fmt, str) else fmt
        if not isinstance(fmt, KVFormat):
            raise ConfigError(f"fmt must be a KVFormat or a format string, got {type(fmt).__name__}")
        for name, val in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, int) or val <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {val!r}")
        fmt.check(head_dim)
        if seal_backend not in SEAL_BACKENDS:
            raise ConfigError(f"seal_backend must be 'auto', 'torch' or 'triton', got {seal_backend!r}")
        tail_dtype = tail_torch_dtype(fmt, tail_dtype)  # a format's own tail= wins over the model's dtype
        if tail_dtype not in TAIL_DTYPES:
            raise ConfigError(f"tail_dtype must be torch.float32, float16 or bfloat16, got {tail_dtype}")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # tensors report cuda:N
            dev = torch.device("cuda", torch.cuda.current_device())
        geometry = (num_layers, kv_heads, head_dim, dev)
        scales = resolve_calibration(fmt, calibration, *geometry)
        channels = resolve_outlier_channels(fmt, calibration, *geometry)
        energy = resolve_query_energy(fmt, calibration, *geometry)
        windows = _parse_window(window, num_layers)
        salt = f"{fmt.spec_string()}|kv_heads={kv_heads}|head_dim={head_dim}"
        if scales is not None:  # blocks sealed with other scales hold other bytes: never share them
            salt += f"|scales={scales_digest(scales)}"
        if channels is not None:
            salt += f"|outliers={channels_digest(channels)}"
        if energy is not None:
            salt += f"|queries={energy_digest(energy)}"
        rotation = key_rotation(head_dim, dev) if fmt.key.rotate else None
        return cls(
            fmt,
            num_layers,
            kv_heads,
            head_dim,
            tail_dtype,
            dev,
            windows,
            seal_backend,
            scales,
            channels,
            energy,
            rotation,
            salt,
        )

    @property
    def block_size(self) -> int:
        return self.format.block_size

    @property
    def sink(self) -> int:
        """Positions at the start of each sequence kept in full precision (``format.sink``; 0 without)."""
        return self.format.sink

    @property
    def release_window(self) -> int | None:
        """The window after which a block has left *every* layer's window (``None`` unless every layer has one)."""
        return None if None in self.windows else max(self.windows)

    def check_layer(self, layer: int) -> int:
        """``layer`` as an int, or :class:`ShapeError` when it is not a layer of the cache."""
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ShapeError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")
        return int(layer)
