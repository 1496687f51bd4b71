"""``kvpack bench generate``: end-to-end decode speed and cache memory of the embedded model, per cache.

Providers, measured in the same run on the same prefilled context:

* ``dynamic``: transformers' ``DynamicCache`` (full precision, SDPA attention);
* the peers (:mod:`kvpack.bench.peers`): transformers' ``QuantizedCache`` with the ``quanto`` backend at 4
  and 2 bits and the ``hqq`` backend at 4 bits (``pip install 'kvpack[peers]'``), and any other backend the
  installed transformers has; they dequantize the whole history every step;
* ``kvpack-<format>``: :class:`kvpack.integrations.transformers.KVPackCache` with the fused decode kernel.

The context is prefilled once (batch 1, SDPA, DynamicCache); every provider's cache is then filled with the
same keys and values, repeated over the batch, so prefill time never pollutes decode numbers. Each provider
then decodes ``--new-tokens`` greedy steps (after one untimed warm-up step): tokens/s counts every row.
Each row runs in a fresh process (``--isolation process``, the default) that loads the model and the saved
prefill, so no row inherits another's allocator state, thread pools or thread count.
Cache bytes are compared with :meth:`kvpack.formats.KVFormat.bytes_for_tokens` (what ``kvpack size`` uses).

Time-to-first-token (``--ttft-rounds``): the context as one prompt from an empty cache, batch 1, DynamicCache
against each kvpack format (whose prompt attends its own quantized keys through the fused chunk kernel),
alternated round by round; with ``--isolation process`` each provider's call of a round runs in a fresh process
after one untimed call there. In one process the baseline would not be what transformers gives: once numba's
``omp`` thread pool has started (the first kvpack kernel call), torch's CPU flash attention runs up to 5x slower
in that process (numba's pool loads the system's libgomp beside the one torch bundles; docs/kernels.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpack.errors import ConfigError
from kvpack.fsutil import atomic_write_text

__all__ = ["add_arguments", "measure", "run", "worker"]

_TEXT = (
    "The lighthouse keeper wrote down the weather every hour: wind from the west, light rain, a ship passing "
    "north at dusk, the lamp trimmed at nine. Numbers, names and small events filled the log for years. "
)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes a comma list of positive integers, got {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise ConfigError(f"{flag} takes a comma list of positive integers, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvpack bench generate``."""
    parser.add_argument("--model", help="local Hugging Face model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--context", type=int, default=4096, help="prefilled tokens per sequence (default 4096)")
    parser.add_argument("--batch", default="1,8", help="comma list of batch sizes (default 1,8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="timed decode steps (default 64)")
    parser.add_argument("--formats", default="int8,int4", help="kvpack formats, comma list (default int8,int4)")
    parser.add_argument("--backend", default="auto", help="kvpack decode backend (default auto)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch (and kernel) threads; default: torch's current setting"
    )
    parser.add_argument(
        "--skip",
        default="",
        help="providers to leave out, comma list: dynamic, quantized (every peer), kvpack, or a peer's name "
        "(quanto-int4, quanto-int2, hqq-int4, fp8)",
    )
    parser.add_argument(
        "--isolation",
        choices=("process", "none"),
        default="process",
        help="process: each row in a fresh process (default); none: every row in this one, one after another",
    )
    parser.add_argument(
        "--ttft-rounds",
        type=int,
        default=3,
        help="time-to-first-token of the context as one prompt (batch 1), DynamicCache and each kvpack format "
        "alternated for this many rounds (with --isolation process, each call in a fresh process); 0 skips it "
        "(default 3)",
    )
    parser.add_argument("--quick", action="store_true", help="small run: context 512, batch 1,2, 16 new tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


# ----------------------------------------------------------------------------------------------------
# Providers: each fills a cache with the prefilled K/V and knows its attention implementation and bytes


def _dense_bytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def _fill(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], batch: int) -> None:
    for i, (k, v) in enumerate(kv):
        cache.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), i)


# ----------------------------------------------------------------------------------------------------


def _prompt(tokenizer: Any, n: int) -> torch.Tensor:
    ids = tokenizer(_TEXT * (n // 20 + 2), return_tensors="pt")["input_ids"][:, :n]
    if ids.shape[1] < n:
        raise ConfigError(f"could not build a {n}-token prompt")
    return ids


@torch.inference_mode()
def _prefill(model: Any, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, float]:
    from transformers import DynamicCache

    from kvpack.integrations.transformers import cache_kwarg

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache}
    t0 = time.perf_counter()
    out = model(input_ids=ids, **kw, use_cache=True, logits_to_keep=1)
    dt = time.perf_counter() - t0
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return kv, out.logits[:, -1].argmax(-1), dt


@torch.inference_mode()
def _decode(model: Any, cache: Any, first: torch.Tensor, batch: int, steps: int) -> tuple[float, list[float]]:
    from kvpack.integrations.transformers import cache_kwarg

    tok = first.view(1, 1).expand(batch, 1).contiguous()
    kw = {cache_kwarg(model): cache}
    per_step = []
    for i in range(steps + 1):  # step 0 warms up (first-call compilation, allocator)
        t0 = time.perf_counter()
        out = model(input_ids=tok, **kw, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        if i:
            per_step.append(time.perf_counter() - t0)
    return sum(per_step), per_step


@torch.inference_mode()
def _first_token(model: Any, ids: torch.Tensor, fmt: Any, backend: str) -> float:
    """Seconds from an empty cache to the first token of prompt ``ids`` ``[1, n]``: DynamicCache with SDPA
    (``fmt`` None) or a :class:`KVPackCache` of ``fmt`` (the prompt attends its own quantized keys through the
    fused chunk kernel), the cache built inside the timed region as ``generate`` builds it."""
    from transformers import DynamicCache

    from kvpack.integrations.transformers import KVPackCache, cache_kwarg

    t0 = time.perf_counter()
    if fmt is None:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        model.set_attn_implementation("kvpack")
        cache = KVPackCache(model.config, fmt, max_tokens=ids.shape[1] + 1, batch_size=1, backend=backend)
    out = model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    out.logits[:, -1].argmax(-1)
    return time.perf_counter() - t0


def _ttft_rows(
    model: Any,
    ids: torch.Tensor,
    formats: list[Any],
    backend: str,
    rounds: int,
    isolated: Callable[[str | None], float] | None = None,
) -> list[dict]:
    """Time-to-first-token per provider, the providers alternated ``rounds`` times; medians, with the ratio to
    DynamicCache's. In this process (``isolated`` None) after one untimed call of each provider (kernel
    compilation, allocator); else ``isolated(format_name)`` times one call in a fresh process (None: DynamicCache)."""
    providers = [("dynamic", None)] + [(f"kvpack-{f.name}", f) for f in formats]
    times: dict[str, list[float]] = {name: [] for name, _ in providers}
    for r in range(rounds + (isolated is None)):
        for name, fmt in providers:
            if isolated is not None:
                times[name].append(isolated(None if fmt is None else fmt.name))
                continue
            dt = _first_token(model, ids, fmt, backend)
            if r:
                times[name].append(dt)
    model.set_attn_implementation("sdpa")
    base = statistics.median(times["dynamic"])
    return [
        {
            "provider": name,
            "prompt_tokens": int(ids.shape[1]),
            "ttft_ms": 1000 * statistics.median(t),
            "vs_dynamic": statistics.median(t) / base,
            "rounds": rounds,
        }
        for name, t in times.items()
    ]


def _settle_allocator() -> None:
    """Put glibc's allocator where a ``model.generate`` process has it when it decodes: one freed 31 MiB block
    raises glibc's mmap threshold (dynamic, up to 32 MiB) to that size, as the batch prefill's freed activations
    do in ``generate``. Without it, every decode step's ``torch.cat`` of a growing DynamicCache (25 MiB per layer
    and K or V at batch 8, 4k context) came from fresh ``mmap`` pages, zeroed by the kernel on first touch:
    DynamicCache ran at 450 ms/step against ``model.generate``'s 329 on the 2-core VM
    (``benchmarks/generate_baseline.py``). kvpack's pools are allocated once, so only the baselines moved."""
    block = torch.empty(31 * 2**20, dtype=torch.uint8)
    block[::4096] = 1  # touched, so the pages are really mapped before the free
    del block


@torch.inference_mode()
def measure(
    model: Any,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    first: torch.Tensor,
    provider: dict,
    batch: int,
    new_tokens: int,
    backend: str = "auto",
) -> dict:
    """One row: fill ``provider``'s cache with the prefilled ``kv`` repeated over ``batch``, then time
    ``new_tokens`` greedy decode steps (after one untimed step).

    Args:
        model: the causal LM.
        kv: per layer, the prefilled ``(keys, values)``, each ``[1, kv_heads, context, head_dim]``.
        first: the token after the context, ``[1]`` int64.
        provider: ``{"kind": "dynamic"}``, ``{"kind": "peer", "name": "quanto-int4"}`` (a name of
            :data:`kvpack.bench.peers.PEERS`) or ``{"kind": "kvpack", "format": "int4"}``.
        batch: sequences.
        new_tokens: timed steps.
        backend: kvpack's decode backend.

    Returns:
        the row: provider, batch, context, tokens/s, median ms per step, the timed steps' count, cache bytes
        (and, for kvpack, the predicted bytes and the decode backends that ran).
    """
    from transformers import DynamicCache

    from kvpack.bench.peers import PEERS, make_cache, quantized_bytes
    from kvpack.formats import parse_format
    from kvpack.integrations.transformers import KVPackCache

    context = int(kv[0][0].shape[2])
    extra: dict[str, Any] = {}
    _settle_allocator()
    if provider["kind"] == "kvpack":
        fmt = parse_format(provider["format"])
        name, tokens = f"kvpack-{fmt.name}", context + new_tokens + 1
        cache = KVPackCache(model.config, fmt, max_tokens=tokens, batch_size=batch, backend=backend)
        attn = "kvpack"
    elif provider["kind"] == "peer":
        peer = next(p for p in PEERS if p.name == provider["name"])
        name, cache, attn = peer.name, make_cache(peer, model.config), "sdpa"
    else:
        name, cache, attn = "dynamic", DynamicCache(config=model.config), "sdpa"
    _fill(cache, kv, batch)
    model.set_attn_implementation(attn)
    try:
        total, steps = _decode(model, cache, first, batch, new_tokens)
    finally:
        model.set_attn_implementation("sdpa")
    if provider["kind"] == "kvpack":
        tail_bytes = torch.empty((), dtype=cache.paged.tail_dtype).element_size()
        predicted = batch * fmt.bytes_for_tokens(
            tokens, cache.kv_heads, cache.head_dim, cache.num_layers, tail_element_bytes=tail_bytes
        )
        nbytes = cache.bytes_summary()["used_bytes"]
        extra = {
            "predicted_bytes": predicted,
            "predicted_error": nbytes / predicted - 1,
            "fused_decode_calls": cache.fused_decode_calls,
            "backends": dict(cache.decode_backends),
        }
    elif provider["kind"] == "peer":
        nbytes = quantized_bytes(cache)
    else:
        nbytes = _dense_bytes(cache)
    return {
        "provider": name,
        "batch": batch,
        "context": context,
        "new_tokens": new_tokens,
        "tokens_per_s": batch * new_tokens / total,
        "ms_per_step_median": 1000 * statistics.median(steps),
        "steps": len(steps),
        "cache_bytes": nbytes,
        **extra,
    }


def worker(argv: list[str] | None = None) -> int:
    """One row in a fresh process (``--isolation process``): ``argv[0]`` is a JSON file naming the model, the
    thread count, the saved prefill (``torch.save`` of ``{"kv": ..., "first": ...}``), the provider, batch,
    steps and backend, and where to write the row (JSON)."""
    spec = json.loads(Path((sys.argv[1:] if argv is None else argv)[0]).read_text())
    torch.set_num_threads(spec["threads"])
    from kvpack.models import load_model

    model, _ = load_model(spec["model"])
    if "ttft_format" in spec:  # one provider's time to first token: an untimed call, then the timed one
        from kvpack.formats import parse_format

        ids = torch.load(spec["ids"], weights_only=True)
        fmt = None if spec["ttft_format"] is None else parse_format(spec["ttft_format"])
        _first_token(model, ids, fmt, spec["backend"])
        atomic_write_text(spec["out"], json.dumps({"seconds": _first_token(model, ids, fmt, spec["backend"])}))
        return 0
    saved = torch.load(spec["prefill"], weights_only=True)
    row = measure(
        model, saved["kv"], saved["first"], spec["provider"], spec["batch"], spec["new_tokens"], spec["backend"]
    )
    atomic_write_text(spec["out"], json.dumps(row))  # the parent reads it only once this process has exited
    return 0


def _isolated(spec: dict, folder: Path, index: int) -> dict:
    """:func:`measure` in a fresh Python process (the same interpreter and kvpack); a failed run returns
    ``{"error": ...}`` with the end of its stderr."""
    import kvpack

    spec = {**spec, "out": str(folder / f"row{index}.json")}
    path = folder / f"spec{index}.json"
    atomic_write_text(path, json.dumps(spec))
    env = dict(os.environ)
    root = str(Path(kvpack.__file__).resolve().parents[1])  # the parent's kvpack, also from a source tree
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from kvpack.bench.generate import worker; sys.exit(worker([sys.argv[1]]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return {"error": f"exit status {proc.returncode}: {lines[-1] if lines else 'no output'}"}
    return json.loads(Path(spec["out"]).read_text())


def _ttft_isolated(base: dict, folder: Path, fmt: str | None) -> float:
    """Seconds to the first token of provider ``fmt`` (None: DynamicCache) in a fresh process (:func:`worker`)."""
    index = len(list(folder.glob("spec*.json")))
    row = _isolated({**base, "ttft_format": fmt}, folder, index)
    if "error" in row:
        raise RuntimeError(f"time to first token of {fmt or 'DynamicCache'} failed: {row['error']}")
    return float(row["seconds"])


def run(args: argparse.Namespace) -> int:
    """Run the sweep; print a table (or JSON with ``--json``)."""
    import transformers

    from kvpack.bench.peers import PEERS, available_peers, peer_reasons
    from kvpack.formats import parse_format
    from kvpack.models import load_model

    if args.quick:
        args.context, args.batch, args.new_tokens = min(args.context, 512), "1,2", min(args.new_tokens, 16)
    if args.context <= 0 or args.new_tokens <= 0:
        raise ConfigError("--context and --new-tokens must be positive")
    if args.ttft_rounds < 0:
        raise ConfigError(f"--ttft-rounds must be 0 or more, got {args.ttft_rounds}")
    batches = _int_list(args.batch, "--batch")
    if args.threads is not None:
        if args.threads <= 0:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    names = [f.strip() for f in args.formats.split(",") if f.strip()]
    formats = [parse_format(f) for f in names]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    model, tokenizer = load_model(args.model)
    if "kvpack" not in skip and args.backend in ("auto", "cpu"):
        from kvpack.kernels.warmup import compile_if_cold

        compile_if_cold(lambda line: print(line, file=sys.stderr, flush=True))
    ids = _prompt(tokenizer, args.context)
    kv, first, prefill_s = _prefill(model, ids)
    if "quantized" in skip:
        peers, missing, unsupported = [], [], []
    else:
        peers, missing, unsupported = available_peers(model.config, [p.name for p in PEERS if p.name not in skip])
    providers = [{"kind": "dynamic", "name": "dynamic"}] if "dynamic" not in skip else []
    providers += [{"kind": "peer", "name": p.name} for p in peers]
    if "kvpack" not in skip:
        providers += [{"kind": "kvpack", "name": f"kvpack-{f.name}", "format": n} for n, f in zip(names, formats)]
    _, kv_heads, context, head_dim = kv[0][0].shape
    threads = torch.get_num_threads()
    rows: list[dict] = []
    not_run: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvpack-bench-") as tmp:
        prefill_path = Path(tmp) / "prefill.pt"
        if args.isolation == "process":
            torch.save({"kv": kv, "first": first}, prefill_path)
        for batch in batches:
            for prov in providers:
                why = peer_reasons(batch, kv_heads, context, head_dim) if prov["kind"] == "peer" else []
                if why:
                    not_run.append(f"{prov['name']} batch {batch}: {'; '.join(why)}")
                    continue
                if args.isolation == "none":
                    rows.append(measure(model, kv, first, prov, batch, args.new_tokens, args.backend))
                    continue
                spec = {
                    "model": args.model,
                    "threads": threads,
                    "prefill": str(prefill_path),
                    "provider": prov,
                    "batch": batch,
                    "new_tokens": args.new_tokens,
                    "backend": args.backend,
                }
                row = _isolated(spec, Path(tmp), len(rows) + len(not_run))
                if "error" in row:
                    not_run.append(f"{prov['name']} batch {batch}: failed ({row['error']})")
                else:
                    rows.append(row)
        model.set_attn_implementation("sdpa")
        isolated = None
        if args.isolation == "process" and args.ttft_rounds:
            torch.save(ids, Path(tmp) / "ids.pt")
            base = {"model": args.model, "threads": threads, "ids": str(Path(tmp) / "ids.pt"), "backend": args.backend}
            isolated = functools.partial(_ttft_isolated, base, Path(tmp))
        ttft = _ttft_rows(model, ids, formats, args.backend, args.ttft_rounds, isolated) if args.ttft_rounds else []
    result = {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "dtype": str(model.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "isolation": args.isolation,
        "transformers": transformers.__version__,
        "prefill_s": prefill_s,
        "peers": [p.name for p in peers],
        "peers_missing": missing,
        "peers_not_in_transformers": unsupported,
        "not_run": not_run,
        "rows": rows,
        "ttft": ttft,
        "checks": _checks(rows, {p.name for p in peers}) + _ttft_checks(ttft),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _checks(rows: list[dict], peers: set[str]) -> list[dict]:
    """The issue's targets, per batch: int4 vs DynamicCache and vs each QuantizedCache peer, memory vs
    prediction."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        by = {r["provider"]: r for r in rows if r["batch"] == batch}
        int4 = by.get("kvpack-int4")
        if int4 is None:
            continue
        dyn = by.get("dynamic")
        if dyn:
            ratio = int4["tokens_per_s"] / dyn["tokens_per_s"]
            out.append({"batch": batch, "check": "int4 >= 1.0x DynamicCache", "value": ratio, "ok": ratio >= 1.0})
        for name in sorted(peers & set(by)):
            ratio = int4["tokens_per_s"] / by[name]["tokens_per_s"]
            out.append({"batch": batch, "check": f"int4 >= 3x {name}", "value": ratio, "ok": ratio >= 3.0})
    for r in rows:
        if "predicted_error" in r:
            err = r["predicted_error"]
            out.append(
                {
                    "batch": r["batch"],
                    "check": f"{r['provider']} bytes within 2% of prediction",
                    "value": err,
                    "ok": abs(err) <= 0.02,
                }
            )
    return out


def _ttft_checks(ttft: list[dict]) -> list[dict]:
    """Time-to-first-token of each kvpack format within 1.1x of DynamicCache's."""
    return [
        {
            "batch": 1,
            "check": f"{r['provider']} time-to-first-token <= 1.1x DynamicCache",
            "value": r["vs_dynamic"],
            "ok": r["vs_dynamic"] <= 1.1,
        }
        for r in ttft
        if r["provider"] != "dynamic"
    ]


def _print_table(result: dict) -> None:
    print(
        f"kvpack bench generate: {result['model']} ({result['dtype']}, {result['threads']} threads, transformers "
        f"{result['transformers']}), prefill {result['prefill_s']:.1f} s, each row in "
        f"{'a fresh process' if result['isolation'] == 'process' else 'this process'}"
    )
    for line in result["peers_missing"]:
        print(f"peer not run: {line}")
    for line in result["not_run"]:
        print(f"row not run: {line}")
    head = f"{'provider':<18}{'batch':>6}{'context':>9}{'tok/s':>10}{'ms/step':>10}{'cache MiB':>11}{'pred MiB':>10}"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        pred = f"{r['predicted_bytes'] / 2**20:10.2f}" if "predicted_bytes" in r else f"{'':>10}"
        print(
            f"{r['provider']:<18}{r['batch']:>6}{r['context']:>9}{r['tokens_per_s']:>10.1f}"
            f"{r['ms_per_step_median']:>10.1f}{r['cache_bytes'] / 2**20:>11.2f}{pred}"
        )
        if r.get("backends") and set(r["backends"]) == {"reference"}:
            print(f"{'':<18}  (decode ran on the slow reference path: no fused kernel for this case)")
    if result["ttft"]:
        print(f"time to first token, {result['ttft'][0]['prompt_tokens']}-token prompt, batch 1:")
        for r in result["ttft"]:
            print(f"  {r['provider']:<18}{r['ttft_ms']:>10.1f} ms  {r['vs_dynamic']:.2f}x DynamicCache")
    for c in result["checks"]:
        mark = "ok  " if c["ok"] else "MISS"
        print(f"[{mark}] batch {c['batch']}: {c['check']}: {c['value']:.3f}")
