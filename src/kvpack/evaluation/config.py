"""What an evaluation runs: :class:`EvalConfig`, its defaults, the reduced ``--quick`` sweep, and the
:class:`Progress` protocol :func:`~kvpack.evaluation.suite.run_eval` reports to. Light: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvpack.errors import ConfigError
from kvpack.evaluation.needles import DEFAULT_KINDS, KINDS

__all__ = [
    "DEFAULT_FORMATS",
    "QUESTION_ROOM",
    "EvalConfig",
    "NullProgress",
    "Progress",
    "quick_config",
    "resolve_lengths",
]

# kvpack's presets, and beside int4 the 4-bit layouts of llama.cpp and vLLM (kvpack.formats.PEER_PRESETS)
DEFAULT_FORMATS = ("fp16", "fp8", "int8", "int4", "llamacpp-q4_0", "vllm-int4", "k4v2", "kivi2", "int4-g32")

# tokens of the model's context window a needle document leaves for the question and the answer
QUESTION_ROOM = 64


@dataclass
class EvalConfig:
    """What one evaluation runs (every field lands in ``results.json``).

    Attributes:
        model: a local Hugging Face folder, or ``None`` for the embedded SmolLM2-135M-Instruct.
        formats: format names or strings; the first one equal to ``baseline`` is the baseline.
        baseline: the format others are compared to (``fp16``; itself compared to full precision).
        lengths: needle document lengths in tokens; ``"max"`` is the model's context window minus
            :data:`QUESTION_ROOM` (:func:`resolve_lengths`).
        depths: needle depths in ``[0, 1]``.
        kinds: needle kinds (see :mod:`kvpack.evaluation.needles`).
        seed: seeds every haystack and needle.
        fidelity_tokens: length of the teacher-forced text (0 skips fidelity and attribution).
        fidelity_chunk: tokens per chunk of the teacher-forced text.
        attribution: formats to split into keys-only and values-only runs (those not among ``formats`` are
            skipped; ``None``: every format but the baseline).
        sensitivity_tokens: length of the per-layer sensitivity text (0 skips it).
        speculative_tokens: tokens generated with a draft after each prompt (0 skips speculative decoding).
        speculative_prompts: how many prompts (documents) the speculative run uses.
        speculative_context: prompt length of the speculative run.
        draft_tokens: draft tokens per verification.
        engine: ``auto``, ``kvpack`` or ``simulate`` (see :class:`~kvpack.evaluation.runner.Runner`).
        backend: kvpack's decode kernel backend.
        calibration: a calibration artifact folder (``kvpack calibrate --out DIR``) of this model; formats
            with calibrated scales (``fp8@static``) need it and get scales recomputed from its statistics.
        plan_budget: propose the fewest-bits per-layer plan whose mean KL is within this many nats
            (:mod:`kvpack.evaluation.planner`); ``None`` skips the search.
        plan_formats: the plan's ladder of formats (sorted narrowest first by their bits).
        plan_tokens: length of the teacher-forced text each candidate plan is measured on.
        plan_windows: how many such texts (sharing no text) each candidate is measured on, its KL the mean over
            all their tokens: a model whose KL moves with the text (Gemma's by +-50% between 1,024-token texts)
            needs several for a plan that holds on other text.
        text: the user's text files (plain text, or JSONL with a ``text`` field per line,
            :func:`~kvpack.evaluation.corpus.load_text`) for the haystacks and every teacher-forced text,
            instead of the built-in prose; ``None``: the built-in prose.
    """

    model: str | None = None
    formats: list[str] = field(default_factory=lambda: list(DEFAULT_FORMATS))
    baseline: str = "fp16"
    lengths: list[int | str] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    kinds: list[str] = field(default_factory=lambda: list(DEFAULT_KINDS))
    seed: int = 0
    fidelity_tokens: int = 2048
    fidelity_chunk: int = 512
    attribution: list[str] | None = field(default_factory=lambda: ["int4", "kivi2"])
    sensitivity_tokens: int = 512
    speculative_tokens: int = 16
    speculative_prompts: int = 3
    speculative_context: int = 1024
    draft_tokens: int = 4
    engine: str = "auto"
    backend: str = "auto"
    calibration: str | None = None
    plan_budget: float | None = None
    plan_formats: list[str] = field(default_factory=lambda: ["int4", "k8v4", "int8"])
    plan_tokens: int = 1024
    plan_windows: int = 1
    text: list[str] | None = None

    def check(self) -> None:
        """Raise :class:`ConfigError` naming every bad field."""
        bad = []
        if not self.formats:
            bad.append("give at least one format")
        if self.baseline not in self.formats:
            bad.append(f"the baseline {self.baseline!r} must be among the formats {self.formats}")
        if any(n != "max" and (not isinstance(n, int) or n < 64) for n in self.lengths):
            bad.append(f"lengths must be at least 64 tokens (or 'max'), got {self.lengths}")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            bad.append(f"depths must lie in [0, 1], got {self.depths}")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            bad.append(f"unknown needle kinds {unknown}; kinds are {', '.join(KINDS)}")
        if self.fidelity_tokens and self.fidelity_tokens < 2:
            bad.append("fidelity_tokens must be 0 (skip) or at least 2")
        if self.plan_budget is not None:
            if not self.plan_budget > 0:
                bad.append(
                    f"the plan's KL budget must be a positive number of nats (e.g. 0.005), got {self.plan_budget}"
                )
            if len(self.plan_formats) < 2:
                bad.append(f"a plan needs at least two formats to choose between, got {self.plan_formats}")
            if self.plan_tokens < 64:
                bad.append(f"plan_tokens must be at least 64, got {self.plan_tokens}")
            if not (isinstance(self.plan_windows, int) and 1 <= self.plan_windows <= 64):
                bad.append(f"plan_windows must be an integer from 1 to 64, got {self.plan_windows!r}")
        elif self.plan_windows != 1:
            bad.append(f"plan_windows={self.plan_windows!r} is for the plan search: give a KL budget too (--plan)")
        if self.text is not None and not self.text:
            bad.append("text: give at least one file, or None for the built-in prose")
        if bad:
            raise ConfigError("; ".join(bad))


def resolve_lengths(lengths: Sequence[int | str], max_context: int) -> list[int]:
    """``lengths`` with ``"max"`` replaced by ``max_context - QUESTION_ROOM``, duplicates dropped (order kept).

    Raises:
        ConfigError: ``"max"`` for a model that does not state its context window.
    """
    out: list[int] = []
    for n in lengths:
        if n == "max":
            if max_context <= QUESTION_ROOM + 64:
                raise ConfigError(
                    f"--lengths max: the model states no usable context window (max_position_embeddings "
                    f"{max_context}); give the lengths in tokens"
                )
            n = max_context - QUESTION_ROOM
        if n not in out:
            out.append(int(n))
    return out


def quick_config(**overrides: Any) -> EvalConfig:
    """A reduced sweep that finishes in a few minutes: two lengths, one depth, short fidelity text."""
    cfg = EvalConfig(
        lengths=[1024, 2048],
        depths=[0.5],
        fidelity_tokens=1024,
        attribution=["int4"],
        sensitivity_tokens=256,
        speculative_tokens=16,
        speculative_prompts=1,
        speculative_context=512,
    )
    return replace(cfg, **overrides)


class Progress(Protocol):
    """What :func:`run_eval` reports progress to (the CLI wraps tqdm)."""

    def start(self, section: str, total: int) -> None: ...
    def advance(self, n: int = 1) -> None: ...
    def end(self) -> None: ...


class NullProgress:
    def start(self, section: str, total: int) -> None:
        return None

    def advance(self, n: int = 1) -> None:
        return None

    def end(self) -> None:
        return None
