"""``kvpack size``: how big the cache gets in each format, what fits, and whether it is worth shrinking."""

from __future__ import annotations

import argparse
import json
import re

from kvpack.errors import ConfigError, FormatError
from kvpack.formats import PerGroup
from kvpack.sizing import MODEL_DTYPE_BYTES, vllm_layers_per_block

EPILOG = """\
sizes accept k = 1024 and m = 1024*1024: --context 8k, 128k, 1m.
--format repeats, or takes a comma list of presets (--format int8,int4); a custom format keeps its own
commas, so give each custom one with its own --format ('k=int8,v=int4:g32,block=32').
cache figures include each sequence's one-block fp16 tail per layer; bytes/token is the sealed rate.
examples:
  kvpack size --model llama-3.1-70b --context 128k --batch 4
  kvpack size --layers 80 --kv-heads 8 --head-dim 128 --context 8k --batch 32 --format fp16,int8,int4
  kvpack size --model path/to/config.json --context 32k --gpu-mem 80 --shared-prefix 4k --json
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "size",
        help="cache size per format, what fits on a GPU, and whether quantizing pays",
        description="Capacity planning from the byte formula (scales, zero-points, padding and tails counted).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="built-in model name (e.g. llama-3.1-8b) or a config.json path or folder")
    p.add_argument("--layers", help="number of layers (instead of --model)")
    p.add_argument("--kv-heads", help="key/value heads per layer (instead of --model)")
    p.add_argument("--head-dim", help="head dimension (instead of --model)")
    p.add_argument("--context", help="tokens per sequence, e.g. 8192, 8k, 128k, 1m (required)")
    p.add_argument("--batch", default="1", help="sequences held at once (default 1)")
    p.add_argument(
        "--format",
        action="append",
        dest="formats",
        metavar="F",
        help="a preset or custom format; repeat, or a comma list of presets (default: all presets; 'peers': "
        "other systems' layouts, llamacpp-q4_0, vllm-int4, ...)",
    )
    p.add_argument("--gpu-mem", help="GPU memory in GiB (80, 141) or with a unit (80GB, 141GiB)")
    p.add_argument("--weights-gib", help="weights' size in GiB (default: parameter count x 2 bytes)")
    p.add_argument("--shared-prefix", help="tokens at the start of every sequence that could be stored once")
    p.add_argument(
        "--vllm-space",
        help="KV cache space given to vLLM (kv_cache_memory_bytes), e.g. 40GiB or 268435456B: adds the tokens vLLM "
        "holds with the kvpack backend in each format and with its own cache",
    )
    p.add_argument("--max-num-seqs", default="256", help="vLLM's max_num_seqs: the kvpack tails it pays for (256)")
    p.add_argument(
        "--num-speculative-tokens",
        default="0",
        help="vLLM's num_speculative_tokens (default 0): with drafts the kvpack backend keeps two tail slots per "
        "request",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(MODEL_DTYPE_BYTES),
        default="bfloat16",
        help="the model's activation dtype under vLLM: its tails, sink rows and own cache (default bfloat16)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--list-models", action="store_true", help="list the built-in model shapes and exit")


_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|tib|tb|mib|mb|b)?\s*$", re.IGNORECASE)
_MEM_UNITS = {None: 1024**3, "gib": 1024**3, "gb": 10**9, "tib": 1024**4, "tb": 10**12, "mib": 2**20, "mb": 10**6,
              "b": 1}  # fmt: skip


def parse_mem(text: str, flag: str) -> int:
    """``80`` or ``80GiB`` -> bytes (GiB), ``80GB`` -> decimal bytes."""
    m = _MEM.match(str(text))
    if not m:
        raise ConfigError(f"{flag} must be a size in GiB like 80 or 141GiB (or 80GB), got {text!r}")
    n = int(float(m.group(1)) * _MEM_UNITS[m.group(2).lower() if m.group(2) else None])
    if n <= 0 and flag != "--weights-gib":
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    return n


def _positive_int(text: str, flag: str, zero: bool = False) -> int:
    """``text`` as an integer above 0 (``zero``: 0 or above), else a ConfigError naming ``flag``."""
    if not re.fullmatch(r"\s*\d+\s*", str(text)) or int(text) < (0 if zero else 1):
        what = "a whole number (0 or more)" if zero else "a positive integer"
        raise ConfigError(f"{flag} must be {what}, got {text!r}")
    return int(text)


def _model(args: argparse.Namespace):
    from kvpack.modelspecs import ModelShape, load_model_shape

    shape_args = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    given = [k for k, v in shape_args.items() if v is not None]
    if args.model is not None:
        if given:
            raise ConfigError(f"give either --model or the shape ({', '.join(given)}), not both")
        return load_model_shape(args.model)
    if len(given) < 3:
        missing = [k for k in shape_args if k not in given]
        raise ConfigError(
            f"missing {', '.join(missing)}: give --model NAME_OR_CONFIG_JSON or all of --layers, --kv-heads, --head-dim"
        )
    return ModelShape(
        name="custom shape",
        layers=_positive_int(args.layers, "--layers"),
        kv_heads=_positive_int(args.kv_heads, "--kv-heads"),
        head_dim=_positive_int(args.head_dim, "--head-dim"),
    )


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def render(p) -> str:
    """The plain-text report of a :class:`kvpack.sizing.SizeEstimate`."""
    from kvpack.sizing import GIB

    m = p.model
    params = f", {m.params / 1e9:.3g}B params{' (estimated)' if m.params_estimated else ''}" if m.params else ""
    out = [
        f"{m.name}: {m.layers} {'attention ' if m.state_layers else ''}layers, {m.kv_heads} kv heads, head_dim "
        f"{m.head_dim}{params}",
        f"context {p.context:,} tokens x batch {p.batch}",
        "",
    ]
    # small caches read better in MiB
    unit, div = ("GiB", GIB) if p.fp16_total_bytes >= GIB else ("MiB", 1024**2)
    header = ["format", "bits/elem", "bytes/token", f"cache {unit}", "saving"]
    if p.cache_budget_bytes is not None:
        header += ["max batch", "max context"]
    if p.shared_prefix is not None:
        header += [f"shared-prefix {unit}"]
    if p.vllm is not None:
        header += ["vLLM tokens"]
    rows = [header]
    for r in p.rows:
        row = [
            r.format.name,
            f"{r.bits_per_element:.4f}",
            f"{r.bytes_per_token:,.0f}" if r.bytes_per_token == int(r.bytes_per_token) else f"{r.bytes_per_token:,.2f}",
            f"{r.total_bytes / div:,.3f}",
            f"{1 / r.ratio_vs_fp16:.2f}x",
        ]
        if p.cache_budget_bytes is not None:
            row += [f"{r.max_batch:,}", f"{r.max_context:,}"]
        if p.shared_prefix is not None:
            row += [f"{r.shared_prefix_total_bytes / div:,.3f}"]
        if p.vllm is not None:  # none: the backend does not serve it (a plan on a model with sliding-window layers)
            row += ["refused" if r.vllm_tokens is None else f"{r.vllm_tokens:,}"]
        rows.append(row)
    out += _table(rows, right=set(range(1, len(header))))
    out += [
        "",
        "bytes/token: sealed blocks only (payload + scales + zero-points + padding + outlier residuals, all layers);",
        f"cache {unit}: sealed blocks plus each sequence's fp16 tail of one block per layer (tail included);",
        "saving: fp16 cache / this cache.",
    ]
    by_sink: dict[tuple[int, int], list[str]] = {}  # formats with the same sink share one line
    for r in p.rows:
        if r.format.sink:
            by_sink.setdefault((r.format.sink, r.sink_bytes_per_sequence), []).append(r.format.name)
    for (n, nbytes), names in by_sink.items():
        what = "position" if n == 1 else f"{n} positions"
        out.append(
            f"sink: {', '.join(names)} also keep each sequence's first {what} (the attention sink) in fp16, "
            f"{nbytes:,} bytes per sequence (all layers; in the cache column)."
        )
    if m.state_layers:
        out.append(
            f"hybrid: {m.state_layers} more layers keep a fixed-size state (linear attention, Mamba), not keys and "
            "values: no format changes them, and they are not in these sizes."
        )
    narrowed: dict[tuple[int, int], list[str]] = {}  # g<N> groups that do not divide head_dim (PerGroup.groups)
    for r in p.rows:
        fmts = getattr(r.format, "distinct_formats", None) or [r.format]  # a plan: each of its formats
        for spec in (s for f in fmts for s in (f.key, f.value)):
            g = spec.granularity
            if isinstance(g, PerGroup) and m.head_dim % g.size:
                names = narrowed.setdefault((g.size, g.width(m.head_dim)), [])
                if r.format.name not in names:
                    names.append(r.format.name)
    for (size, width), names in narrowed.items():
        out.append(
            f"groups: {', '.join(names)}: g{size} does not divide head_dim {m.head_dim}, so each token's channels are "
            f"{m.head_dim // width} groups of {width} (narrower, never wider; the extra scales are in the bits)."
        )
    if p.cache_budget_bytes is not None:
        out.append(
            f"memory: {p.gpu_mem_bytes / GIB:,.2f} GiB GPU - {(p.weights_bytes or 0) / GIB:,.2f} GiB weights = "
            f"{p.cache_budget_bytes / GIB:,.2f} GiB for the cache (activations and workspace not counted); "
            f"max batch at context {p.context:,}, max context at batch {p.batch}."
        )
    if p.shared_prefix is not None:
        out.append(
            f"shared-prefix {unit}: the first {p.shared_prefix:,} tokens' whole blocks stored once, not {p.batch}x."
        )
    if p.vllm is not None:
        v = p.vllm
        out.append(
            f"vLLM tokens: what vLLM holds in {v.space_bytes / 2**20:,.1f} MiB of KV space with the kvpack backend: "
            f"pages of the format's blocks with the sink rows in every page, after full-precision tails for "
            f"max_num_seqs={v.seqs} requests{' (two each: speculative decoding)' if v.speculative else ''}; vLLM's own "
            f"cache ({v.act_bytes}-byte elements) holds {v.default_tokens:,}."
        )
        by_tails: dict[int, list[str]] = {}  # the tails' share of the space, and where they cost more than they buy
        for r in p.rows:
            if r.vllm_tail_bytes is not None:
                by_tails.setdefault(r.vllm_tail_bytes, []).append(r.format.name)
        for nbytes, names in by_tails.items():
            out.append(
                f"tails: {', '.join(names)}: {nbytes / 2**20:,.1f} MiB of the {v.space_bytes / 2**20:,.1f} MiB "
                f"({nbytes / v.space_bytes:.0%}) for max_num_seqs={v.seqs} requests"
                f"{' (two slots each: speculative decoding)' if v.speculative else ''}."
            )
        short = [r.format.name for r in p.rows if r.vllm_tokens is not None and r.vllm_tokens < v.default_tokens]
        if short:
            out.append(
                f"fewer tokens than vLLM's own cache: {', '.join(short)}: the tails cost more than the format saves in "
                "this space; give more space, or a lower --max-num-seqs if fewer requests run at once."
            )
        for field, what, why in (
            ("vllm_smaller_block", "smaller blocks", "shorter full-precision tails, more scale bytes per sealed token; "
             "the kvpack backend serves these unless the format names block= or vLLM is given a block size"),
            ("vllm_float16_tails", "float16 tails", "the float32 model's tails and sink rows in float16, half their "
             "bytes: docs/formats.md, 'tail='"),
        ):  # fmt: skip
            found = [(r.format.name, *getattr(r, field)) for r in p.rows if getattr(r, field) is not None]
            if found:
                named = ", ".join(f"{name} -> '{other.name}' {tokens:,}" for name, other, tokens in found)
                out.append(f"{what} hold more tokens here: {named} (vLLM tokens; {why}).")
        refused = [r for r in p.rows if r.vllm_refused]
        if refused:
            out.append(f"refused ({', '.join(r.format.name for r in refused)}): {refused[0].vllm_refused}.")
        per_block = vllm_layers_per_block(p.model.layers, p.model.windows)
        if per_block != p.model.layers:
            out.append(
                f"sliding-window layers: vLLM splits the {p.model.layers} layers into groups of {per_block} by "
                f"attention type, each with its own block table over one pool of block ids; the tokens are block ids "
                f"x block size, a block id costing pages in {per_block} layers (a request holds blocks in every "
                "group, the sliding ones only for its window)."
            )
    for s in p.skipped:
        out.append(f"skipped {s}")
    out += [f"advice: {a}" for a in p.advice]
    return "\n".join(out)


def list_models() -> str:
    from kvpack.modelspecs import KNOWN_MODELS

    rows = [["model", "layers", "kv heads", "head_dim", "params"]]
    for m in KNOWN_MODELS.values():
        rows.append([m.name, str(m.layers), str(m.kv_heads), str(m.head_dim), f"{m.params / 1e9:.3g}B"])
    return "\n".join(_table(rows, right={1, 2, 3, 4}))


def _vllm(args: argparse.Namespace) -> tuple[int, int, int] | None:
    if args.vllm_space is None:
        return None
    act = MODEL_DTYPE_BYTES[args.dtype]
    return parse_mem(args.vllm_space, "--vllm-space"), _positive_int(args.max_num_seqs, "--max-num-seqs"), act


def run(args: argparse.Namespace) -> int:
    from kvpack.sizing import estimate, parse_count, parse_formats

    if args.list_models:
        print(list_models())
        return 0
    if args.context is None:
        raise ConfigError("missing --context: how many tokens per sequence (e.g. --context 8k)")
    model = _model(args)
    context = parse_count(args.context, "--context")
    batch = parse_count(args.batch, "--batch")
    prefix = parse_count(args.shared_prefix, "--shared-prefix") if args.shared_prefix is not None else None
    try:
        formats = parse_formats(args.formats)
    except FormatError as e:
        raise ConfigError(f"--format: {e}") from None
    result = estimate(
        model,
        context,
        batch,
        formats,
        gpu_mem_bytes=parse_mem(args.gpu_mem, "--gpu-mem") if args.gpu_mem is not None else None,
        weights_bytes=parse_mem(args.weights_gib, "--weights-gib") if args.weights_gib is not None else None,
        shared_prefix=prefix,
        skip_invalid=not args.formats,  # explicit formats must all work; the default list drops misfits
        vllm=_vllm(args),
        speculative=_positive_int(args.num_speculative_tokens, "--num-speculative-tokens", zero=True),
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(render(result))
    return 0
