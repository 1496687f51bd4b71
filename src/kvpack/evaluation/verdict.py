"""Verdicts: one conservative, explained line per format.

Rules (the baseline is the ``fp16`` cache, itself checked against full precision):

* **fails**: the format lost at least one needle the baseline found, at any tested length; the line names
  how many and the shortest length where it happened. Perplexity and KL cannot overrule a lost needle.
* **fails** too when the next-token distribution is wrecked: mean KL above :data:`KL_FAIL` nats or top-1
  agreement below :data:`TOP1_FAIL` (the model says something else most of the time).
* **caution**: no needle lost, but the next-token distribution drifts (mean KL above
  :data:`KL_CAUTION` nats or top-1 agreement below :data:`TOP1_CAUTION`), or it *gained* needles the
  baseline missed (it behaves differently, which is not the same as better).
* **caution** too when one layer carries the error: its attention-output error (the per-layer sensitivity
  sweep, one layer quantized at a time) is at least :data:`LAYER_OUTLIER_RATIO` times the median layer's and
  above :data:`LAYER_OUTLIER_MIN`; the line names the layer. A format can keep every short needle while one
  layer is wrecked (rotated e4m3 on a model with biased keys: layer 0 at 0.79, the others near 0.1), and
  that layer is where a per-layer plan should spend its bits.
* **ok**: identical needle results to the baseline in every case, and small KL.

A verdict never reaches past the longest context it tested ("up to 4k"), and it is about this model.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = [
    "KL_CAUTION",
    "KL_FAIL",
    "LAYER_OUTLIER_MIN",
    "LAYER_OUTLIER_RATIO",
    "TOP1_CAUTION",
    "TOP1_FAIL",
    "compare_needles",
    "fmt_tokens",
    "outlier_layer",
    "verdict",
]

KL_CAUTION = 0.02
TOP1_CAUTION = 0.95
KL_FAIL = 0.5
TOP1_FAIL = 0.6
LAYER_OUTLIER_RATIO = 4.0
LAYER_OUTLIER_MIN = 0.2


def fmt_tokens(n: int) -> str:
    """``4096 -> "4k"``, ``1536 -> "1.5k"``, ``700 -> "700"``."""
    if n >= 1024 and n % 512 == 0:
        k = n / 1024
        return f"{k:g}k"
    return str(n)


def compare_needles(cases: Sequence[dict[str, Any]], name: str, baseline: str) -> dict[str, Any]:
    """Needle results of ``name`` against ``baseline`` per length.

    Args:
        cases: needle cases, each with ``length``, ``depth``, ``kind`` and ``correct`` (format name -> bool).

    Returns:
        ``{"correct", "total", "baseline_correct", "lost", "gained", "by_length": {length: {...}},
        "identical_up_to": length or None, "first_lost": case or None}``.
    """
    by_length: dict[int, dict[str, int]] = {}
    lost_cases = []
    correct = base_correct = lost = gained = 0
    for c in cases:
        ok, base = bool(c["correct"][name]), bool(c["correct"][baseline])
        row = by_length.setdefault(
            int(c["length"]), {"correct": 0, "baseline_correct": 0, "lost": 0, "gained": 0, "total": 0}
        )
        row["total"] += 1
        row["correct"] += ok
        row["baseline_correct"] += base
        correct += ok
        base_correct += base
        if base and not ok:
            row["lost"] += 1
            lost += 1
            lost_cases.append(c)
        if ok and not base:
            row["gained"] += 1
            gained += 1
    identical_up_to = None
    for length in sorted(by_length):
        r = by_length[length]
        if r["lost"] or r["gained"]:
            break
        identical_up_to = length
    first = min(lost_cases, key=lambda c: (c["length"], c["depth"])) if lost_cases else None
    return {
        "correct": correct,
        "total": len(cases),
        "baseline_correct": base_correct,
        "lost": lost,
        "gained": gained,
        "by_length": by_length,
        "identical_up_to": identical_up_to,
        "first_lost": None if first is None else {k: first[k] for k in ("length", "depth", "kind")},
    }


def outlier_layer(errors: Sequence[float] | None) -> dict[str, float] | None:
    """The layer that carries a format's error, if one does: ``{"layer", "error", "median"}`` when the worst
    layer's error is at least :data:`LAYER_OUTLIER_RATIO` times the median layer's and above
    :data:`LAYER_OUTLIER_MIN`; else ``None`` (also for fewer than 3 layers, where a median says little)."""
    if not errors or len(errors) < 3:
        return None
    median = statistics.median(errors)
    worst = max(range(len(errors)), key=lambda i: errors[i])
    err = float(errors[worst])
    if err > LAYER_OUTLIER_MIN and err >= LAYER_OUTLIER_RATIO * median:
        return {"layer": worst, "error": err, "median": float(median)}
    return None


def verdict(
    name: str,
    needles: dict[str, Any] | None,
    fidelity: dict[str, Any] | None,
    max_length: int | None,
    baseline: str = "fp16",
    layer_errors: Sequence[float] | None = None,
) -> dict[str, str]:
    """The verdict of format ``name``: ``{"status": "ok" | "caution" | "fails" | "baseline", "text": ...}``.

    Args:
        needles: :func:`compare_needles` output (or ``None`` when the needle sweep did not run).
        fidelity: the fidelity summary (``kl_mean``, ``kl_p99``, ``top1_agreement``, ``ppl_delta``) or ``None``.
        max_length: the longest needle context tested.
        layer_errors: the format's per-layer attention-output errors (sensitivity sweep), or ``None``.
    """
    parts = []
    kl_note = ""
    drift = wrecked = False
    if fidelity:
        kl, p99, top1 = fidelity["kl_mean"], fidelity["kl_p99"], fidelity["top1_agreement"]
        kl_note = f"KL {kl:.2g} (p99 {p99:.2g}), top-1 {100 * top1:.1f}%"
        drift = kl > KL_CAUTION or top1 < TOP1_CAUTION
        wrecked = kl > KL_FAIL or top1 < TOP1_FAIL
    if name == baseline:
        text = f"{name}: the baseline"
        if kl_note:
            text += f" ({kl_note} against full precision)"
        return {"status": "baseline", "text": text}
    status = "ok"
    upto = ""
    if max_length:
        single = needles is not None and len(needles["by_length"]) == 1
        upto = f" {'at' if single else 'up to'} {fmt_tokens(max_length)}"
    if needles is not None:
        if needles["lost"]:
            status = "fails"
            first = needles["first_lost"]
            parts.append(
                f"lost {needles['lost']} of {needles['baseline_correct']} needles {baseline} found "
                f"(first at {fmt_tokens(first['length'])}, {first['kind']}, depth {first['depth']:g})"
            )
            if needles["identical_up_to"]:
                parts.append(f"identical up to {fmt_tokens(needles['identical_up_to'])}")
        elif needles["gained"]:
            status = "caution"
            parts.append(
                f"no needle lost{upto}, but {needles['gained']} answered differently from {baseline} "
                "(found where the baseline missed)"
            )
        else:
            parts.append(f"identical needle accuracy{upto} ({needles['correct']}/{needles['total']})")
    if kl_note:
        parts.append(kl_note)
    if wrecked:
        status = "fails"
        parts.append("the next-token distribution is badly damaged")
    elif drift and status == "ok":
        status = "caution"
        parts.append("the output drifts from fp16 on long text")
    worst = outlier_layer(layer_errors)
    if worst is not None:
        ratio = worst["error"] / worst["median"] if worst["median"] > 0 else float("inf")
        parts.append(
            f"layer {worst['layer']} carries the error (attention error {worst['error']:.2g}, "
            f"{ratio:.0f}x the median layer's {worst['median']:.2g}): keep that layer in a wider format"
        )
        if status == "ok":
            status = "caution"
    label = {"ok": "OK", "caution": "CAUTION", "fails": "FAILS"}[status]
    return {"status": status, "text": f"{name}: {label}: " + "; ".join(parts)}
