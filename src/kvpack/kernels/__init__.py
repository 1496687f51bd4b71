"""Attention kernels over the paged cache: stateless functions of tensors.

Backends: ``reference`` (torch oracle, the slow last resort), ``cpu`` (fused and compiled, needs numba),
``triton`` (GPU; runs under the Triton interpreter in tests). Each backend module exposes
``reasons_unsupported(q, kv, window) -> list[str]`` and ``decode_attention(q, kv, sm_scale, window, out)``.
A backend that applies outlier key channels (``kv.k_outlier``) says so with ``SUPPORTS_OUTLIERS = True``;
one that does not is never handed such a cache (the dispatcher adds :data:`OUTLIER_REASON`); likewise
``SUPPORTS_SINK = True`` for full-precision sink positions (``kv.sink_k``, :data:`SINK_REASON`).

Many queries per sequence (:func:`chunk_attention`: prefill chunks, prefix-cache hits, draft verification) go
to the backends of :data:`CHUNK_BACKENDS`, chosen the same way; each such module exposes
``reasons_unsupported(q, kv, window)`` (``q`` ``[batch, T, Hq, D]``), ``chunk_attention(q, kv, sm_scale,
window, out)`` and the same two flags.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import torch

from kvpack.errors import UnsupportedError
from kvpack.formats import DType
from kvpack.kernels.views import PagedKV
from kvpack.rotation import rotate

__all__ = [
    "BACKENDS",
    "CHUNK_BACKENDS",
    "OUTLIER_REASON",
    "SINK_REASON",
    "PagedKV",
    "backend_reasons",
    "choose_backend",
    "chunk_attention",
    "decode_attention",
    "fused_chunk_backend",
    "run_backend",
    "run_chunk_backend",
]

BACKENDS = {
    "reference": "kvpack.kernels.reference",
    "cpu": "kvpack.kernels.cpu",
    "triton": "kvpack.kernels.triton_decode",
}

CHUNK_BACKENDS = {
    "reference": "kvpack.kernels.reference",
    "cpu": "kvpack.kernels.cpu_chunk",
    "triton": "kvpack.kernels.triton_chunk",
}

OUTLIER_REASON = "outlier key channels (k_outlier) are not supported by this backend"
SINK_REASON = "full-precision sink positions (sink_k) are not supported by this backend"

_warned: set[tuple[str, str]] = set()


def _module(name: str, backends: dict[str, str] = BACKENDS):
    return importlib.import_module(backends[name])


def backend_reasons(
    name: str, q: torch.Tensor, kv: PagedKV, window: int | None = None, backends: dict[str, str] = BACKENDS
) -> list[str]:
    """Why backend ``name`` of ``backends`` (:data:`BACKENDS` or :data:`CHUNK_BACKENDS`) cannot run this case
    (empty list: it can)."""
    if name not in backends:
        return [f"unknown backend {name!r}; backends are {', '.join(backends)}"]
    try:
        mod = _module(name, backends)
    except ImportError as e:
        extra = {"cpu": "cpu", "triton": "triton"}.get(name, "")
        return [f"backend {name!r} is not installed ({e}); pip install 'kvpack[{extra}]'"]
    reasons = list(mod.reasons_unsupported(q, kv, window))
    if kv.k_outlier is not None and not getattr(mod, "SUPPORTS_OUTLIERS", False):
        reasons.append(OUTLIER_REASON)
    if kv.sink_k is not None and not getattr(mod, "SUPPORTS_SINK", False):
        reasons.append(SINK_REASON)
    return reasons


def choose_backend(
    q: torch.Tensor,
    kv: PagedKV,
    window: int | None = None,
    backend: str = "auto",
    backends: dict[str, str] = BACKENDS,
) -> str:
    """Pick the backend of ``backends`` for a case: the forced one, else Triton on CUDA and the CPU kernel on the CPU.

    A forced backend that cannot run raises :class:`UnsupportedError` with its reasons. In ``auto`` mode a
    preferred backend that cannot run falls back to the reference with a one-time warning naming why.
    """
    if backend != "auto":
        reasons = backend_reasons(backend, q, kv, window, backends)
        if reasons:
            raise UnsupportedError(f"backend {backend!r} cannot run this case: " + "; ".join(reasons), reasons)
        return backend
    preferred = "triton" if q.is_cuda else "cpu"
    reasons = backend_reasons(preferred, q, kv, window, backends)
    if not reasons:
        return preferred
    key = (backends[preferred], "; ".join(reasons))
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


def chunk_attention(
    q: torch.Tensor,
    kv: PagedKV,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the last ``T`` positions of each sequence over its paged history (a prefill chunk, the
    question after a cached document, draft tokens to verify): the semantics of
    :func:`kvpack.kernels.reference.paged_attention_reference`, on the backend :func:`choose_backend` picks
    from :data:`CHUNK_BACKENDS`.

    Args:
        q: ``[batch, T, Hq, D]``, float16/bfloat16/float32; ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's :class:`PagedKV`, the chunk's own tokens already appended: query ``i`` sits at
            position ``seq_len - T + i`` and attends causally; positions before ``kv.start_pos`` are masked; a
            row with nothing to attend returns zeros.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: a query at position ``p`` attends only positions ``> p - window``.
        backend: ``"auto"``, ``"reference"``, ``"cpu"`` or ``"triton"``.
        out: optional ``[batch, T, Hq, D]`` output buffer, dtype of ``q``.

    Returns:
        ``[batch, T, Hq, D]`` in ``q.dtype``.
    """
    name = choose_backend(q, kv, window, backend, CHUNK_BACKENDS)
    return run_chunk_backend(name, q, kv, sm_scale, window, out)


def run_chunk_backend(
    name: str,
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run chunk backend ``name`` (no choice, no fallback); rotated keys as :func:`run_backend` handles them."""
    mod = _module(name, CHUNK_BACKENDS)
    if kv.key_rotation is not None and name != "reference":
        q = rotate(q, kv.key_rotation.to(q.device))
        kv = dataclasses.replace(kv, key_rotation=None)
    return mod.chunk_attention(q, kv, sm_scale, window, out)


def fused_chunk_backend(q: torch.Tensor, kv: PagedKV, window: int | None = None, backend: str = "auto") -> str | None:
    """For callers with a fallback of their own (the transformers and vLLM chunk paths): the fused chunk backend
    to run for a cache whose kernel choice is ``backend``, or None. ``"reference"`` gives None; ``"auto"`` the
    dispatcher's choice (None where it falls back, after its one-time warning); a forced backend itself if it
    can run this case, else None (a backend with a decode kernel only is no error there). A cache that stores
    values in float32 (a lossless format) gets None too: the fused chunk kernels round values to bfloat16."""
    if backend == "reference" or kv.format.value.dtype is DType.FP32:
        return None
    if backend != "auto":
        return None if backend_reasons(backend, q, kv, window, CHUNK_BACKENDS) else backend
    name = choose_backend(q, kv, window, "auto", CHUNK_BACKENDS)
    return None if name == "reference" else name
