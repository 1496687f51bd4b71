"""Teacher-forced fidelity: how far a quantized cache moves the next-token distribution, token by token.

A long text is fed in chunks; every chunk after the first attends to the cached history (quantized for the
variants, full precision for the reference), and the chunk's own completed blocks are sealed as they fill.
The reference and all variants advance chunk by chunk in lockstep, so only one chunk of logits per variant
is ever held in memory.

Per token ``t`` (predicting token ``t + 1``):

* ``kl[t] = KL(P_ref || P_quant)`` in nats (the direction llama.cpp's KLD statistics use);
* ``agree[t]``: the two argmax tokens are the same (top-1 agreement);
* ``nll_ref[t]``, ``nll[t]``: negative log-likelihood of the true next token (perplexity = exp of the mean).

Perplexity averages a loss most of which local context decides; KL's tail (p99) and top-1 flips are where
a damaged cache shows first, and needle retrieval is where it matters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FidelityResult", "bucket_edges", "summarize", "teacher_forced"]


@dataclass
class FidelityResult:
    """Per-token fidelity arrays of one variant against the reference (all ``[n_tokens - 1]`` float64).

    Attributes:
        kl: KL(P_ref || P_variant) per position, nats.
        agree: 1.0 where the argmax tokens agree.
        nll_ref: reference negative log-likelihood of the true next token.
        nll: the variant's negative log-likelihood of the true next token.
    """

    kl: torch.Tensor
    agree: torch.Tensor
    nll_ref: torch.Tensor
    nll: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)


def _kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) per row of ``[T, V]`` log-probabilities, float64 accumulation."""
    return (ref_logp.exp() * (ref_logp - logp)).double().sum(-1).clamp_min(0.0)


@torch.inference_mode()
def teacher_forced(
    forward: Callable[[Sequence[int], Any], torch.Tensor],
    ids: Sequence[int],
    reference_cache: Any,
    variant_caches: dict[str, Any],
    chunk: int = 256,
    progress: Callable[[], None] | None = None,
) -> dict[str, FidelityResult]:
    """Feed ``ids`` in chunks to the reference and every variant; compare their next-token distributions.

    Args:
        forward: ``forward(chunk_ids, cache) -> [T, vocab]`` logits (:meth:`Runner.forward`).
        ids: the text, ``n`` token ids.
        reference_cache: the full-precision cache.
        variant_caches: name -> cache of that variant.
        chunk: tokens per chunk.
        progress: called once per chunk.

    Returns:
        name -> :class:`FidelityResult` over the ``n - 1`` predicted positions.
    """
    ids = list(ids)
    target = torch.tensor(ids[1:], dtype=torch.long)
    parts: dict[str, list[list[torch.Tensor]]] = {name: [[], [], [], []] for name in variant_caches}
    for c0 in range(0, len(ids), chunk):
        piece = ids[c0 : c0 + chunk]
        tgt = target[c0 : c0 + len(piece)]  # the last chunk's last token has no target
        m = len(tgt)
        ref_logp = torch.log_softmax(forward(piece, reference_cache)[:m].float(), dim=-1)
        ref_top = ref_logp.argmax(-1)
        ref_nll = -ref_logp.gather(1, tgt.view(-1, 1)).squeeze(1).double()
        for name, cache in variant_caches.items():
            logp = torch.log_softmax(forward(piece, cache)[:m].float(), dim=-1)
            acc = parts[name]
            acc[0].append(_kl(ref_logp, logp))
            acc[1].append((logp.argmax(-1) == ref_top).double())
            acc[2].append(ref_nll)
            acc[3].append(-logp.gather(1, tgt.view(-1, 1)).squeeze(1).double())
        if progress is not None:
            progress()
    return {name: FidelityResult(*(torch.cat(p) for p in acc)) for name, acc in parts.items()}


def bucket_edges(n_tokens: int, first: int = 256) -> list[int]:
    """Position bucket edges doubling from ``first``: ``[0, 256, 512, 1024, ..., n_tokens]``."""
    edges = [0]
    e = first
    while e < n_tokens:
        edges.append(e)
        e *= 2
    edges.append(n_tokens)
    return edges


def _stats(r: FidelityResult, sl: slice) -> dict[str, float]:
    kl = r.kl[sl]
    if kl.numel() == 0:
        return {}
    ppl_ref = float(torch.exp(r.nll_ref[sl].mean()))
    ppl = float(torch.exp(r.nll[sl].mean()))
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float(r.agree[sl].mean()),
        "ppl_ref": ppl_ref,
        "ppl": ppl,
        "ppl_delta": ppl - ppl_ref,
        "tokens": int(kl.numel()),
    }


def summarize(r: FidelityResult, edges: list[int] | None = None) -> dict[str, Any]:
    """Whole-text statistics plus the same per position bucket (the context-length curve).

    Returns:
        ``{"kl_mean", "kl_p99", "kl_max", "top1_agreement", "ppl_ref", "ppl", "ppl_delta", "tokens",
        "by_position": [{"start", "end", ...same keys}]}``.
    """
    n = int(r.kl.numel())
    out: dict[str, Any] = _stats(r, slice(0, n))
    edges = edges or bucket_edges(n)
    out["by_position"] = [
        {"start": a, "end": b, **_stats(r, slice(a, b))} for a, b in itertools.pairwise(edges) if b > a
    ]
    return out
