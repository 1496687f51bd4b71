"""Kept key channels at 8-bit precision for a quarter of fp16's bytes: teacher-forced KL of int4 keys whose
query-ranked outlier channels store a 4-bit refinement of their int4 code instead of an fp16 residual (simulate
engine; measured, not built).

    python benchmarks/refined_channels.py [--tokens 512] [--models embedded,biased,gemma3-270m]

With per-channel key scales, a kept channel is quantized with its own scale like every other channel, so its
residual ``x - dequantize(code)`` lies within half the channel's int4 step ``s``: 4 more bits (a code of the
residual on a grid of ``s / 16``) make the channel as precise as int8, where an fp16 residual spends 16 bits. The
same bytes then keep four times as many channels. Each variant seals keys with :func:`kvpack.cache.write.seal_outliers`
(the cache's own seal, channels ranked by the queries' energy from a held-out calibration, scales chosen without
them) and, for the refined variants, stores each kept element as its own int4 code under its channel's block scale
plus a refinement code of the rest on a grid of ``s / 16``; values as the format's; everything else is the
simulate engine's. Bits count the refinement codes at 4 bits and one channel index byte per kept channel.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import time

import torch
from _meta import write_simulate_results
from format_families import held_out_calibration, pooled

from kvpack.cache.write import seal_outliers
from kvpack.evaluation.fidelity import teacher_forced
from kvpack.evaluation.runner import Runner, load
from kvpack.formats import parse_format
from kvpack.models.stress import add_key_bias
from kvpack.quant import decode_scale, dequantize

# (name, format, refined): the format's key spec (o<k>q) says how many channels are kept; refined stores each
# kept element as a 4-bit refinement code instead of an fp16 residual
VARIANTS = {
    64: [
        ("int4,block=32", "int4,block=32", False),
        ("2 kept, fp16 (o2q)", "k=int4:channel:asym:o2q,v=int4:g32:asym,sink=1", False),
        ("4 kept, 4-bit refinement", "k=int4:channel:asym:o4q,v=int4:g64:asym,sink=1", True),
        ("6 kept, 4-bit refinement", "k=int4:channel:asym:o6q,v=int4:g32:asym,sink=1", True),
        ("8 kept, 4-bit refinement", "k=int4:channel:asym:o8q,v=int4:g32:asym,sink=1", True),
    ],
    256: [
        ("int4,block=32", "int4,block=32", False),
        ("12 kept, fp16 (o12q)", "k=int4:channel:asym:o12q,v=int4:g64:asym,sink=1", False),
        ("32 kept, 4-bit refinement", "k=int4:channel:asym:o32q,v=int4:g32:asym,sink=1", True),
        ("48 kept, 4-bit refinement", "k=int4:channel:asym:o48q,v=int4:g64:asym,sink=1", True),
        ("64 kept, 4-bit refinement", "k=int4:channel:asym:o64q,v=int4:g64:asym,sink=1", True),
    ],
}


def bits(fmt: str, refined: bool, kv_heads: int, head_dim: int) -> float:
    """Bits per element: the format's, with each kept element's fp16 residual counted at 4 bits when refined."""
    f = parse_format(fmt)
    b = f.bits_per_element(kv_heads, head_dim)
    return b - (f.key.outliers * 12 / head_dim / 2 if refined else 0.0)  # keys are half the elements


def refine(x: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Kept elements ``x`` ``[n, H, B, k]`` as an int4 code under their channel's own block scale and zero-point
    (``step``, ``zero`` ``[n, H, 1, k]``, rounded down) plus a 4-bit code of the rest on a grid of ``step / 16``: 256
    levels over the channel's range, as int8 per channel would give, each element within ``step / 32``."""
    q = ((x - zero) / step).floor().clamp(0, 15)
    unit = step / 16
    fine = ((x - zero - q * step) / unit).floor().clamp(0, 15)
    return zero + q * step + (fine + 0.5) * unit


def _layer_class():
    from kvpack.evaluation.simulate import _layer_class as simulated

    class RefinedLayer(simulated()):
        """The simulate engine's layer whose sealed keys keep query-ranked channels, with fp16 residuals or (``refined``)
        4-bit refinement codes."""

        def __init__(self, fmt, energy: torch.Tensor | None, refined: bool):
            super().__init__(fmt, key_energy=energy)
            self.refined = refined

        def seal_keys(self, keys: torch.Tensor, s: slice) -> torch.Tensor:
            if not self.refined:
                return super().seal_keys(keys, s)
            x = keys[..., s, :].float()
            b, h, t, d = x.shape
            bs = self.fmt.block_size
            flat = x.reshape(b, h, t // bs, bs, d).permute(0, 2, 1, 3, 4).reshape(-1, h, bs, d)  # [n, H, B, D]
            qt, _, (_, idx) = seal_outliers(flat, self.fmt.key, None, None, self.key_energy)
            spec = self.fmt.key
            at = idx.long().unsqueeze(-2)  # [n, H, 1, k]
            step = decode_scale(qt.scale, spec.scale_dtype).float().gather(-1, at)  # the kept channels' own scales
            zero = decode_scale(qt.zero, spec.zero_dtype).float().gather(-1, at)
            kept = flat.gather(-1, at.expand(-1, -1, bs, -1))  # [n, H, B, k]
            rec = dequantize(qt, torch.float32).scatter(-1, at.expand(-1, -1, bs, -1), refine(kept, step, zero))
            rec = rec.reshape(b, t // bs, h, bs, d).permute(0, 2, 1, 3, 4).reshape(b, h, t, d)
            return rec.to(keys.dtype)

    return RefinedLayer


def measure(model: str, tokens: int, offsets: list[int]) -> dict[str, dict[str, float]]:
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    lm = load(None if model in ("embedded", "biased") else model)
    text = " ".join(pydoc_data.topics.topics.values())
    ids = lm.tokenizer(text)["input_ids"]
    if model == "biased":
        add_key_bias(lm.model, ids[:256])
    art = held_out_calibration(lm, text, offsets, tokens)
    variants = VARIANTS[lm.head_dim]
    layer = _layer_class()
    r = Runner(lm, engine="simulate", calibration=art)
    kl: dict[str, list[torch.Tensor]] = {v[0]: [] for v in variants}
    agree: dict[str, list[torch.Tensor]] = {v[0]: [] for v in variants}
    for off in offsets:
        doc = ids[off : off + tokens]
        caches = {}
        for name, f, refined in variants:
            fmt = parse_format(f)
            if fmt.query_ranked:
                caches[name] = Cache(layers=[layer(fmt, art.query_energy[i], refined) for i in range(lm.num_layers)])
            else:
                caches[name] = r.cache(f, tokens + 64)
        for n, x in teacher_forced(r.forward, doc, DynamicCache(), caches, chunk=128).items():
            kl[n].append(x.kl.flatten())
            agree[n].append(x.agree.flatten().float())
    out = {n: pooled(kl[n], agree[n]) for n in kl}
    for name, f, refined in variants:
        out[name] |= {"format": f, "refined": refined, "bits": bits(f, refined, lm.kv_heads, lm.head_dim)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="embedded,biased,gemma3-270m")
    ap.add_argument("--offsets", default="5000,21000", help="token offsets of the measured windows, pooled")
    ap.add_argument("--out", default="benchmarks/results/refined_channels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    offsets = [int(o) for o in args.offsets.split(",")]
    t0 = time.time()
    rows = {}
    for m in args.models.split(","):
        rows[m] = measure(m, args.tokens, offsets)
        print(f"\n{m}: KL mean (p99, top-1)")
        for n, v in rows[m].items():
            print(f"  {n:30s} {v['bits']:.3f} bits  {v['kl_mean']:.2e} ({v['kl_p99']:.2e}, {100 * v['top1']:.1f}%)")
    write_simulate_results(args.out, "refined_channels", args, offsets, rows, t0)


if __name__ == "__main__":
    main()
