"""Rotated keys (``QuantSpec.rotate``): a fixed orthogonal matrix that spreads outlier channels.

A few key channels per head are much larger than the rest for every token. Multiplying each key by an
orthogonal ``R`` mixes every channel into every other: the rotated key has the same norm and the same dot
products (``q . k = (q @ R) . (k @ R)``) but no channel stands out, so one scale per head fits all of them
and an fp8 element's relative error no longer lands mostly on the few channels that carry each score.

``R = H * signs``: for a power-of-two ``D`` the Sylvester Hadamard matrix of order ``D`` scaled by
``1/sqrt(D)``; for any other ``D`` a block-diagonal of such matrices over ``D``'s binary digits (96 = 64 + 32,
80 = 64 + 16), so each channel is mixed with at least 16 others; then the columns' signs flipped by a fixed
pseudo-random pattern (so structured inputs do not line up with Hadamard rows). It is a pure function of
``head_dim``: the same on every machine and in every process, nothing stored.

Where it applies: the paged cache stores ``k @ R`` (tails and sealed blocks alike, so the tail is sealed as
is and a crop returns rotated values to it); :func:`kvpack.kernels.reference.dense_history` returns natural
keys (``@ R.T``); fused kernels read the stored keys with ``q @ R`` (the dispatcher rotates the query).
"""

from __future__ import annotations

import functools

import torch

from kvpack.errors import ShapeError

__all__ = ["key_rotation", "rotate", "unrotate"]


def _signs(n: int) -> list[float]:
    """A fixed +-1 pattern of length ``n`` (xorshift32 from a constant seed: identical everywhere)."""
    x, out = 0x9E3779B9, []
    for _ in range(n):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        out.append(1.0 if x & 1 else -1.0)
    return out


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@functools.lru_cache(maxsize=16)
def _rotation_cpu(head_dim: int) -> torch.Tensor:
    if head_dim < 1:
        raise ShapeError(f"key rotation needs a positive head_dim, got {head_dim}")
    sizes = [1 << b for b in reversed(range(head_dim.bit_length())) if head_dim >> b & 1]  # 96 -> [64, 32]
    r = torch.block_diag(*(_hadamard(n) for n in sizes))
    return (r * torch.tensor(_signs(head_dim), dtype=torch.float64)).float()


def key_rotation(head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The rotation of keys of ``head_dim`` channels: ``[head_dim, head_dim]`` float32, orthogonal.

    Raises:
        ShapeError: ``head_dim`` is not positive.
    """
    r = _rotation_cpu(int(head_dim))
    return r if device is None or torch.device(device).type == "cpu" else r.to(device)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r`` computed in float32, returned in ``x.dtype`` (``x``: ``[..., head_dim]``)."""
    return (x.float() @ r).to(x.dtype)


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r.T`` computed in float32, returned in ``x.dtype``: the inverse of :func:`rotate`."""
    return (x.float() @ r.T).to(x.dtype)
