"""Formats on the embedded model and on its biased-key stress model: teacher-forced KL through kvpack's cache.

    python benchmarks/format_families.py [--tokens 1024] [--formats fp8,fp8-plain,...] [--models embedded,biased,gemma3-270m]
    python benchmarks/format_families.py --tokens 512 --offsets 5000,9000,13000 --models gemma3-270m  # pooled windows
    python benchmarks/format_families.py --calibrate --formats 'int4,block=32;k=int4:channel:asym:o2q,v=int4:g32:asym,sink=1'

``--calibrate`` first calibrates each model (stress model included) on 16 windows of 256 tokens of the same prose that
overlap none of the measured windows, and hands the artifact to every format: formats with static scales or
query-ranked outlier channels (``o<N>q``) need it.

The stress model is the embedded SmolLM2-135M with a planted ``k_proj`` bias (:func:`kvpack.models.stress.add_key_bias`),
the feature of the Qwen2 family that made the former ``fp8`` preset (rotated, not centred) fall behind plain e4m3.
Each model is compared with its own full-precision cache on the same prose (``pydoc_data.topics``), in chunks of
128 tokens, through the kvpack engine (the paged cache, the fused kernels). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import pydoc_data.topics
import shlex
import time
from pathlib import Path

import torch
from _meta import commit

from kvpack.evaluation.fidelity import teacher_forced
from kvpack.evaluation.runner import Runner, load
from kvpack.fsutil import atomic_write_text
from kvpack.models.stress import add_key_bias

DEFAULT = "fp8,fp8-plain,k=fp8:head:rot,v=fp8:head,sink=1,int8,int4,k4v2"


def pooled(kl: list[torch.Tensor], agree: list[torch.Tensor]) -> dict[str, float]:
    """KL mean and p99 and top-1 agreement over every token of every window (each token weighs the same)."""
    k, a = torch.cat(kl), torch.cat(agree)
    return {"kl_mean": float(k.mean()), "kl_p99": float(k.quantile(0.99)), "top1": float(a.mean())}


def held_out_calibration(lm, text: str, offsets: list[int], tokens: int):
    """A calibration artifact of ``lm`` from 16 windows of 256 tokens of ``text`` that overlap none of the measured
    windows (``tokens`` tokens from each offset; one more on each side for a tokenizer's BOS)."""
    from kvpack.calibration.run import calibrate

    return calibrate(
        lm.model,
        lm.tokenizer,
        percentiles=(),
        text=text,
        exclude=[max(0, o - 1) for o in offsets],
        exclude_len=tokens + 2,
    )


def measure(
    model: str, tokens: int, formats: list[str], offsets: list[int], calibrate: bool = False
) -> dict[str, dict[str, float]]:
    """Each format's KL mean, p99 and top-1 agreement over ``tokens`` tokens of prose from each offset, pooled
    (every token of every window weighs the same)."""
    biased = model == "biased"
    lm = load(None if model in ("embedded", "biased") else model)
    text = " ".join(pydoc_data.topics.topics.values())
    ids = lm.tokenizer(text)["input_ids"]
    if biased:
        add_key_bias(lm.model, ids[:256])
    artifact = held_out_calibration(lm, text, offsets, tokens) if calibrate else None
    r = Runner(lm, engine="kvpack", calibration=artifact)
    kl: dict[str, list[torch.Tensor]] = {f: [] for f in formats}
    agree: dict[str, list[torch.Tensor]] = {f: [] for f in formats}
    for off in offsets:
        doc = ids[off : off + tokens]
        caches = {f: r.cache(f, tokens + 64) for f in formats}
        res = teacher_forced(r.forward, doc, r.cache(None, tokens + 64), caches, chunk=128)
        for f, x in res.items():
            kl[f].append(x.kl.flatten())
            agree[f].append(x.agree.flatten().float())
    return {f: pooled(kl[f], agree[f]) for f in formats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--formats", default=DEFAULT, help="formats separated by ';' or a kvpack format list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--models",
        default="embedded,biased",
        help="embedded, biased (the embedded model with a k_proj bias), or registered test models (gemma3-270m, ...)",
    )
    ap.add_argument("--offsets", default="5000", help="token offsets of the prose windows, pooled (e.g. 5000,9000)")
    ap.add_argument("--calibrate", action="store_true", help="calibrate each model on held-out windows first")
    ap.add_argument("--out", default="benchmarks/results/format_families.json")
    args = ap.parse_args()
    from kvpack.formats import split_formats

    torch.set_num_threads(args.threads)
    formats = split_formats(args.formats)
    t0 = time.time()
    names = {"embedded": "embedded", "biased": "embedded + k_proj bias"}
    offsets = [int(o) for o in args.offsets.split(",")]
    rows = {names.get(m, m): measure(m, args.tokens, formats, offsets, args.calibrate) for m in args.models.split(",")}
    print(f"{'format':36s} " + " ".join(f"{m:>28s}" for m in rows))
    for f in formats:
        cells = [f"KL {rows[m][f]['kl_mean']:.2e} top-1 {100 * rows[m][f]['top1']:.1f}%" for m in rows]
        print(f"{f:36s} " + " ".join(f"{c:>28s}" for c in cells))
    out = {
        "command": "python benchmarks/format_families.py "
        + " ".join(
            f"--{k}" if v is True else f"--{k} {shlex.quote(str(v))}" for k, v in vars(args).items() if v is not False
        ),
        "commit": commit(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "tokens": args.tokens,
        "seconds": round(time.time() - t0, 1),
        "models": rows,
    }
    atomic_write_text(Path(args.out), json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
