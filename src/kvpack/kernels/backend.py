"""The backend contract: what every attention backend provides, and the capabilities it declares as data.

A backend (:class:`DecodeBackend`) has a name, static :class:`Capabilities`, a reasons function that says why it
cannot run a case (a list of strings, empty when it can: never a bare boolean), the decode entry (one query per
sequence) and, where :attr:`Capabilities.chunk` says so, the multi-query entry (``T`` queries per sequence:
prefill chunks, prefix-cache hits, draft verification). The dispatcher (:mod:`kvpack.kernels`) reads the
capabilities before it asks for reasons, so a backend never lists what its capabilities already say, and only
checks its own limits: what any backend needs of a view is :meth:`~kvpack.kernels.views.PagedKV.check`'s.

The built-in backends are modules with module-level functions, wrapped by :class:`ModuleBackend`, which imports
them on first use (``import kvpack`` stays free of numba and triton).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, runtime_checkable

import torch

from kvpack.errors import ConfigError, UnsupportedError
from kvpack.kernels.views import PagedKV

__all__ = [
    "CHUNK_REASON",
    "OUTLIER_REASON",
    "SINK_REASON",
    "Capabilities",
    "DecodeBackend",
    "ModuleBackend",
    "capability_reasons",
]

OUTLIER_REASON = "outlier key channels (k_outlier) are not supported by this backend"
SINK_REASON = "full-precision sink positions (sink_k) are not supported by this backend"
CHUNK_REASON = "this backend has no multi-query entry (chunk_attention): it runs one query per sequence only"


@dataclass(frozen=True)
class Capabilities:
    """What a backend does with the optional parts of a view, the same for each of its entries.

    Attributes:
        outliers: adds the residuals of outlier key channels (``kv.k_outlier``) to the scores; without it the
            dispatcher refuses such views with :data:`OUTLIER_REASON`.
        sink: reads full-precision sink rows (``kv.sink_k`` / ``kv.sink_v``); else :data:`SINK_REASON`.
        chunk: has the multi-query entry ``chunk_attention``; else :data:`CHUNK_REASON` for multi-query calls.
        rotated_keys: reads a view of rotated keys (``kv.key_rotation``) itself; without it the dispatcher
            rotates the query and passes the view without the rotation.
    """

    outliers: bool = False
    sink: bool = False
    chunk: bool = False
    rotated_keys: bool = False


def capability_reasons(capabilities: Capabilities, kv: PagedKV, chunk: bool = False) -> list[str]:
    """The reasons a backend with ``capabilities`` cannot take ``kv`` (``chunk``: through its multi-query entry)
    that follow from its capabilities alone (empty list: none)."""
    reasons = []
    if chunk and not capabilities.chunk:
        reasons.append(CHUNK_REASON)
    if kv.k_outlier is not None and not capabilities.outliers:
        reasons.append(OUTLIER_REASON)
    if kv.sink_k is not None and not capabilities.sink:
        reasons.append(SINK_REASON)
    return reasons


@runtime_checkable
class DecodeBackend(Protocol):
    """What an attention backend provides (``isinstance`` checks the members are there).

    Tensors: ``q`` ``[batch, Hq, D]`` for decode, ``[batch, T, Hq, D]`` for the multi-query entry, float16 /
    bfloat16 / float32, ``Hq`` a multiple of ``kv.kv_heads``; ``out`` the optional output buffer, ``q``'s shape and
    dtype; the result has ``q``'s shape and dtype. Semantics: :func:`kvpack.kernels.decode_attention` and
    :func:`kvpack.kernels.chunk_attention`.
    """

    @property
    def name(self) -> str:
        """The key of the backend in :data:`kvpack.kernels.BACKENDS`."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What it does with the optional parts of a view (:class:`Capabilities`)."""
        ...

    def reasons_unsupported(
        self, q: torch.Tensor, kv: PagedKV, window: int | None = None, *, chunk: bool = False
    ) -> list[str]:
        """Why it cannot run this case through its decode entry (``chunk``: its multi-query entry), by its own
        limits: device, dtypes, head_dim, block size, spec layouts, a missing dependency. Empty: it can."""
        ...

    def decode_attention(
        self,
        q: torch.Tensor,
        kv: PagedKV,
        sm_scale: float | None = None,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query per sequence: ``q`` ``[batch, Hq, D]`` -> ``[batch, Hq, D]``."""
        ...

    def chunk_attention(
        self,
        q: torch.Tensor,
        kv: PagedKV,
        sm_scale: float | None = None,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last ``T`` positions of each sequence: ``q`` ``[batch, T, Hq, D]`` -> ``[batch, T, Hq, D]``.
        Raises :class:`UnsupportedError` for a backend without :attr:`Capabilities.chunk`."""
        ...


@dataclass(frozen=True)
class ModuleBackend:
    """A :class:`DecodeBackend` made of modules with module-level functions, imported on first use.

    The decode module provides ``reasons_unsupported(q, kv, window) -> list[str]`` and ``decode_attention(q, kv,
    sm_scale, window, out)``; the chunk module, where there is one, ``reasons_unsupported`` and
    ``chunk_attention`` with the same arguments. Functions are looked up on every call (a test may patch them).

    Attributes:
        name: the backend's key in :data:`kvpack.kernels.BACKENDS`.
        capabilities: its :class:`Capabilities`; ``chunk`` exactly when ``chunk_module`` is given.
        decode_module: dotted name of the decode module.
        chunk_module: dotted name of the multi-query module, or ``None``.
        extra: the pip extra that installs its dependencies (named in the reason when an import fails).
    """

    name: str
    capabilities: Capabilities
    decode_module: str
    chunk_module: str | None = None
    extra: str = ""

    def __post_init__(self) -> None:
        if self.capabilities.chunk != (self.chunk_module is not None):
            raise ConfigError(
                f"backend {self.name!r}: capabilities.chunk={self.capabilities.chunk} but chunk_module is "
                f"{self.chunk_module!r}; declare the multi-query entry exactly when there is a module for it"
            )

    def module(self, chunk: bool = False) -> ModuleType:
        """The decode module (``chunk``: the multi-query module), imported; :class:`UnsupportedError` if there is
        none, :class:`ImportError` if a dependency is missing."""
        if not chunk:
            return importlib.import_module(self.decode_module)
        if self.chunk_module is None:
            raise UnsupportedError(f"backend {self.name!r}: {CHUNK_REASON}", [CHUNK_REASON])
        return importlib.import_module(self.chunk_module)

    def reasons_unsupported(
        self, q: torch.Tensor, kv: PagedKV, window: int | None = None, *, chunk: bool = False
    ) -> list[str]:
        """The module's reasons; a failed import is one reason naming the extra to install."""
        if chunk and self.chunk_module is None:
            return [CHUNK_REASON]
        try:
            mod = self.module(chunk)
        except ImportError as e:
            return [f"backend {self.name!r} is not installed ({e}); pip install 'kvpack[{self.extra}]'"]
        return list(mod.reasons_unsupported(q, kv, window))

    def decode_attention(
        self,
        q: torch.Tensor,
        kv: PagedKV,
        sm_scale: float | None = None,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decode module's ``decode_attention``: ``q`` ``[batch, Hq, D]`` -> ``[batch, Hq, D]``."""
        return self.module().decode_attention(q, kv, sm_scale, window, out)

    def chunk_attention(
        self,
        q: torch.Tensor,
        kv: PagedKV,
        sm_scale: float | None = None,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chunk module's ``chunk_attention``: ``q`` ``[batch, T, Hq, D]`` -> ``[batch, T, Hq, D]``."""
        return self.module(chunk=True).chunk_attention(q, kv, sm_scale, window, out)
