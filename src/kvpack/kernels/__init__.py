"""Attention kernels over the paged cache: stateless functions of tensors.

Backends: ``reference`` (torch oracle, the slow last resort), ``cpu`` (fused and compiled, needs numba),
``triton`` (GPU; runs under the Triton interpreter in tests). Each backend module exposes
``reasons_unsupported(q, kv, window) -> list[str]`` and ``decode_attention(q, kv, sm_scale, window, out)``.
A backend that applies outlier key channels (``kv.k_outlier``) says so with ``SUPPORTS_OUTLIERS = True``;
one that does not is never handed such a cache (the dispatcher adds :data:`OUTLIER_REASON`); likewise
``SUPPORTS_SINK = True`` for full-precision sink positions (``kv.sink_k``, :data:`SINK_REASON`).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import torch

from kvpack.errors import UnsupportedError
from kvpack.kernels.views import PagedKV
from kvpack.rotation import rotate

__all__ = [
    "BACKENDS",
    "OUTLIER_REASON",
    "SINK_REASON",
    "PagedKV",
    "backend_reasons",
    "choose_backend",
    "decode_attention",
    "run_backend",
]

BACKENDS = {
    "reference": "kvpack.kernels.reference",
    "cpu": "kvpack.kernels.cpu",
    "triton": "kvpack.kernels.triton_decode",
}

OUTLIER_REASON = "outlier key channels (k_outlier) are not supported by this backend"
SINK_REASON = "full-precision sink positions (sink_k) are not supported by this backend"

_warned: set[tuple[str, str]] = set()


def _module(name: str):
    return importlib.import_module(BACKENDS[name])


def backend_reasons(name: str, q: torch.Tensor, kv: PagedKV, window: int | None = None) -> list[str]:
    """Why backend ``name`` cannot run this case (empty list: it can)."""
    if name not in BACKENDS:
        return [f"unknown backend {name!r}; backends are {', '.join(BACKENDS)}"]
    try:
        mod = _module(name)
    except ImportError as e:
        extra = {"cpu": "cpu", "triton": "triton"}.get(name, "")
        return [f"backend {name!r} is not installed ({e}); pip install 'kvpack[{extra}]'"]
    reasons = list(mod.reasons_unsupported(q, kv, window))
    if kv.k_outlier is not None and not getattr(mod, "SUPPORTS_OUTLIERS", False):
        reasons.append(OUTLIER_REASON)
    if kv.sink_k is not None and not getattr(mod, "SUPPORTS_SINK", False):
        reasons.append(SINK_REASON)
    return reasons


def choose_backend(q: torch.Tensor, kv: PagedKV, window: int | None = None, backend: str = "auto") -> str:
    """Pick the backend for a case: the forced one, else Triton on CUDA and the CPU kernel on the CPU.

    A forced backend that cannot run raises :class:`UnsupportedError` with its reasons. In ``auto`` mode a
    preferred backend that cannot run falls back to the reference with a one-time warning naming why.
    """
    if backend != "auto":
        reasons = backend_reasons(backend, q, kv, window)
        if reasons:
            raise UnsupportedError(f"backend {backend!r} cannot run this case: " + "; ".join(reasons), reasons)
        return backend
    preferred = "triton" if q.is_cuda else "cpu"
    reasons = backend_reasons(preferred, q, kv, window)
    if not reasons:
        return preferred
    key = (preferred, "; ".join(reasons))
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"kvpack: the {preferred} kernel cannot run this case ({key[1]}); using the slow reference path",
            RuntimeWarning,
            stacklevel=3,
        )
    return "reference"


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence over its paged history.

    Args:
        q: ``[batch, Hq, D]``, float16/bfloat16/float32; ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's :class:`PagedKV` (the query's own token already appended).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: sliding window: attend only the last ``window`` positions (the query's included).
        backend: ``"auto"``, ``"reference"``, ``"cpu"`` or ``"triton"``.
        out: optional ``[batch, Hq, D]`` output buffer.

    Returns:
        ``[batch, Hq, D]`` in ``q.dtype``.
    """
    name = choose_backend(q, kv, window, backend)
    return run_backend(name, q, kv, sm_scale, window, out)


def run_backend(
    name: str,
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run backend ``name`` (no choice, no fallback). Keys stored rotated (``kv.key_rotation``) are read by
    the fused backends with the rotated query ``q @ R`` and a view without the rotation; the reference
    unrotates the keys itself."""
    mod = _module(name)
    if kv.key_rotation is not None and name != "reference":
        q = rotate(q, kv.key_rotation.to(q.device))
        kv = dataclasses.replace(kv, key_rotation=None)
    return mod.decode_attention(q, kv, sm_scale, window, out)
