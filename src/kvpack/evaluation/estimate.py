"""How long a sweep will take, from a probe of this machine's speed on this model (a few seconds).

The probe times, through the :class:`~kvpack.evaluation.runner.Runner` the sweep uses (each the fastest of
two tries, so a moment of contention on a shared machine counts less): a full-precision prefill of ``n``
tokens (each needle document is prefilled once so) and a full-precision decode step (a speculative draft's),
the per-layer sensitivity of a short text, cutting a document from the text, then storing the document into
a quantized cache, chunks of 16 and 64 tokens and a decode step through that cache (the questions, answers,
teacher-forced chunks and speculative rounds all read the quantized cache this way). Times are scaled to other lengths by the arithmetic (``2 x parameters`` per token for the
weights, ``4 x heads x head_dim x layers`` per token and attended position), so one probe serves every
length of the sweep. :func:`estimate` then counts what the configuration runs at those costs. A rough figure
(answers stop early, the machine's load changes): good to tell a two-minute run from a two-hour one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Estimate", "Probe", "estimate", "model_flops", "probe"]

QUESTION_TOKENS = 40  # a needle question with its chat framing and the start of the answer
ANSWER_STEPS = 6  # greedy steps until an answer is decided (they stop early)
CHUNK = 64  # tokens of the probe's quantized chunk
SENSITIVITY_TOKENS = 64  # tokens of the probe's per-layer sensitivity run


@dataclass(frozen=True)
class Probe:
    """Measured costs (seconds) and the model's arithmetic.

    Attributes:
        tokens: the probe document's length ``n``.
        prefill_s: a full-precision prefill of ``n`` tokens.
        chunk_s: a chunk of :data:`CHUNK` tokens through a quantized cache holding ``n`` tokens.
        chunk_fixed_s: the part of ``chunk_s`` that does not depend on the chunk's length (from a chunk a
            quarter as long).
        step_s: one decode step through that cache.
        draft_step_s: one decode step through a full-precision cache (a speculative draft's).
        fill_s: storing the ``n``-token document into a fresh quantized cache (sealing included).
        sensitivity_s: the per-layer sensitivity of :data:`SENSITIVITY_TOKENS` tokens for one format.
        text_s: cutting a document from the text, per token.
        weight_flops: arithmetic per token for the weights (``2 x`` the parameters outside the embeddings).
        attention_flops: arithmetic per token and attended position (``4 x query heads x head_dim x layers``).
    """

    tokens: int
    prefill_s: float
    chunk_s: float
    step_s: float
    draft_step_s: float
    fill_s: float
    sensitivity_s: float
    text_s: float
    weight_flops: float
    attention_flops: float
    chunk_fixed_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.tokens / self.prefill_s

    def _work(self, n: int, context: int = 0) -> float:
        """Arithmetic of ``n`` new tokens after ``context`` cached ones (causal within the new ones)."""
        return n * self.weight_flops + self.attention_flops * n * (context + (n + 1) / 2)

    def prefill(self, n: int) -> float:
        """A full-precision prefill of ``n`` tokens."""
        return self.prefill_s * self._work(n) / self._work(self.tokens)

    def chunk(self, n: int, context: int) -> float:
        """``n`` tokens after ``context`` tokens, through a quantized cache: the fixed part, and the per-token
        part scaled by the arithmetic per token at that context."""
        per_token = (self.chunk_s - self.chunk_fixed_s) / CHUNK
        scale = (self._work(n, context) / n) / (self._work(CHUNK, self.tokens) / CHUNK)
        return self.chunk_fixed_s + per_token * n * scale

    def chunks(self, n: int, size: int) -> float:
        """``n`` tokens fed in chunks of ``size`` through a quantized cache (teacher forcing)."""
        return sum(self.chunk(min(size, n - c0), c0) for c0 in range(0, n, max(1, size)))

    def step(self, context: int, draft: bool = False) -> float:
        """One decode step at ``context`` tokens through a quantized cache (a full-precision one with
        ``draft``)."""
        return (self.draft_step_s if draft else self.step_s) * self._work(1, context) / self._work(1, self.tokens)

    def sensitivity(self, n: int) -> float:
        """The per-layer sensitivity of ``n`` tokens for one format: per-layer work more than per-token work,
        so it grows about as the square root of the length (on the embedded model: twice the tokens, 1.3x
        the time; 8x, about 3x)."""
        return self.sensitivity_s * math.sqrt(n / SENSITIVITY_TOKENS)

    def fill(self, n: int) -> float:
        """Storing ``n`` tokens into a fresh quantized cache: about half a fixed cost, half per token."""
        return self.fill_s * (0.5 + 0.5 * n / self.tokens)


def _timed(fn: Callable[[], Any], repeats: int = 2) -> float:
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
    runner: Any,
    ids: Sequence[int],
    fmt: Any,
    document: Callable[[int], Any] | None = None,
    sensitivity: Callable[[Sequence[int]], Any] | None = None,
) -> Probe:
    """Time ``runner`` on ``ids`` (at least 128 tokens; 512 is plenty: the last :data:`CHUNK` are the chunk and
    the decode steps) and on a cache of ``fmt``; ``document(n)`` cuts a document of ``n`` tokens from the text
    (:meth:`Corpus.haystack`), ``sensitivity(ids)`` runs the per-layer sensitivity of ``fmt`` on ``ids``."""
    ids = list(ids)
    n = len(ids) - CHUNK
    runner.forward(ids[:16], runner.cache(None, 16))  # first-call costs out of the way
    prefill_s = _timed(lambda: runner.prefill(ids[:n]))
    pre = runner.prefill(ids[:n])
    chunk = ids[n:]
    room = len(ids) + 8

    def steps(cache: Any) -> float:
        best = math.inf
        for tok in chunk[:4]:
            t = time.perf_counter()
            runner.forward([tok], cache, logits_to_keep=1)
            best = min(best, time.perf_counter() - t)
        return best

    # full-precision work first, before any kvpack kernel has run in this probe
    draft_step_s = steps(runner.filled(pre, None, room))
    text_s = _timed(lambda: document(n), 1) / n if document is not None else 0.0
    sens_s = 0.0
    if sensitivity is not None:
        sensitivity(ids[:8])  # its first call sets things up once per run (the sweep pays that once too)
        sens_s = _timed(lambda: sensitivity(ids[:SENSITIVITY_TOKENS]), 1)
    fill_s = _timed(lambda: runner.filled(pre, fmt, room))

    def through(tokens: Sequence[int]) -> float:
        caches = [runner.filled(pre, fmt, room) for _ in range(2)]  # filled outside the timing
        return min(_timed(lambda c=c: runner.forward(tokens, c, logits_to_keep=1), 1) for c in caches)

    short_s = through(chunk[: CHUNK // 4])
    chunk_s = through(chunk)
    cache = runner.filled(pre, fmt, room)
    runner.forward(chunk, cache, logits_to_keep=1)
    step_s = steps(cache)  # decode steps after a chunk, as an answer follows its question
    # a chunk costs a fixed part (per layer and call) and a part per token: the two lengths tell them apart;
    # at most half of it is fixed (what the embedded model measures, 40%; one noisy timing must not make
    # every longer chunk free)
    fixed = min(max(0.0, (4 * short_s - chunk_s) / 3), chunk_s / 2)
    weight, attention = model_flops(runner.lm.model)
    return Probe(n, prefill_s, chunk_s, step_s, draft_step_s, fill_s, sens_s, text_s, weight, attention, fixed)


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
    sec: dict[str, float] = {}
    cases = len(cfg.depths) * len(cfg.kinds)
    if cases and cfg.lengths:  # per case: cut and prefill the document, then per format store, ask, answer
        sec["needles"] = sum(
            cases
            * (
                p.text_s * n
                + p.prefill(n)
                + n_formats * (p.fill(n) + p.chunk(QUESTION_TOKENS, n) + ANSWER_STEPS * p.step(n))
            )
            for n in cfg.lengths
        )
    if cfg.fidelity_tokens:  # the full-precision reference, then every variant through the same chunks
        n = cfg.fidelity_tokens
        sec["fidelity"] = p.prefill(n) + n_variants * (p.fill(0) + p.chunks(n, cfg.fidelity_chunk))
    if cfg.sensitivity_tokens:  # one recorded forward, then each layer's attention again per format
        n = cfg.sensitivity_tokens
        sec["sensitivity"] = p.prefill(n) + max(0, n_formats - 1) * p.sensitivity(n)
    if cfg.plan_budget is not None:  # the ladder's sensitivity, then a binary search of teacher-forced runs
        n = max(cfg.sensitivity_tokens, 256)
        probes = math.ceil(math.log2(max(2, num_layers * (len(cfg.plan_formats) - 1) + 1))) + 2
        run = p.prefill(cfg.plan_tokens) + p.fill(0) + p.chunks(cfg.plan_tokens, cfg.fidelity_chunk)
        sec["plan"] = p.prefill(n) + len(cfg.plan_formats) * p.sensitivity(n) + probes * run
    if cfg.speculative_tokens:  # per format: two caches, the question, then draft steps and verifications
        c = cfg.speculative_context
        rounds = cfg.speculative_tokens / 3  # about three new tokens per verification on a quantized target
        per_format = 2 * p.fill(c) + 2 * p.chunk(20, c)
        per_format += rounds * (cfg.draft_tokens * p.step(c, draft=True) + p.chunk(cfg.draft_tokens + 1, c))
        sec["speculative"] = cfg.speculative_prompts * (p.text_s * c + p.prefill(c) + n_formats * per_format)
    return Estimate(sum(sec.values()), sec, n_formats, len(cfg.lengths), p)
