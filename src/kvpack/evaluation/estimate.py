"""How long a sweep will take, from a probe of this machine's speed on this model (a few seconds).

The probe times, through the :class:`~kvpack.evaluation.runner.Runner` the sweep uses (each the fastest of a
few tries, so a moment of contention on a shared machine does not count): a full-precision prefill of ``n``
tokens, the same document stored into a quantized cache, a chunk through that cache against the same chunk
in full precision (how much slower the quantized path is), a decode step through it, and cutting a document
from the text. A prefill's time is scaled to other lengths by its arithmetic (``2 x parameters`` per token
for the weights, ``4 x heads x head_dim x layers`` per token and position for attention), so one probe length
serves every length of the sweep. :func:`estimate` then counts what the configuration runs (documents
prefilled, questions and answer tokens per format, teacher-forced tokens per variant, ...) at those costs.
A rough figure (answers stop early, the machine's load changes): good to tell a two-minute run from a
two-hour one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Estimate", "Probe", "estimate", "probe"]

QUESTION_TOKENS = 40  # a needle question with its chat framing and the start of the answer
ANSWER_STEPS = 6  # greedy steps until an answer is decided (they stop early)


@dataclass(frozen=True)
class Probe:
    """Measured costs (seconds) and the model's arithmetic.

    Attributes:
        tokens: the probe document's length ``n``.
        prefill_s: a full-precision prefill of ``n`` tokens.
        chunk_ratio: a chunk through a quantized cache over the same chunk in full precision (at least 1).
        step_s: one decode step through the quantized cache, at ``n`` tokens of context.
        fill_s: storing the ``n``-token document into a fresh quantized cache (sealing included).
        text_s: cutting a document from the text, per token.
        weight_flops: arithmetic per token for the weights (``2 x`` the parameters outside the embeddings).
        attention_flops: arithmetic per token and attended position (``4 x query heads x head_dim x layers``).
    """

    tokens: int
    prefill_s: float
    chunk_ratio: float
    step_s: float
    fill_s: float
    text_s: float
    weight_flops: float
    attention_flops: float

    @property
    def prefill_tok_s(self) -> float:
        return self.tokens / self.prefill_s

    def _work(self, n: int, context: int = 0) -> float:
        """Arithmetic of ``n`` new tokens after ``context`` cached ones (causal within the new ones)."""
        return n * self.weight_flops + self.attention_flops * n * (context + (n + 1) / 2)

    def prefill(self, n: int) -> float:
        return self.prefill_s * self._work(n) / self._work(self.tokens)

    def chunk(self, n: int, context: int) -> float:
        """``n`` tokens after ``context`` tokens, full precision."""
        return self.prefill_s * self._work(n, context) / self._work(self.tokens)

    def step(self, context: int) -> float:
        """One quantized decode step at ``context`` tokens."""
        return self.step_s * self._work(1, context) / self._work(1, self.tokens)

    def fill(self, n: int) -> float:
        """Storing ``n`` tokens into a fresh quantized cache: about half a fixed cost, half per token."""
        return self.fill_s * (0.5 + 0.5 * n / self.tokens)


def _timed(fn: Callable[[], Any], repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def model_flops(model: Any) -> tuple[float, float]:
    """``(weight_flops, attention_flops)`` of a transformers causal LM (see :class:`Probe`)."""
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    embed = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
             for p in m.parameters()}  # fmt: skip
    params = sum(p.numel() for p in model.parameters() if id(p) not in embed)
    return 2.0 * params, 4.0 * heads * head_dim * cfg.num_hidden_layers


def probe(
    runner: Any, ids: Sequence[int], fmt: Any, document: Callable[[int], Any] | None = None, repeats: int = 3
) -> Probe:
    """Time ``runner`` on ``ids`` (at least 96 tokens; 512 is plenty: the last 32 are the chunk and the decode
    steps) and on a cache of ``fmt``; ``document(n)`` cuts a document of ``n`` tokens from the text
    (:meth:`Corpus.haystack`)."""
    ids = list(ids)
    n = len(ids) - 32
    runner.forward(ids[:16], runner.cache(None, 16))  # first-call costs out of the way
    prefill_s = _timed(lambda: runner.prefill(ids[:n]), repeats)
    pre = runner.prefill(ids[:n])
    chunk = ids[n:]
    room = len(ids) + 8

    def through(f: Any) -> float:
        caches = [runner.filled(pre, f, room) for _ in range(repeats)]  # filled outside the timing
        return min(_timed(lambda c=c: runner.forward(chunk, c, logits_to_keep=1), 1) for c in caches)

    ratio = max(1.0, through(fmt) / max(through(None), 1e-9))
    fill_s = _timed(lambda: runner.filled(pre, fmt, room), repeats)
    text_s = _timed(lambda: document(n), 1) / n if document is not None else 0.0
    cache = runner.filled(pre, fmt, room)
    runner.forward(chunk[:1], cache, logits_to_keep=1)
    steps = []
    for tok in chunk[1:5]:
        t = time.perf_counter()
        runner.forward([tok], cache, logits_to_keep=1)
        steps.append(time.perf_counter() - t)
    weight, attention = model_flops(runner.lm.model)
    return Probe(n, prefill_s, ratio, min(steps), fill_s, text_s, weight, attention)


@dataclass(frozen=True)
class Estimate:
    """The expected wall time of a sweep, per section (seconds), and the probe it came from."""

    seconds: float
    sections: dict[str, float]
    formats: int
    lengths: int
    probe: Probe

    def line(self) -> str:
        """``about 14 min for 5 formats x 4 lengths (probe: 1,800 tok/s prefill, 25 ms per decode step)``."""
        s = self.seconds
        when = f"{max(1, round(s))} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"
        return (
            f"about {when} for {self.formats} format{'s' * (self.formats != 1)} x {self.lengths} "
            f"length{'s' * (self.lengths != 1)} (probe: {self.probe.prefill_tok_s:,.0f} tok/s prefill, "
            f"{1000 * self.probe.step_s:.0f} ms per decode step)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "sections": self.sections,
            "probe": asdict(self.probe) | {"prefill_tok_s": self.probe.prefill_tok_s},
        }


def estimate(cfg: Any, p: Probe, n_formats: int, n_variants: int, num_layers: int) -> Estimate:
    """The expected seconds of each section :func:`~kvpack.evaluation.suite.run_eval` runs for ``cfg``.

    Args:
        cfg: the :class:`~kvpack.evaluation.suite.EvalConfig` (lengths resolved to numbers).
        p: the probe.
        n_formats: formats of the run, the baseline included.
        n_variants: caches of the fidelity run (formats plus keys-only / values-only variants).
        num_layers: the model's layers (the plan search's length).
    """
    q = p.chunk_ratio
    sec: dict[str, float] = {}
    cases = len(cfg.depths) * len(cfg.kinds)
    if cases and cfg.lengths:  # per case: cut and prefill the document, then per format store, ask, answer
        sec["needles"] = sum(
            cases
            * (
                p.text_s * n
                + p.prefill(n)
                + n_formats * (p.fill(n) + q * p.chunk(QUESTION_TOKENS, n) + (1 + ANSWER_STEPS) * p.step(n))
            )
            for n in cfg.lengths
        )
    if cfg.fidelity_tokens:  # the reference and every variant through the same chunks (each call costs a step)
        calls = math.ceil(cfg.fidelity_tokens / cfg.fidelity_chunk) * (1 + n_variants)
        sec["fidelity"] = p.prefill(cfg.fidelity_tokens) * (1 + q * n_variants) + calls * p.step_s
    if cfg.sensitivity_tokens:  # one recorded forward, then each layer's attention again per format
        sec["sensitivity"] = p.prefill(cfg.sensitivity_tokens) * (1 + 0.5 * max(0, n_formats - 1))
    if cfg.plan_budget is not None:
        probes = math.ceil(math.log2(max(2, num_layers * (len(cfg.plan_formats) - 1) + 1))) + 2
        sens = p.prefill(max(cfg.sensitivity_tokens, 256)) * (1 + 0.5 * len(cfg.plan_formats))
        sec["plan"] = sens + probes * p.prefill(cfg.plan_tokens) * (1 + q)
    if cfg.speculative_tokens:  # per format: the two caches, then a draft step and a share of a verification
        c = cfg.speculative_context
        new = cfg.speculative_tokens
        per_format = 2 * p.fill(c) + new * (p.step(c) * (1 + q) + q * p.chunk(cfg.draft_tokens + 1, c) / 2)
        sec["speculative"] = cfg.speculative_prompts * (p.text_s * c + p.prefill(c) + n_formats * per_format)
    return Estimate(sum(sec.values()), sec, n_formats, len(cfg.lengths), p)
