"""``kvpack bench generate``: end-to-end decode speed and cache memory of the embedded model, per cache.

Providers, measured in the same run on the same prefilled context:

* ``dynamic``: transformers' ``DynamicCache`` (full precision, SDPA attention);
* ``quantized-<backend>``: transformers' ``QuantizedCache`` with the first backend that works here
  (``quanto`` or ``hqq`` when their packages are installed, else ``fp8``); it dequantizes the whole history
  every step;
* ``kvpack-<format>``: :class:`kvpack.integrations.transformers.KVPackCache` with the fused decode kernel.

The context is prefilled once (batch 1, SDPA, DynamicCache); every provider's cache is then filled with the
same keys and values, repeated over the batch, so prefill time never pollutes decode numbers. Each provider
then decodes ``--new-tokens`` greedy steps (after one untimed warm-up step): tokens/s counts every row.
Cache bytes are compared with :meth:`kvpack.formats.KVFormat.bytes_for_tokens` (what ``kvpack size`` uses).

Time-to-first-token (``--ttft-rounds``): the context as one prompt from an empty cache, batch 1, DynamicCache
against each kvpack format (whose prompt attends its own quantized keys through the fused chunk kernel),
alternated round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from kvpack.errors import ConfigError

__all__ = ["add_arguments", "run"]

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
        "--skip", default="", help="providers to leave out, comma list: dynamic, quantized, kvpack (e.g. quantized)"
    )
    parser.add_argument(
        "--ttft-rounds",
        type=int,
        default=3,
        help="time-to-first-token of the context as one prompt (batch 1), DynamicCache and each kvpack format "
        "alternated for this many rounds; 0 skips it (default 3)",
    )
    parser.add_argument("--quick", action="store_true", help="small run: context 512, batch 1,2, 16 new tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


# ----------------------------------------------------------------------------------------------------
# Providers: each fills a cache with the prefilled K/V and knows its attention implementation and bytes


def _dense_bytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def _nbytes(obj: Any) -> int:
    """Bytes of tensors inside ``obj`` (a tensor, a tuple/list/dict of them, or a quanto/hqq object)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(x) for x in obj.values())
    inner = [v for v in vars(obj).values() if isinstance(v, torch.Tensor)] if hasattr(obj, "__dict__") else []
    return sum(t.nbytes for t in inner)


def _quantized_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        total += _nbytes(getattr(layer, "_quantized_keys", None)) + _nbytes(getattr(layer, "_quantized_values", None))
        total += _nbytes(layer.keys) + _nbytes(layer.values)
    return total


def _quantized_backend(config: Any) -> tuple[str | None, str]:
    """The first transformers QuantizedCache backend that can be built here, and why the others cannot."""
    from transformers import QuantizedCache

    why = []
    for backend in ("quanto", "hqq", "fp8"):
        try:
            QuantizedCache(backend=backend, config=config)
            return backend, "; ".join(why)
        except (ImportError, ValueError) as e:
            why.append(f"{backend}: {str(e).splitlines()[0]}")
    return None, "; ".join(why)


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


def _ttft_rows(model: Any, ids: torch.Tensor, formats: list[Any], backend: str, rounds: int) -> list[dict]:
    """Time-to-first-token per provider, the providers alternated ``rounds`` times after one untimed warm-up
    each (kernel compilation, allocator); medians, with the ratio to DynamicCache's."""
    providers = [("dynamic", None)] + [(f"kvpack-{f.name}", f) for f in formats]
    times: dict[str, list[float]] = {name: [] for name, _ in providers}
    for r in range(rounds + 1):
        for name, fmt in providers:
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


def _row(provider: str, batch: int, args: Any, total: float, per_step: list[float], nbytes: int, **extra: Any) -> dict:
    return {
        "provider": provider,
        "batch": batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "tokens_per_s": batch * args.new_tokens / total,
        "ms_per_step_median": 1000 * statistics.median(per_step),
        "cache_bytes": nbytes,
        **extra,
    }


def run(args: argparse.Namespace) -> int:
    """Run the sweep; print a table (or JSON with ``--json``)."""
    from transformers import DynamicCache, QuantizedCache

    from kvpack.formats import parse_format
    from kvpack.integrations.transformers import KVPackCache
    from kvpack.models import load_model

    if args.quick:
        args.context, args.batch, args.new_tokens = min(args.context, 512), "1,2", min(args.new_tokens, 16)
    if args.context <= 0 or args.new_tokens <= 0:
        raise ConfigError("--context and --new-tokens must be positive")
    batches = _int_list(args.batch, "--batch")
    if args.threads is not None:
        if args.threads <= 0:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    formats = [parse_format(f.strip()) for f in args.formats.split(",") if f.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    model, tokenizer = load_model(args.model)
    if "kvpack" not in skip and args.backend in ("auto", "cpu"):
        from kvpack.kernels.warmup import compile_if_cold

        compile_if_cold(lambda line: print(line, file=sys.stderr, flush=True))
    config = model.config
    ids = _prompt(tokenizer, args.context)
    kv, first, prefill_s = _prefill(model, ids)
    qbackend, qwhy = _quantized_backend(config) if "quantized" not in skip else (None, "skipped")
    rows: list[dict] = []
    for batch in batches:
        if "dynamic" not in skip:
            cache = DynamicCache(config=config)
            _fill(cache, kv, batch)
            model.set_attn_implementation("sdpa")
            total, steps = _decode(model, cache, first, batch, args.new_tokens)
            rows.append(_row("dynamic", batch, args, total, steps, _dense_bytes(cache)))
            del cache
        if qbackend is not None:
            cache = QuantizedCache(backend=qbackend, config=config)
            _fill(cache, kv, batch)
            model.set_attn_implementation("sdpa")
            total, steps = _decode(model, cache, first, batch, args.new_tokens)
            rows.append(_row(f"quantized-{qbackend}", batch, args, total, steps, _quantized_bytes(cache)))
            del cache
        if "kvpack" in skip:
            continue
        for fmt in formats:
            tokens = args.context + args.new_tokens + 1
            cache = KVPackCache(config, fmt, max_tokens=tokens, batch_size=batch, backend=args.backend)
            _fill(cache, kv, batch)
            model.set_attn_implementation("kvpack")
            total, steps = _decode(model, cache, first, batch, args.new_tokens)
            tail_bytes = torch.empty((), dtype=cache.paged.tail_dtype).element_size()
            predicted = batch * fmt.bytes_for_tokens(
                tokens, cache.kv_heads, cache.head_dim, cache.num_layers, tail_element_bytes=tail_bytes
            )
            used = cache.bytes_summary()["used_bytes"]
            rows.append(
                _row(
                    f"kvpack-{fmt.name}",
                    batch,
                    args,
                    total,
                    steps,
                    used,
                    predicted_bytes=predicted,
                    predicted_error=used / predicted - 1,
                    fused_decode_calls=cache.fused_decode_calls,
                    backends=dict(cache.decode_backends),
                )
            )
            del cache
    model.set_attn_implementation("sdpa")
    if args.ttft_rounds < 0:
        raise ConfigError(f"--ttft-rounds must be 0 or more, got {args.ttft_rounds}")
    ttft = _ttft_rows(model, ids, formats, args.backend, args.ttft_rounds) if args.ttft_rounds else []
    result = {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "dtype": str(model.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "prefill_s": prefill_s,
        "quantized_backend": qbackend,
        "quantized_unavailable": qwhy,
        "rows": rows,
        "ttft": ttft,
        "checks": _checks(rows) + _ttft_checks(ttft),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _checks(rows: list[dict]) -> list[dict]:
    """The issue's targets, per batch: int4 vs DynamicCache and vs QuantizedCache speed, memory vs prediction."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        by = {r["provider"]: r for r in rows if r["batch"] == batch}
        int4 = by.get("kvpack-int4")
        if int4 is None:
            continue
        dyn = by.get("dynamic")
        quant = next((r for p, r in by.items() if p.startswith("quantized-")), None)
        if dyn:
            ratio = int4["tokens_per_s"] / dyn["tokens_per_s"]
            out.append({"batch": batch, "check": "int4 >= 1.0x DynamicCache", "value": ratio, "ok": ratio >= 1.0})
        if quant:
            ratio = int4["tokens_per_s"] / quant["tokens_per_s"]
            out.append({"batch": batch, "check": f"int4 >= 3x {quant['provider']}", "value": ratio, "ok": ratio >= 3.0})
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
        f"kvpack bench generate: {result['model']} ({result['dtype']}, {result['threads']} threads), "
        f"prefill {result['prefill_s']:.1f} s"
    )
    if result["quantized_unavailable"]:
        print(f"QuantizedCache backends unavailable: {result['quantized_unavailable']}")
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
