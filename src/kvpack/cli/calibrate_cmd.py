"""``kvpack calibrate``: run calibration text through a model, observe keys and values, save an artifact."""

from __future__ import annotations

import argparse
import json

from kvpack.cli.args import fmt, int_in, out_dir, real_in
from kvpack.errors import ConfigError

EPILOG = """\
The artifact (a folder: kvpack_calibration.safetensors + kvpack_calibration.json) holds per-layer,
per-head, per-channel statistics of keys (after RoPE) and values, and the static scales for --format.
Scale source (--range): 'rope' bounds each key channel by the norm of its RoPE pair, so positions
longer than the calibration windows do not clip (default for symmetric keys); 'absmax' is the largest
value seen (default for asymmetric keys, whose per-channel offset 'rope' would discard); 'p99.9' a
percentile (clips about 0.1 % by design). --percentile P records that percentile and, without --range,
uses it. Calibrate with windows about as long as the contexts you serve.
examples:
  kvpack calibrate --out calib/                       # the embedded SmolLM2-135M, about a minute
  kvpack calibrate --model path/to/model --samples 64 --seq-len 1024 --out calib/
  kvpack calibrate --format 'kv=fp8:tensor:static:fp32' --out calib-fp8/
  kvpack export vllm --artifact calib/ --out vllm-scales/
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="observe keys and values on calibration text and save static scales (an artifact)",
        description="Static calibration: per-channel key and value ranges, saved with a model fingerprint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="local Hugging Face model folder, or a registered test model such as gemma3-270m "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--samples", type=int_in(1, 1 << 20), default=16, help="calibration windows (default 16)")
    p.add_argument("--seq-len", type=int_in(2, 1 << 20), default=256, help="tokens per window (default 256)")
    p.add_argument(
        "--percentile",
        type=real_in(0.0, 100.0, lo_open=True),
        action="append",
        metavar="P",
        help="record this percentile of magnitudes (repeatable; 99.9 and 99.99 are always recorded)",
    )
    p.add_argument(
        "--range", dest="source", metavar="SOURCE", help="scale source: rope, absmax or p<P> (default: see below)"
    )
    p.add_argument(
        "--format",
        type=fmt,
        default=None,
        help="the format the static scales are for (default: int8 keys per channel, static; int8 values per token)",
    )
    p.add_argument("--seed", type=int, default=0, help="picks the calibration windows (default 0)")
    p.add_argument("--batch-size", type=int_in(1, 1 << 16), default=4, help="windows per forward pass (default 4)")
    p.add_argument("--out", type=out_dir, required=True, help="artifact folder to write (replaced whole if it exists)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from kvpack.calibration.artifact import MANIFEST_NAME
    from kvpack.calibration.observer import parse_source
    from kvpack.calibration.run import DEFAULT_FORMAT, calibrate, default_source, load_model
    from kvpack.formats import parse_format

    extra = [float(p) for p in (args.percentile or [])]
    if any(p >= 100 for p in extra):
        raise ConfigError(f"--percentile must be below 100 (100 is the abs-max: use --range absmax), got {extra}")
    fmt = parse_format(args.format or DEFAULT_FORMAT)  # a bad format fails before the model loads
    source = args.source or (f"p{extra[0]:g}" if extra else default_source(fmt))
    if source not in ("absmax", "rope"):
        parse_source(source)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.seq_len > limit:  # checked before hours of calibration, not after
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's {limit} positions; give at most {limit}")
    with torch.no_grad():
        art = calibrate(
            model,
            tokenizer,
            samples=args.samples,
            seq_len=args.seq_len,
            seed=args.seed,
            percentiles=sorted({99.9, 99.99, *extra}),
            format=fmt,
            source=source,
            batch_size=args.batch_size,
        )
    out = art.save(args.out)
    if args.json:
        print((out / MANIFEST_NAME).read_text(), end="")
        return 0
    fp = art.fingerprint
    k_amax = art.keys.absmax.flatten(1).amax(1)
    v_amax = art.values.absmax.flatten(1).amax(1)
    print(
        f"calibrated {fp['architecture']} ({fp['num_layers']} layers, {fp['kv_heads']} kv heads, head_dim "
        f"{fp['head_dim']}) on {args.samples} x {args.seq_len} tokens of {art.data['name']} "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    print(
        f"format {fmt.name}; scale source {source}; static scales for: "
        + (", ".join(r for r, s in (("keys", art.key_scales), ("values", art.value_scales)) if s) or "none")
    )
    print(
        f"key abs-max per layer: {float(k_amax.min()):.3g} .. {float(k_amax.max()):.3g}; "
        f"value abs-max: {float(v_amax.min()):.3g} .. {float(v_amax.max()):.3g}"
    )
    print(
        "query statistics: "
        + (
            "recorded (formats with query-ranked outlier channels, o<N>q, can use this artifact)"
            if art.query_energy is not None
            else "none (the model's attention does not go through transformers' attention interface; o<N>q formats "
            "cannot use this artifact)"
        )
    )
    print(
        f"wrote {out}/ ({MANIFEST_NAME} + tensors); use it with format {json.dumps(fmt.name)}, e.g. "
        f"`kvpack eval --formats {fmt.name} --calibration {out}` (other static formats get scales recomputed "
        "from its statistics)"
    )
    return 0
