"""The whole evaluation: needle sweep, fidelity, attribution, speculative decoding, verdicts -> one dict.

:func:`run_eval` is what ``kvpack eval`` calls (its configuration: :mod:`kvpack.evaluation.config`). Every number it produces is deterministic for a given
configuration and seed (greedy decoding, seeded haystacks and needles); wall-clock times live apart, under
``results["run"]``.
"""

from __future__ import annotations

import math
import platform
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from kvpack.errors import ConfigError
from kvpack.evaluation.attribution import keys_only, layer_sensitivity, values_only
from kvpack.evaluation.config import (
    DEFAULT_FORMATS,
    QUESTION_ROOM,
    EvalConfig,
    NullProgress,
    Progress,
    quick_config,
    resolve_lengths,
)
from kvpack.evaluation.corpus import Corpus, TextSource, builtin_source, load_text
from kvpack.evaluation.fidelity import summarize, teacher_forced
from kvpack.evaluation.needles import make_probe
from kvpack.evaluation.planner import PlanSearch, greedy_plans, search_plan
from kvpack.evaluation.runner import LoadedModel, Runner
from kvpack.evaluation.scoring import could_still_match, exact_match, normalize
from kvpack.evaluation.speculative import assisted_greedy
from kvpack.evaluation.verdict import compare_needles, verdict
from kvpack.formats import KVFormat, parse_format
from kvpack.plans import LayerPlan, is_plan, layer_formats, parse_plan

Format = KVFormat | LayerPlan  # what --formats names: a format, or a per-layer plan

__all__ = [
    "DEFAULT_FORMATS",
    "QUESTION_ROOM",
    "EvalConfig",
    "NullProgress",
    "Progress",
    "quick_config",
    "resolve_lengths",
    "run_eval",
]

# ----------------------------------------------------------------------------------------------------


def _rng(seed: int, *parts: Any) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def _fact_depths(n_facts: int, depth: float) -> list[float]:
    """One fact at ``depth``; linked facts half a document apart at ``depth / 2`` and ``0.5 + depth / 2``; a
    third (the distractor) between them."""
    if n_facts == 1:
        return [depth]
    return [depth / 2, 0.5 + depth / 2, 0.25 + depth / 2][:n_facts]


def _used_bytes(cache: Any) -> int | None:
    report = getattr(cache, "memory_report", None)
    if report is None:
        return None
    rep = report()
    total = getattr(rep, "total", None)
    if total is not None:
        return int(total.used_bytes)
    if isinstance(rep, dict) and "used_bytes" in rep:
        return int(rep["used_bytes"])
    return None


def _needles(
    runner: Runner,
    cfg: EvalConfig,
    corpus: Corpus,
    formats: dict[str, Format],
    progress: Progress,
    measured: dict[str, int],
) -> list[dict[str, Any]]:
    lm = runner.lm
    cases = []
    progress.start("needles", len(cfg.lengths) * len(cfg.depths) * len(cfg.kinds) * len(formats))
    for length in cfg.lengths:
        for depth in cfg.depths:
            for kind in cfg.kinds:
                probe = make_probe(kind, _rng(cfg.seed, "needle", length, depth, kind))
                hay_seed = cfg.seed * 1_000_003 + length
                depths = _fact_depths(len(probe.facts), depth)
                # the document chunk, chat framing included, is `length` tokens
                frame = len(lm.encode(runner.template.document("")))
                hay = corpus.haystack(length - frame, probe.facts, depths, seed=hay_seed)
                doc = lm.encode(runner.template.document(hay.text))
                question = lm.encode(runner.template.question(probe.question, probe.answer_prefix))
                budget = len(lm.encode(" " + probe.answer)) + 2

                def undecided(text: str, kind: str = kind, answer: str = probe.answer) -> bool:
                    return could_still_match(kind, answer, text)

                pre = runner.prefill(doc)
                case: dict[str, Any] = {
                    "length": length,
                    "depth": depth,
                    "kind": kind,
                    "doc_tokens": len(doc),
                    "question_tokens": len(question),
                    "actual_depths": list(hay.actual_depths),
                    "facts": list(probe.facts),
                    "question": probe.question,
                    "answer_prefix": probe.answer_prefix,
                    "answer": probe.answer,
                    "outputs": {},
                    "correct": {},
                }
                for name, fmt in formats.items():
                    cache = runner.filled(pre, fmt, len(doc) + len(question) + budget + 1)
                    if length == max(cfg.lengths) and name not in measured:
                        used = _used_bytes(cache)
                        if used is not None:
                            measured[name] = used
                    # decoding stops once the answer is decided: complete, or already wrong
                    out = lm.decode(runner.greedy(cache, question, budget, keep_going=undecided))
                    case["outputs"][name] = out
                    case["correct"][name] = exact_match(kind, probe.answer, out)
                    progress.advance()
                base = normalize(case["outputs"][cfg.baseline], kind)
                case["same_as_baseline"] = {n: normalize(o, kind) == base for n, o in case["outputs"].items()}
                cases.append(case)
    progress.end()
    return cases


def _fidelity(
    runner: Runner, cfg: EvalConfig, corpus: Corpus, variants: dict[str, Format], progress: Progress
) -> tuple[dict[str, Any], int]:
    ids = corpus.passage(cfg.fidelity_tokens, seed=cfg.seed * 1_000_003 + 7)
    n_chunks = -(-len(ids) // cfg.fidelity_chunk)
    progress.start("fidelity", n_chunks)
    ref = runner.cache(None, len(ids))
    caches = {name: runner.cache(fmt, len(ids) + 1) for name, fmt in variants.items()}
    res = teacher_forced(runner.forward, ids, ref, caches, chunk=cfg.fidelity_chunk, progress=progress.advance)
    progress.end()
    return {name: summarize(r) for name, r in res.items()}, len(ids)


def _plan(runner: Runner, cfg: EvalConfig, corpus: Corpus, progress: Progress) -> PlanSearch:
    """The per-layer plan search (:mod:`kvpack.evaluation.planner`): sensitivity of each ladder format on the
    sensitivity text, then candidate plans measured through the real cache on ``plan_tokens`` of text."""
    lm = runner.lm
    kv_heads, head_dim = lm.kv_heads, lm.head_dim
    ladder = sorted((parse_format(f) for f in cfg.plan_formats), key=lambda f: f.bits_per_element(kv_heads, head_dim))
    sens_ids = corpus.passage(max(cfg.sensitivity_tokens, 256), seed=cfg.seed * 1_000_003 + 13)
    progress.start("plan: per-layer errors", 1)
    errs = layer_sensitivity(runner, sens_ids, {f.name: f for f in ladder})
    progress.advance()
    progress.end()
    plans = greedy_plans(ladder, [errs[f.name] for f in ladder])
    texts = corpus.passages(cfg.plan_tokens, cfg.plan_windows, seed=cfg.seed * 1_000_003 + 7)
    progress.start("plan: candidates", max(1, math.ceil(math.log2(len(plans))) + 2))

    per_text: dict[str, list[float]] = {}

    def kl_of(p: LayerPlan) -> float:
        fmt = p.base if p.is_uniform else p
        kl = []
        for ids in texts:  # every token of every text weighs the same
            ref = runner.cache(None, len(ids))
            res = teacher_forced(
                runner.forward, ids, ref, {"plan": runner.cache(fmt, len(ids) + 1)}, chunk=cfg.fidelity_chunk
            )
            kl.append(res["plan"].kl.flatten())
        progress.advance()
        per_text[p.name] = [float(k.mean()) for k in kl]
        return float(torch.cat(kl).mean())

    found = search_plan(
        plans, kl_of, lambda p: p.bits_per_element(kv_heads, head_dim, lm.num_layers), cfg.plan_budget, ladder
    )
    if len(texts) > 1:  # how far the texts' KLs lie apart: the margin a plan at the budget's edge needs
        for probe in found.probes:
            probe["kl_texts"] = per_text[probe["plan"]]
    progress.end()
    return found


def _speculative(
    runner: Runner, cfg: EvalConfig, corpus: Corpus, formats: dict[str, Format], progress: Progress
) -> dict[str, dict[str, Any]]:
    """Assisted greedy generation after several prompts (a document and a request to summarise it).

    Several short generations rather than one long one: after the first disagreement a target follows its
    own text, so one long run is dominated by where its first flip happened.
    """
    lm = runner.lm
    frame = len(lm.encode(runner.template.document("")))
    question = lm.encode(runner.template.question("Summarize the document in a few sentences.", ""))
    progress.start("speculative", cfg.speculative_prompts * len(formats))
    totals = {name: {"proposed": 0, "accepted": 0, "target_calls": 0, "tokens": 0, "texts": []} for name in formats}
    for p in range(cfg.speculative_prompts):
        seed = cfg.seed * 1_000_003 + 11 + 1000 * p
        text = corpus.haystack(cfg.speculative_context - frame, seed=seed).text
        doc = lm.encode(runner.template.document(text))
        prompt = doc + question
        pre = runner.prefill(doc)
        max_tokens = len(prompt) + cfg.speculative_tokens + cfg.draft_tokens + 2
        for name, fmt in formats.items():
            target = runner.filled(pre, fmt, max_tokens)
            draft = runner.filled(pre, None, max_tokens)
            if len(question) > 1:
                runner.forward(question[:-1], target, logits_to_keep=1)
                runner.forward(question[:-1], draft, logits_to_keep=1)
            r = assisted_greedy(runner, prompt, target, draft, cfg.speculative_tokens, cfg.draft_tokens)
            t = totals[name]
            t["proposed"] += r.proposed
            t["accepted"] += r.accepted
            t["target_calls"] += r.target_calls
            t["tokens"] += len(r.tokens)
            t["texts"].append(lm.decode(r.tokens))
            progress.advance()
    progress.end()
    base = totals[cfg.baseline]["texts"] if cfg.baseline in totals else None
    out = {}
    for name, t in totals.items():
        out[name] = {
            "acceptance": t["accepted"] / t["proposed"] if t["proposed"] else 1.0,
            "proposed": t["proposed"],
            "accepted": t["accepted"],
            "target_calls": t["target_calls"],
            "tokens_per_call": t["tokens"] / t["target_calls"] if t["target_calls"] else 0.0,
            "texts": t["texts"],
            "same_text_as_baseline": t["texts"] == base,
        }
    return out


def _environment(source: TextSource) -> dict[str, str]:
    import numpy

    import kvpack

    env = {
        "kvpack": kvpack.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "haystack_corpus": source.name,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return env


def _format_facts(formats: dict[str, Format], lm: LoadedModel, lengths: Sequence[int]) -> dict[str, Any]:
    """Bits, bytes per token and the bytes of a ``max(lengths)``-token sequence of each format (a plan: each layer
    in its own format, bits averaged over the layers)."""
    fp16 = parse_format("fp16")
    n = max(lengths) if lengths else 4096
    kw = {"kv_heads": lm.kv_heads, "head_dim": lm.head_dim}
    out = {}
    for name, fmt in formats.items():
        per_layer = layer_formats(fmt, lm.num_layers)
        b = sum(f.bytes_for_tokens(n, **kw) for f in per_layer)
        out[name] = {
            "spec": fmt.spec_string(),
            "bits_per_element": sum(f.bits_per_element(**kw) for f in per_layer) / len(per_layer),
            "bytes_per_token": sum(f.bytes_per_token(**kw) for f in per_layer),
            "tokens": n,
            "cache_bytes": b,
            "ratio_vs_fp16": b / fp16.bytes_for_tokens(n, layers=lm.num_layers, **kw),
        }
    return out


def _parse(name: str, num_layers: int, head_dim: int) -> Format:
    """A ``--formats`` entry: a format, or a per-layer plan (a plan without overrides is its format), checked
    against the model.

    Raises:
        FormatError: it does not parse, a format cannot store ``head_dim``, or the plan names a layer the model
            does not have.
        ConfigError: a plan with calibrated (``static``) formats.
    """
    if not is_plan(name):
        fmt = parse_format(name)
        fmt.check(head_dim)
        return fmt
    plan = parse_plan(name)
    plan.check(head_dim)
    plan.formats(num_layers)  # its layers exist
    if plan.is_uniform:
        return plan.base
    static = [f.name for f in plan.distinct_formats if f.is_static]
    if static:
        raise ConfigError(
            f"plan {name!r}: its formats {static} take calibrated scales, which kvpack eval applies to single formats "
            "only; evaluate the static format alone (--formats with --calibration), or plan with dynamic formats"
        )
    return plan


def _distinct(fmt: Format) -> list[KVFormat]:
    """The formats a ``--formats`` entry stores: itself, or a plan's distinct formats."""
    return [fmt] if isinstance(fmt, KVFormat) else list(fmt.distinct_formats)


def run_eval(
    cfg: EvalConfig,
    lm: LoadedModel | None = None,
    progress: Progress | None = None,
    *,
    notify: Callable[[str], None] | None = None,
    **runner_kw: Any,
) -> dict:
    """Run the evaluation ``cfg`` describes and return every result as a JSON-ready dict.

    Calibration drift warnings of static formats (one per cache that clipped too much, so dozens per run)
    are collected into ``results["calibration"]["drift_warnings"]`` instead of being printed; any other
    warning is re-emitted after the run.

    Args:
        cfg: the configuration.
        lm: an already loaded model (default: load ``cfg.model``).
        progress: progress sink (default: silent).
        notify: one-line messages for the user before the sweep (``kvpack eval`` prints them on stderr): the
            CPU kernels' first compile on this machine (compiled up front, :mod:`kvpack.kernels.warmup`) and
            the time estimate from a probe of this machine's speed (:mod:`kvpack.evaluation.estimate`, also
            in ``results["run"]["estimate"]``). Without it neither the compile note nor the probe runs.
        runner_kw: passed to :class:`Runner` (tests pass ``zero_keys_for=[name]`` to plant a broken format).
    """
    from kvpack.calibration.static import CalibrationDriftWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CalibrationDriftWarning)
        try:
            results = _run_eval(cfg, lm, progress, notify, **runner_kw)
        finally:
            others = [w for w in caught if not issubclass(w.category, CalibrationDriftWarning)]
    for w in others:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    drift = [str(w.message) for w in caught if issubclass(w.category, CalibrationDriftWarning)]
    if "calibration" in results:
        results["calibration"]["drift_warnings"] = {"count": len(drift), "first": drift[:3]}
    return results


def _attribution_names(cfg: EvalConfig, formats: dict[str, Format]) -> list[str]:
    names = [n for n in formats if n != cfg.baseline]
    return names if cfg.attribution is None else [n for n in cfg.attribution if n in names]


def _text_needs(cfg: EvalConfig) -> list[tuple[str, int]]:
    """What each part of the sweep takes of the user's text, in tokens (``Corpus.check``)."""
    needs = []
    if cfg.lengths and cfg.depths and cfg.kinds:
        needs.append((f"--lengths {max(cfg.lengths)}", max(cfg.lengths)))
    if cfg.fidelity_tokens:
        needs.append((f"--fidelity-tokens {cfg.fidelity_tokens}", cfg.fidelity_tokens))
    if cfg.sensitivity_tokens or cfg.plan_budget is not None:
        n = max(cfg.sensitivity_tokens, 256) if cfg.plan_budget is not None else cfg.sensitivity_tokens
        needs.append(("the per-layer sensitivity text", n))
    if cfg.plan_budget is not None:
        what = "the plan search's text" + (f" ({cfg.plan_windows} passages)" if cfg.plan_windows > 1 else "")
        needs.append((what, cfg.plan_tokens * cfg.plan_windows))
    if cfg.speculative_tokens:
        needs.append(("the speculative prompts (--speculative-tokens 0 skips them)", cfg.speculative_context))
    return needs


def _on_cpu_kernels(runner: Runner) -> bool:
    """Whether the run's attention goes through the fused CPU kernels (numba)."""
    if runner.engine != "kvpack" or runner.backend not in ("auto", "cpu"):
        return False
    return next(runner.lm.model.parameters()).device.type == "cpu"


def _run_eval(
    cfg: EvalConfig,
    lm: LoadedModel | None,
    progress: Progress | None,
    notify: Callable[[str], None] | None,
    **runner_kw: Any,
) -> dict:
    cfg.check()
    progress = progress or NullProgress()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    source = load_text(cfg.text) if cfg.text is not None else builtin_source()  # bad files fail before the load
    if lm is None:
        from kvpack.evaluation.runner import load

        lm = load(cfg.model)
    timings["load"] = time.perf_counter() - t0
    requested = list(cfg.lengths)
    cfg = replace(cfg, lengths=resolve_lengths(cfg.lengths, lm.max_context))
    formats = {name: _parse(name, lm.num_layers, lm.head_dim) for name in cfg.formats}
    static = [name for name, fmt in formats.items() if isinstance(fmt, KVFormat) and fmt.is_static]
    ladder = {f: parse_format(f) for f in cfg.plan_formats} if cfg.plan_budget is not None else {}  # evaluated too
    stored = formats | {f: fmt for f, fmt in ladder.items() if f not in formats}
    ranked = [name for name, fmt in stored.items() if any(f.query_ranked for f in _distinct(fmt))]
    artifact = None
    if cfg.calibration is not None:
        from kvpack.calibration import load_artifact

        artifact = load_artifact(cfg.calibration, model=lm.model)  # refuses another model's artifact
    elif static or ranked:
        need = [f"formats {static} take calibrated scales"] if static else []
        need += [f"formats {ranked} rank outlier key channels by the queries"] if ranked else []
        raise ConfigError(" and ".join(need) + "; run `kvpack calibrate --out DIR` and pass --calibration DIR")
    runner = Runner(lm, engine=cfg.engine, backend=cfg.backend, calibration=artifact, **runner_kw)
    if ranked:  # before any text runs: an artifact without query statistics is refused now (one check serves all)
        runner.query_energy(next(f for f in _distinct(stored[ranked[0]]) if f.query_ranked))
    too_long = [n for n in cfg.lengths if lm.max_context and n + QUESTION_ROOM > lm.max_context]
    if too_long:
        raise ConfigError(
            f"lengths {too_long} do not fit the model's context of {lm.max_context} tokens (question and answer "
            f"need room too); choose shorter --lengths (at most {lm.max_context - QUESTION_ROOM}, or 'max')"
        )
    t = time.perf_counter()
    corpus = Corpus(source, lm.encode)
    corpus.check(_text_needs(cfg))
    timings["text"] = time.perf_counter() - t
    config = asdict(cfg) | {"engine": runner.engine}
    if requested != cfg.lengths:
        config["lengths_requested"] = requested
    results: dict[str, Any] = {
        "config": config,
        "text": corpus.describe(),
        "environment": _environment(source),
        "model": {
            "name": lm.name,
            "layers": lm.num_layers,
            "kv_heads": lm.kv_heads,
            "head_dim": lm.head_dim,
            "max_context": lm.max_context,
            "parameters": sum(p.numel() for p in lm.model.parameters()),
            "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
        },
        "formats": _format_facts(formats, lm, cfg.lengths),
    }
    if artifact is not None:
        results["calibration"] = {
            "path": str(cfg.calibration),
            "made_for": artifact.format.name,
            "source_per_format": {
                n: runner.scales_for(f).key.source
                for n, f in formats.items()
                if isinstance(f, KVFormat) and f.key.static
            },
            "data": {k: v for k, v in artifact.data.items() if k != "offsets"},
            "kvpack_version": artifact.kvpack_version,
        }

    run_notes: dict[str, Any] = {}
    if notify is not None:
        if _on_cpu_kernels(runner):
            from kvpack.kernels.warmup import compile_if_cold

            compiled = compile_if_cold(notify)
            if compiled is not None:
                run_notes["compile_seconds"] = compiled
        t = time.perf_counter()
        run_notes["estimate"] = _estimate(runner, cfg, corpus, formats, notify)
        timings["probe"] = time.perf_counter() - t

    measured: dict[str, int] = {}
    t = time.perf_counter()
    cases = (
        _needles(runner, cfg, corpus, formats, progress, measured) if cfg.lengths and cfg.depths and cfg.kinds else []
    )
    timings["needles"] = time.perf_counter() - t
    for name, used in measured.items():
        results["formats"][name]["measured_cache_bytes"] = used
    summaries = {name: compare_needles(cases, name, cfg.baseline) for name in formats} if cases else {}
    results["needles"] = {"cases": cases, "summary": summaries}

    fid: dict[str, Any] = {}
    attribution: dict[str, Any] = {}
    if cfg.fidelity_tokens:
        attr_names = _attribution_names(cfg, formats)
        variants = dict(formats)
        for name in attr_names:
            fmt = formats[name]
            variants[f"{name} keys only"] = keys_only(fmt)
            variants[f"{name} values only"] = values_only(fmt)
        t = time.perf_counter()
        fid, n_tokens = _fidelity(runner, cfg, corpus, variants, progress)
        timings["fidelity"] = time.perf_counter() - t
        attribution["fidelity"] = {
            name: {
                side: fid[key]["kl_mean"]
                for side, key in (
                    ("both", name),
                    ("keys_only", f"{name} keys only"),
                    ("values_only", f"{name} values only"),
                )
                if key in fid
            }
            for name in attr_names
        }
        results["fidelity"] = {
            "tokens": n_tokens,
            "chunk": cfg.fidelity_chunk,
            "reference": f"full precision ({results['model']['dtype']} DynamicCache)",
            "variants": fid,
        }
    if cfg.sensitivity_tokens:
        t = time.perf_counter()
        ids = corpus.passage(cfg.sensitivity_tokens, seed=cfg.seed * 1_000_003 + 13)
        progress.start("per-layer sensitivity", 1)
        attribution["layer_sensitivity"] = {
            "tokens": len(ids),
            "metric": "relative attention-output error of each layer alone (simulate engine)",
            "errors": layer_sensitivity(runner, ids, {n: f for n, f in formats.items() if n != cfg.baseline}),
        }
        progress.advance()
        progress.end()
        timings["sensitivity"] = time.perf_counter() - t
    results["attribution"] = attribution
    if cfg.plan_budget is not None:
        t = time.perf_counter()
        results["plan"] = {
            **_plan(runner, cfg, corpus, progress).as_dict(),
            "tokens": cfg.plan_tokens,
            "windows": cfg.plan_windows,
        }
        timings["plan"] = time.perf_counter() - t
    if cfg.speculative_tokens:
        t = time.perf_counter()
        results["speculative"] = _speculative(runner, cfg, corpus, formats, progress)
        timings["speculative"] = time.perf_counter() - t

    max_len = max(cfg.lengths) if cases else None
    layer_errors = attribution.get("layer_sensitivity", {}).get("errors", {})
    results["verdicts"] = {
        name: verdict(name, summaries.get(name), fid.get(name), max_len, cfg.baseline, layer_errors.get(name))
        for name in formats
    }
    timings["total"] = time.perf_counter() - t0
    results["run"] = {
        "seconds": timings,
        "started": started,
        "torch_threads": torch.get_num_threads(),
        # CPU seconds of this process: with one thread, what the run takes on an idle core (wall time on a
        # shared machine includes waiting for other work)
        "cpu_seconds": time.process_time() - cpu0,
        **run_notes,
    }
    return results


def _passthrough(fmt: Format) -> bool:
    return isinstance(fmt, KVFormat) and fmt.is_passthrough


def _estimate(
    runner: Runner, cfg: EvalConfig, corpus: Corpus, formats: dict[str, Format], notify: Callable[[str], None]
) -> dict[str, Any]:
    """Probe this machine's speed, tell ``notify`` how long the sweep will take, return it for ``results``."""
    from kvpack.evaluation.estimate import estimate, probe

    n = min(512, corpus.tokens or 512)
    if n < 128:  # too little text to time anything on (the sweep runs on even less)
        return {}
    ids = corpus.passage(n, seed=cfg.seed * 1_000_003 + 17)
    quantized = [f for name, f in formats.items() if name != cfg.baseline] or list(formats.values())
    fmt = quantized[0]
    p = probe(
        runner,
        ids,
        fmt,
        document=lambda n: corpus.haystack(n, seed=cfg.seed * 1_000_003 + 19),
        sensitivity=lambda ids: None if _passthrough(fmt) else layer_sensitivity(runner, ids, {fmt.name: fmt}),
    )
    variants = len(formats) + 2 * len(_attribution_names(cfg, formats)) if cfg.fidelity_tokens else 0
    est = estimate(cfg, p, len(formats), variants, runner.lm.num_layers)
    notify(f"kvpack eval: {est.line()}")
    return est.as_dict()
