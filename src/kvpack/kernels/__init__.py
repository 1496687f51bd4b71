"""Attention kernels over the paged cache: stateless functions of tensors.

Backends: ``reference`` (torch oracle, the slow last resort), ``cpu`` (fused and compiled, needs numba),
``triton`` (GPU; runs under the Triton interpreter in tests), each a :class:`~kvpack.kernels.backend.DecodeBackend`
in :data:`BACKENDS`: a name, :class:`~kvpack.kernels.backend.Capabilities` (outlier key channels, sink rows, a
multi-query entry, rotated keys), ``reasons_unsupported`` and the entries ``decode_attention`` (one query per
sequence) and ``chunk_attention`` (many: prefill chunks, prefix-cache hits, draft verification). The dispatcher
refuses a case a backend's capabilities exclude (:data:`OUTLIER_REASON`, :data:`SINK_REASON`,
:data:`CHUNK_REASON`) and adds the backend's own reasons; what any backend needs of a view is checked once by
:meth:`PagedKV.check <kvpack.kernels.views.PagedKV.check>`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref

import torch

from kvpack.errors import ShapeError, UnsupportedError
from kvpack.formats import DType
from kvpack.kernels.backend import (
    CHUNK_REASON,
    OUTLIER_REASON,
    SINK_REASON,
    Capabilities,
    DecodeBackend,
    ModuleBackend,
    capability_reasons,
)
from kvpack.kernels.views import PagedKV
from kvpack.rotation import rotate

__all__ = [
    "BACKENDS",
    "CHUNK_REASON",
    "OUTLIER_REASON",
    "SINK_REASON",
    "Capabilities",
    "DecodeBackend",
    "ModuleBackend",
    "PagedKV",
    "backend_reasons",
    "choose_backend",
    "chunk_attention",
    "decode_attention",
    "decode_positions",
    "fused_chunk_backend",
    "run_backend",
    "run_chunk_backend",
]

_FUSED = Capabilities(outliers=True, sink=True, chunk=True)
BACKENDS: dict[str, DecodeBackend] = {
    "reference": ModuleBackend(
        "reference",
        Capabilities(outliers=True, sink=True, chunk=True, rotated_keys=True),
        "kvpack.kernels.reference",
        "kvpack.kernels.reference",
    ),
    # outlier residuals are added to the scores in the kernel; sink rows attended in its merge
    "cpu": ModuleBackend("cpu", _FUSED, "kvpack.kernels.cpu_decode", "kvpack.kernels.cpu_chunk", extra="cpu"),
    # outlier residuals and sink rows (replacing their sealed rows) inside the kernels
    "triton": ModuleBackend(
        "triton", _FUSED, "kvpack.kernels.triton_decode", "kvpack.kernels.triton_chunk", extra="triton"
    ),
}

_warned: set[tuple[str, bool, str]] = set()


def _unknown(name: str) -> str:
    return f"unknown backend {name!r}; backends are {', '.join(BACKENDS)}"


def _backend(name: str) -> DecodeBackend:
    """``BACKENDS[name]``; :class:`UnsupportedError` naming the registered backends for another name."""
    if name not in BACKENDS:
        raise UnsupportedError(_unknown(name), [_unknown(name)])
    return BACKENDS[name]


def backend_reasons(
    name: str, q: torch.Tensor, kv: PagedKV, window: int | None = None, *, chunk: bool = False
) -> list[str]:
    """Why backend ``name`` of :data:`BACKENDS` cannot run this case through its decode entry (``chunk``: its
    multi-query entry), empty when it can: what its capabilities exclude, and its own reasons."""
    if name not in BACKENDS:
        return [_unknown(name)]
    backend = BACKENDS[name]
    missing = capability_reasons(backend.capabilities, kv, chunk)
    if chunk and not backend.capabilities.chunk:
        return missing  # no entry to ask
    return backend.reasons_unsupported(q, kv, window, chunk=chunk) + missing


def choose_backend(
    q: torch.Tensor,
    kv: PagedKV,
    window: int | None = None,
    backend: str = "auto",
    *,
    chunk: bool = False,
) -> str:
    """Pick the backend of :data:`BACKENDS` for a case (``chunk``: for its multi-query entry): the forced one, else
    Triton on CUDA and the CPU kernel on the CPU.

    A forced backend that cannot run raises :class:`UnsupportedError` with its reasons. In ``auto`` mode a
    preferred backend that cannot run falls back to the reference with a one-time warning naming why.
    """
    if backend != "auto":
        reasons = backend_reasons(backend, q, kv, window, chunk=chunk)
        if reasons:
            raise UnsupportedError(f"backend {backend!r} cannot run this case: " + "; ".join(reasons), reasons)
        return backend
    preferred = "triton" if q.is_cuda else "cpu"
    reasons = backend_reasons(preferred, q, kv, window, chunk=chunk)
    if not reasons:
        return preferred
    key = (preferred, chunk, "; ".join(reasons))
    if key not in _warned:
        _warned.add(key)
        what = "chunk kernel" if chunk else "kernel"
        warnings.warn(
            f"kvpack: the {preferred} {what} cannot run this case ({key[2]}); using the slow reference path",
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
    tail_cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run backend ``name``'s decode entry (no choice, no fallback). Keys stored rotated (``kv.key_rotation``)
    are read by a backend without :attr:`Capabilities.rotated_keys` with the rotated query ``q @ R`` and a view
    without the rotation; the reference unrotates the keys itself. ``tail_cut`` (``[batch, Hq // H]`` int32:
    several positions of a sequence as query heads, see :func:`kvpack.kernels.cpu_decode.decode_attention`) only
    with the ``cpu`` backend.

    Raises:
        UnsupportedError: ``tail_cut`` with another backend.
    """
    backend = _backend(name)
    q, kv = _unrotated(backend, q, kv)
    if tail_cut is None:
        return backend.decode_attention(q, kv, sm_scale, window, out)
    if name != "cpu":
        raise UnsupportedError(f"tail_cut is a CPU kernel option; backend {name!r} takes one query position per call")
    from kvpack.kernels import cpu_decode

    return cpu_decode.decode_attention(q, kv, sm_scale, window, out, tail_cut=tail_cut)


def decode_positions(
    q: torch.Tensor, kv: PagedKV, cut: torch.Tensor, sm_scale: float | None = None
) -> torch.Tensor:  # fmt: skip
    """Several positions of each sequence in one call of the CPU decode kernel (a token and its drafts, the
    candidates of assisted generation): position ``t`` of row ``b`` attends the history up to ``cut[b, t]`` places
    before the row's last, inside the tail (``tail_cut`` of :func:`kvpack.kernels.cpu_decode.decode_attention`),
    the positions going in as more query heads of each kv head's group, so the sealed blocks are read once.

    Args:
        q: ``[batch, T, Hq, D]`` float32/float16/bfloat16, ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's paged cache (every position's token already appended).
        cut: ``[batch, T]`` int32, ``0 <= cut <= min(seq_len % block_size, seq_len - 1)``.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``[batch, T, Hq, D]`` in ``q.dtype``.

    Raises:
        ShapeError: ``q`` or ``cut`` of the wrong shape, a cut outside the tail.
    """
    h = kv.kv_heads
    if q.dim() != 4 or q.shape[2] % h or tuple(cut.shape) != tuple(q.shape[:2]):
        raise ShapeError(
            f"decode_positions takes q [batch, T, Hq (a multiple of {h}), D] and cut [batch, T]; got q "
            f"{list(q.shape)} and cut {list(cut.shape)}"
        )
    b, t, hq, d = q.shape
    g = hq // h
    heads = q.reshape(b, t, h, g, d).transpose(1, 2).reshape(b, h * t * g, d)  # kv head h's group: [T, G] heads
    res = run_backend("cpu", heads, kv, sm_scale, None, tail_cut=cut.repeat_interleave(g, dim=1))
    return res.view(b, h, t, g, d).transpose(1, 2).reshape(b, t, hq, d)


def _unrotated(backend: DecodeBackend, q: torch.Tensor, kv: PagedKV) -> tuple[torch.Tensor, PagedKV]:
    """``(q @ R, kv without R)`` for a view of rotated keys and a backend that does not read them itself. The view
    without the rotation is the same object for as long as ``kv`` lives (:data:`_PLAIN`), so a backend that keeps
    per-view state (the CPU kernel's checks and numpy views) keeps it for rotated views too."""
    if kv.key_rotation is None or backend.capabilities.rotated_keys:
        return q, kv
    hit = _PLAIN.get(id(kv))
    if hit is None or hit[0]() is not kv:
        hit = (weakref.ref(kv, functools.partial(_forget_plain, id(kv))), dataclasses.replace(kv, key_rotation=None))
        _PLAIN[id(kv)] = hit
    return rotate(q, kv.key_rotation.to(q.device)), hit[1]


# id of a view of rotated keys -> (a weak reference to it, the same view without the rotation)
_PLAIN: dict[int, tuple[weakref.ref, PagedKV]] = {}


def _forget_plain(key: int, ref: weakref.ref) -> None:
    hit = _PLAIN.get(key)
    if hit is not None and hit[0] is ref:
        del _PLAIN[key]


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
    for the multi-query entry.

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
    name = choose_backend(q, kv, window, backend, chunk=True)
    return run_chunk_backend(name, q, kv, sm_scale, window, out)


def run_chunk_backend(
    name: str,
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run backend ``name``'s multi-query entry (no choice, no fallback); rotated keys as :func:`run_backend`
    handles them."""
    backend = _backend(name)
    if not backend.capabilities.chunk:
        raise UnsupportedError(f"backend {name!r} cannot run this case: {CHUNK_REASON}", [CHUNK_REASON])
    q, kv = _unrotated(backend, q, kv)
    return backend.chunk_attention(q, kv, sm_scale, window, out)


def fused_chunk_backend(q: torch.Tensor, kv: PagedKV, window: int | None = None, backend: str = "auto") -> str | None:
    """For callers with a fallback of their own (the transformers and vLLM chunk paths): the fused chunk backend
    to run for a cache whose kernel choice is ``backend``, or None. ``"reference"`` gives None; ``"auto"`` the
    dispatcher's choice (None where it falls back, after its one-time warning); a forced backend itself if it
    can run this case, else None (a backend with a decode kernel only is no error there). A cache that stores
    values in float32 (a lossless format) gets None too: the fused chunk kernels round values to bfloat16."""
    if backend == "reference" or kv.format.value.dtype is DType.FP32:
        return None
    if backend != "auto":
        return None if backend_reasons(backend, q, kv, window, chunk=True) else backend
    name = choose_backend(q, kv, window, "auto", chunk=True)
    return None if name == "reference" else name
