"""The evaluation that does not trust perplexity: needle sweeps, exact recall, KL and top-1 flips, attribution.

Entry points: :func:`run_eval` with an :class:`EvalConfig` (what ``kvpack eval`` runs) and
:func:`write_report`. Modules: ``haystack`` (offline prose, token-length control), ``needles`` (probe kinds),
``scoring`` (exact match), ``runner`` (the model seam: caches per format, chunks, greedy answers),
``simulate`` (the stand-in engine), ``fidelity`` (teacher-forced KL / top-1 / perplexity), ``attribution``
(keys vs values, per layer), ``speculative`` (draft acceptance), ``verdict``, ``report``, ``suite``, and
``tiny`` (a tiny random model for tests).

Importing this package is light; transformers and matplotlib load when a run or a report needs them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EvalConfig", "quick_config", "run_eval", "write_report"]


def __getattr__(name: str) -> Any:
    if name in ("EvalConfig", "quick_config", "run_eval"):
        from kvpack.evaluation import suite

        return getattr(suite, name)
    if name == "write_report":
        from kvpack.evaluation.report import write_report

        return write_report
    raise AttributeError(f"module 'kvpack.evaluation' has no attribute {name!r}")
