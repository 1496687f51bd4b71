"""``kvpack eval``: is this format safe for my model at my context length? (needles, KL, attribution, report)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpack.cli.args import count, fmt, int_in, out_dir, real_in
from kvpack.errors import ConfigError, KVPackError

DEFAULT_OUT = "kvpack-report"


def _floats(text: str) -> list[float]:
    depth = real_in(0.0, 1.0)
    out = [depth(p) for p in text.split(",") if p.strip()]
    if not out:
        raise argparse.ArgumentTypeError("give at least one depth")
    return out


def _lengths(text: str) -> list[int | str]:
    """Token counts (``1k,4k,16384``) and ``max``: the model's context window less room for the question."""
    out: list[int | str] = []
    for p in (p for p in text.split(",") if p.strip()):
        try:
            out.append("max" if p.strip().lower() == "max" else count(p))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e}, or max (the model's context window)") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected token counts like 1024,2k,4k or max, got {text!r}")
    return out


def _names(text: str) -> list[str]:
    from kvpack.formats import split_formats  # fields (sink=1, v=...) stay with their format

    out = split_formats(text)
    if not out:
        raise argparse.ArgumentTypeError(f"give at least one name, got {text!r}")
    return out


def _formats(text: str) -> list[str]:
    """Formats, or per-layer plans (``int4/int8[0,5-6]``, what ``--plan`` proposes), each checked."""
    from kvpack.plans import is_plan, parse_plan

    out = []
    for f in _names(text):
        if not is_plan(f):
            out.append(fmt(f))
            continue
        try:
            parse_plan(f)
        except KVPackError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append(f)
    return out


def _ladder(text: str) -> list[str]:
    """The formats a plan chooses between: formats, not plans."""
    from kvpack.plans import is_plan

    names = _names(text)
    plans = [f for f in names if is_plan(f)]
    if plans:
        raise argparse.ArgumentTypeError(
            f"the plan search chooses between formats and builds the plans itself; {plans[0]!r} is a plan "
            "(give it to --formats to evaluate it)"
        )
    return [fmt(f) for f in names]


def _budget(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a KL budget is a number of nats, e.g. 0.005; got {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"a KL budget must be a positive finite number of nats, got {text!r}")
    return v


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval",
        help="measure what each cache format does to a model: needles, KL, attribution, report",
        description=(
            "Needle-in-a-haystack sweep over context length and depth (the question is a later chunk that reads "
            "the quantized cache), teacher-forced KL / top-1 / perplexity, keys-vs-values attribution, per-layer "
            "sensitivity and speculative-decoding acceptance; writes index.html + results.json and prints a "
            "summary with a verdict per format. Without arguments: the embedded SmolLM2-135M-Instruct, the "
            "built-in prose, and the formats fp16 (baseline), fp8, int8, int4, llamacpp-q4_0, vllm-int4 (llama.cpp's "
            "and vLLM's 4-bit layouts), k4v2, kivi2, int4-g32."
        ),
    )
    p.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model folder, or a registered test model such as gemma3-270m (default: the embedded model)",
    )
    p.add_argument(
        "--formats",
        type=_formats,
        default=None,
        help="comma-separated formats; fields stay with their format (int4,sink=1,int8), or separate with ';'; a "
        "per-layer plan (int4/int8[7,9-11], what --plan proposes) is evaluated like a format",
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="needle context lengths, e.g. 1k,2k,4k; 'max' is the model's context window less room for the "
        "question and answer (1k,4k,max)",
    )
    p.add_argument(
        "--text",
        nargs="+",
        default=None,
        metavar="FILE",
        help="your own text for the haystacks and the teacher-forced text, instead of the built-in prose: plain "
        "text, or JSONL (.jsonl) with a 'text' field per line; taken in order, never repeated",
    )
    p.add_argument("--depths", type=_floats, default=None, help="needle depths in [0,1], e.g. 0.1,0.5,0.9")
    p.add_argument(
        "--kinds",
        type=_names,
        default=None,
        help="needle kinds: number,identifier,sentence,two-hop (default) and two-hop-strict",
    )
    p.add_argument("--out", type=out_dir, default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT}/)")
    p.add_argument("--json", action="store_true", help="print results as JSON on stdout instead of the table")
    p.add_argument("--seed", type=int, default=0, help="seed of haystacks and needles (default 0)")
    p.add_argument("--quick", action="store_true", help="a reduced sweep (a few minutes)")
    p.add_argument(
        "--fidelity-tokens", type=int_in(0, 1 << 20), default=None, help="teacher-forced text length (0 skips)"
    )
    p.add_argument(
        "--speculative-tokens", type=int_in(0, 1 << 20), default=None, help="tokens of assisted generation (0 skips)"
    )
    p.add_argument(
        "--engine",
        choices=["auto", "kvpack", "simulate"],
        default="auto",
        help="kvpack: the paged cache and fused kernels (default when available); simulate: the same cache "
        "contents through the model's own attention (labelled as such in the report)",
    )
    p.add_argument("--backend", default="auto", help="decode kernel backend of the kvpack engine")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="DIR",
        help="calibration artifact of this model (kvpack calibrate --out DIR), for formats with calibrated "
        "scales such as fp8@static (their scales are recomputed from its statistics) and for outlier key channels "
        "ranked by the queries (o<N>q)",
    )
    p.add_argument(
        "--plan",
        type=_budget,
        default=None,
        metavar="KL_BUDGET",
        help="also propose the fewest-bits per-layer plan whose mean KL is within this many nats (e.g. 0.005), "
        "measured through the cache; prints it as a format string cache_for and kvpack size accept",
    )
    p.add_argument(
        "--plan-formats",
        type=_ladder,
        default=None,
        help="the formats a plan chooses between, per layer (default int4,k8v4,int8)",
    )
    p.add_argument(
        "--plan-windows",
        type=int_in(1, 64),
        default=None,
        metavar="N",
        help="measure each candidate plan on N texts of 1,024 tokens that share no text, pooled (default 1); "
        "more where the KL moves with the text, as it does on Gemma",
    )
    p.add_argument("--threads", type=int_in(1, 4096), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(command="eval")


class _Bars:
    """tqdm progress bars on stderr, one per section."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None

    def start(self, section: str, total: int) -> None:
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover
            print(f"[kvpack eval] {section} ...", file=sys.stderr)
            return
        self.bar = tqdm(total=total, desc=f"{section:>22}", file=sys.stderr, leave=True, dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def config_from_args(args: argparse.Namespace):
    from kvpack.evaluation.config import EvalConfig, quick_config

    over: dict[str, Any] = {
        "model": args.model,
        "seed": args.seed,
        "engine": args.engine,
        "backend": args.backend,
        "calibration": args.calibration,
    }
    for key in ("formats", "lengths", "depths", "kinds", "text"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    if args.fidelity_tokens is not None:
        over["fidelity_tokens"] = args.fidelity_tokens
    if args.speculative_tokens is not None:
        over["speculative_tokens"] = args.speculative_tokens
    if args.plan is not None:
        over["plan_budget"] = args.plan
    if args.plan_formats is not None:
        over["plan_formats"] = args.plan_formats
    if args.plan_windows is not None:
        over["plan_windows"] = args.plan_windows
    if "formats" in over:
        if "fp16" not in over["formats"]:
            over["formats"] = ["fp16", *over["formats"]]
        others = [f for f in over["formats"] if f != "fp16"]
        if args.quick:  # attribute one format: int4 when asked for, else the first one
            over["attribution"] = ["int4"] if "int4" in others else others[:1]
        elif not {"int4", "kivi2"} & set(others):  # the default pair is absent: attribute them all
            over["attribution"] = None
    cfg = quick_config(**over) if args.quick else EvalConfig(**over)
    cfg.check()
    return cfg


def run(args: argparse.Namespace) -> int:
    from kvpack.evaluation.report import plan_line, summary_table, text_line, write_report
    from kvpack.evaluation.suite import run_eval

    cfg = config_from_args(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    results = run_eval(cfg, progress=_Bars(not args.no_progress), notify=_note)
    try:
        page = write_report(results, args.out)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {args.out!r} ({e}); pass --out with a writable folder") from e
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    else:
        print(summary_table(results))
        print("\n" + text_line(results["text"]))
        if "plan" in results:
            print("\n" + plan_line(results["plan"]))
        print(f"\nreport: {page}  (results: {page.parent / 'results.json'})")
    drift = results.get("calibration", {}).get("drift_warnings", {})
    if drift.get("count"):
        print(
            f"kvpack eval: {drift['count']} calibration drift warning(s): static scales clipped more than the "
            f"threshold, e.g. {drift['first'][0]} (all in results.json, calibration.drift_warnings)",
            file=sys.stderr,
        )
    return 0
