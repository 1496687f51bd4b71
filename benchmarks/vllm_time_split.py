"""Where a kvpack format's attention time goes inside vLLM: one provider of ``kvpack bench vllm`` run in this
process, with timers around the parts of each layer's step (the engine's warm-up left out).

    python benchmarks/vllm_time_split.py --format int4            # the quick workload
    python benchmarks/vllm_time_split.py --format int8 --full     # the default (longer) workload
    python benchmarks/vllm_time_split.py --format int4 --long-output   # long answers in a small space
    python benchmarks/vllm_time_split.py --format int4 --dtype bfloat16   # a bfloat16 model
    python benchmarks/vllm_time_split.py --format int4 --full --model gemma3-270m   # sliding-window layers
    python benchmarks/vllm_time_split.py --format int8 --ngram    # with vLLM's n-gram drafts (embedded, float32)
    python benchmarks/vllm_time_split.py --format vllm-fp8        # vLLM's own fp8 cache: its attention layer's forward

Prints, per part, its total seconds, its calls and microseconds per call: the whole attention layer
(``forward``), its writes (``write``: the step's seal and tail rows in one compiled call, or the seal and then the
tail rows in steps that move tails between slots), its reads (``attend``: the decode and chunk kernels' calls and the page views). A timer costs about a
microsecond per call; the engine's own throughput line is printed too, for the provider's wall time.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import sys
import time
from typing import Any

TOTALS: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def _timed(owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t0
            CALLS[name] += 1

    setattr(owner, attr, wrapper)


def _install(own: bool) -> None:
    from kvpack.integrations.vllm import backend, engine, layer
    from kvpack.kernels import cpu_seal

    if own:  # vLLM's own cache (vllm-default, vllm-fp8): its CPU attention layer's forward, for comparison
        from vllm.v1.attention.backends import cpu_attn

        _timed(cpu_attn.CPUAttentionBackendImpl, "forward", "forward")
    _timed(backend.KVPackAttentionImpl, "forward", "forward")
    _timed(layer.PagedLayer, "write", "write")
    _timed(layer.PagedLayer, "_seal", "write: seal")
    _timed(cpu_seal.StepWrites, "__call__", "write: seal and tail rows (compiled, one call)")
    _timed(cpu_seal, "write_rows", "write: tail rows alone (compiled; steps that move tails)")
    _timed(layer.PagedLayer, "attend", "attend")
    _timed(layer, "run_backend", "attend: decode kernel")
    _timed(layer, "run_chunk_backend", "attend: chunk kernel")
    _timed(layer.PagedLayer, "view", "attend: views")
    instrument = engine._instrument

    def after_warmup(*args: Any) -> None:  # the engine counts from here: so do the timers
        TOTALS.clear()
        CALLS.clear()
        instrument(*args)

    engine._instrument = after_warmup


def _report(result_line: str | None) -> None:
    width = max(map(len, TOTALS), default=10)
    for name in sorted(TOTALS):
        per = 1e6 * TOTALS[name] / max(CALLS[name], 1)
        print(f"{name:<{width}}  {TOTALS[name]:7.3f} s  {CALLS[name]:6d} calls  {per:8.1f} us/call", file=sys.stderr)
    if result_line:
        res = json.loads(result_line)
        print(f"wall {res['wall_s']:.2f} s, {res['tokens_per_s']:.1f} tokens/s", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--format",
        default="int4",
        help="a kvpack format (default int4), or vllm-default / vllm-fp8: vLLM's own attention timed",
    )
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the default workload instead of --quick's")
    size.add_argument("--long-output", action="store_true", help="the --long-output workload instead of --quick's")
    ap.add_argument("--dtype", default="float32", help="the model's dtype: float32 (default), bfloat16, float16")
    ap.add_argument("--model", default=None, help="a model folder or registered test model (default: the embedded)")
    ap.add_argument("--ngram", action="store_true", help="vLLM's n-gram drafting, as benchmarks/vllm_speculative.py")
    args = ap.parse_args()
    from kvpack.bench.vllm import base_job, provider_job
    from kvpack.integrations.vllm import engine
    from kvpack.models.embedded import resolve_model_path

    model = None if args.model is None else str(resolve_model_path(args.model))
    name = "long-output" if args.long_output else None
    job = {
        **base_job(quick=not args.full, model=model, dtype=args.dtype, workload_name=name),
        **provider_job(args.format),
    }
    if args.ngram:
        if model is not None or args.dtype != "float32":
            ap.error("--ngram sizes the reserves' extra space for the embedded model in float32 only")
        import torch
        from vllm_speculative import HEAD_DIM, KV_HEADS, LAYERS, NGRAM

        from kvpack import parse_format
        from kvpack.integrations.vllm.config import tail_pool_bytes

        # the second tail slots (the reserves) come on top of the space, so the pages stay the same
        reserves = tail_pool_bytes(parse_format(args.format), LAYERS, KV_HEADS, HEAD_DIM, torch.float32,
                                   job["max_num_seqs"])  # fmt: skip
        job |= {"kv_bytes": job["kv_bytes"] + reserves, "engine_kwargs": {"speculative_config": NGRAM}}
    _install(args.format.startswith("vllm-"))
    sys.stdin = io.StringIO(json.dumps(job))
    out = io.StringIO()
    stdout, sys.stdout = sys.stdout, out
    exit_ = os._exit

    def report_and_exit(code: int) -> None:  # the engine ends with os._exit, past any atexit hook
        sys.stdout = stdout
        lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("{")]
        _report(lines[-1] if lines else None)
        sys.stderr.flush()
        exit_(code)

    os._exit = report_and_exit
    engine._main()


if __name__ == "__main__":
    main()
