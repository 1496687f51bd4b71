"""The other quantized KV caches ``kvpack bench generate`` times: transformers' ``QuantizedCache`` backends.

Each :class:`Peer` is one backend at one bit width. Which of them run is data, decided here and explained:
a backend the installed transformers does not know is left out (``unsupported``); one whose package is not
installed is listed with the install line (``pip install 'kvpack[peers]'``), never timed as zero. The
packages (optimum-quanto, hqq) are imported only when a cache is built, never at ``import kvpack``.

QuantizedCache keeps the last ``residual_length`` (128) tokens in full precision and the rest quantized, and
dequantizes the whole quantized history on every step; both backends quantize the flattened
``[batch, kv_heads, tokens, head_dim]`` tensor in groups of ``q_group_size`` (64) elements, so its size
must divide by 64 (:func:`peer_reasons`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GROUP", "PEERS", "Peer", "available_peers", "make_cache", "peer_reasons", "quantized_bytes"]

GROUP = 64  # QuantizedCache's default q_group_size, which the bench keeps
INSTALL = "pip install 'kvpack[peers]'"


@dataclass(frozen=True)
class Peer:
    """One transformers ``QuantizedCache`` configuration.

    Attributes:
        name: the bench's provider name (``quanto-int4``).
        backend: ``QuantizedCache``'s ``backend`` argument.
        nbits: its ``nbits`` (None: the backend's default).
        package: the distribution that provides the backend, for the install message.
    """

    name: str
    backend: str
    nbits: int | None
    package: str


PEERS = (
    Peer("quanto-int4", "quanto", 4, "optimum-quanto"),
    Peer("quanto-int2", "quanto", 2, "optimum-quanto"),
    Peer("hqq-int4", "hqq", 4, "hqq"),
    Peer("fp8", "fp8", None, "transformers"),  # a built-in backend of newer transformers (5.24), not of 5.19
)


def make_cache(peer: Peer, config: Any) -> Any:
    """An empty ``QuantizedCache`` for ``peer`` and the model ``config``."""
    from transformers import QuantizedCache

    kwargs = {} if peer.nbits is None else {"nbits": peer.nbits}
    return QuantizedCache(backend=peer.backend, config=config, q_group_size=GROUP, **kwargs)


def available_peers(config: Any, names: list[str] | None = None) -> tuple[list[Peer], list[str], list[str]]:
    """The peers that can be built here, by trying to build each.

    Args:
        config: the model's config.
        names: peer names to consider (None: all of :data:`PEERS`).

    Returns:
        ``(peers, missing, unsupported)``: the peers to time; one line per peer whose package is missing or
        that fails to build, with the reason; the names of peers the installed transformers has no backend for.
    """
    import transformers

    peers, missing, unsupported = [], [], []
    for peer in PEERS:
        if names is not None and peer.name not in names:
            continue
        try:
            make_cache(peer, config)
        except ImportError as e:
            missing.append(f"{peer.name}: {peer.package} is not installed ({INSTALL}): {str(e).splitlines()[0]}")
        except ValueError as e:
            if "Unknown quantization backend" in str(e):
                unsupported.append(f"{peer.name} (transformers {transformers.__version__})")
            else:
                missing.append(f"{peer.name}: {str(e).splitlines()[0]}")
        else:
            peers.append(peer)
    return peers, missing, unsupported


def peer_reasons(batch: int, kv_heads: int, tokens: int, head_dim: int) -> list[str]:
    """Why a QuantizedCache cannot hold ``[batch, kv_heads, tokens, head_dim]`` (empty: it can): quanto and hqq
    quantize the flattened tensor in groups of :data:`GROUP` (quanto raises ``Group size (64) must be a divisor``,
    hqq an assertion)."""
    n = batch * kv_heads * tokens * head_dim
    if n % GROUP:
        return [f"batch x kv_heads x tokens x head_dim = {n} does not divide into groups of {GROUP}"]
    return []


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors inside ``obj``: a tensor, a tensor subclass that flattens into inner tensors
    (quanto's packed tensors, whose own ``nbytes`` is the dequantized size), or a tuple/list/dict of them
    (hqq's ``(codes, meta)``)."""
    if obj is None:
        return 0
    if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
        names, _ = obj.__tensor_flatten__()
        return sum(_nbytes(getattr(obj, n)) for n in names)
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(x) for x in obj.values())
    return 0


def quantized_bytes(cache: Any) -> int:
    """Bytes a ``QuantizedCache`` holds: quantized history (codes, scales, zeros) plus the full-precision
    residual."""
    total = 0
    for layer in cache.layers:
        total += _nbytes(getattr(layer, "_quantized_keys", None)) + _nbytes(getattr(layer, "_quantized_values", None))
        total += _nbytes(layer.keys) + _nbytes(layer.values)
    return total
