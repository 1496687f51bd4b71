"""transformers ``generate`` with prompt-lookup drafting over a kvpack cache: the candidates verified through the CPU
decode kernel once (positions as query heads) against the chunk path, and plain greedy decoding beside them.

The embedded model, a prompt of ``pydoc_data.topics`` prose, greedy; three providers alternated ``--repeat`` times
in one process: ``plain`` (no drafting), ``lookup-chunk`` (``prompt_lookup_num_tokens``, every verification through
the chunk path: ``hf_attention.FUSED_QUERIES = 0``) and ``lookup-fused`` (the default: candidates that lie in the
tail go through the decode kernel once). Prints one JSON row per provider: median wall seconds, every run's, the
attention calls of each kind, and whether its tokens equal ``plain``'s.

    python benchmarks/hf_prompt_lookup.py --format int8 --repeat 3 --out benchmarks/results/hf_prompt_lookup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import pydoc_data.topics
import statistics
import time

import torch
from _meta import commit as git_commit

import kvpack.hf
import kvpack.integrations.hf_attention as hfa
from kvpack.fsutil import atomic_write_text
from kvpack.integrations import transformers as kt
from kvpack.models.embedded import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int8")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens (default 4)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the rows and the run's metadata here (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    text = " ".join(list(pydoc_data.topics.topics.values())[:40])
    ids = tok(text, return_tensors="pt").input_ids[:, : args.prompt_tokens]
    fused_default = hfa.FUSED_QUERIES
    providers = (
        ("plain", fused_default, 0),
        ("lookup-chunk", 0, args.lookup),
        ("lookup-fused", fused_default, args.lookup),
    )
    runs: dict[str, list[float]] = {}
    info: dict[str, dict] = {}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeat):
        for name, fused, lookup in providers:
            hfa.FUSED_QUERIES = fused
            cache = kvpack.hf.cache_for(model, args.format)
            extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, max_new_tokens=args.new_tokens, do_sample=False,
                                 **{kt.cache_kwarg(model): cache}, **extra)  # fmt: skip
            runs.setdefault(name, []).append(time.perf_counter() - t0)
            outs[name] = out
            info[name] = {"fused_decode_calls": cache.fused_decode_calls,
                          "fused_position_calls": cache.fused_position_calls, "chunk_calls": cache.chunk_calls}  # fmt: skip
    hfa.FUSED_QUERIES = fused_default
    rows = []
    for name, _, _ in providers:
        rows.append({"provider": name, "wall_s": round(statistics.median(runs[name]), 2),
                     "wall_s_runs": [round(x, 2) for x in runs[name]], **info[name],
                     "same_tokens_as_plain": bool(torch.equal(outs[name], outs["plain"]))})  # fmt: skip
    for row in rows:
        print(json.dumps(row))
    if args.out:
        meta = {"command": "python benchmarks/hf_prompt_lookup.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                "commit": git_commit(), "machine": f"{platform.machine()}, {args.threads} threads",
                "torch": torch.__version__}  # fmt: skip
        atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
