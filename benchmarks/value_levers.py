"""Value-side levers that are not formats (measured, not built): where a model's int4 values lose, and what would help.

    python benchmarks/value_levers.py [--model gemma3-270m] [--tokens 1024] [--offsets 5000,13000,21000,29000]

Three measurements, each against the model's own full-precision cache on ``pydoc_data.topics`` prose:

* **Smoothed values** (teacher-forced KL, pooled over the windows, the kvpack engine): every value channel divided by a
  calibrated per-channel factor ``c`` before it is stored and the attention output multiplied by it again, the
  SmoothQuant move applied to the cache. It is measured exactly, without a kernel, as the equivalent weight change
  (``v_proj`` rows divided by ``c``, ``o_proj`` columns multiplied by it: the model is the same function, its cache
  holds ``v / c``). ``c = rms ** alpha`` (the values' per-channel root mean square of a ``kvpack.calibration`` run on
  windows that overlap none of the measured ones), or ``(rms / w) ** alpha`` with ``w`` the norm of the ``o_proj``
  columns that read the channel.
* **Rotated values** (the simulate engine, beside the same format unrotated in the same engine): ``v @ R`` stored,
  the output rotated back; kvpack refuses ``rot`` on values, so the spec is built past that check here.
* **Reconstruction error** of the values alone on the first window (sum of squared errors over the sum of squares,
  the mean over layers) for value groupings, including scales stored in 8 bits (e4m3, rounded up) with the
  group minimum in e4m3 (rounded down) or an integer zero-point of 4 bits: what a group of 16 would cost with cheaper
  scales.

Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import pydoc_data.topics
import statistics
import time
from pathlib import Path

import torch
from _meta import commit
from format_families import held_out_calibration, pooled

from kvpack.evaluation.fidelity import teacher_forced
from kvpack.evaluation.runner import Runner, load
from kvpack.formats import KVFormat, parse_format
from kvpack.fsutil import atomic_write_text
from kvpack.quant import dequantize, quantize

BASE = "k=int4:channel:asym:o30qr,v=int4:g32:asym,sink=1"


def kl_pooled(runner: Runner, ids: list[int], offsets: list[int], tokens: int, formats: dict[str, KVFormat | str]):
    """Pooled KL mean, p99 and top-1 of each format over ``tokens`` tokens from every offset."""
    kl: dict[str, list[torch.Tensor]] = {n: [] for n in formats}
    agree: dict[str, list[torch.Tensor]] = {n: [] for n in formats}
    for off in offsets:
        doc = ids[off : off + tokens]
        caches = {n: runner.cache(f, tokens + 64) for n, f in formats.items()}
        res = teacher_forced(runner.forward, doc, runner.cache(None, tokens + 64), caches, chunk=128)
        for n, x in res.items():
            kl[n].append(x.kl.flatten())
            agree[n].append(x.agree.flatten().float())
    return {n: pooled(kl[n], agree[n]) for n in formats}


def smooth(lm, factors: torch.Tensor) -> None:
    """Divide ``v_proj``'s output channels by ``factors`` (``[layers, kv_heads, head_dim]``) and multiply the
    ``o_proj`` columns that read them by the same: the same function, a cache of ``v / c``."""
    cfg = lm.model.config
    hq, h, d = cfg.num_attention_heads, lm.kv_heads, lm.head_dim
    for i, layer in enumerate(lm.model.model.layers):
        att = layer.self_attn
        c = factors[i].to(att.v_proj.weight.dtype)
        att.v_proj.weight.data /= c.reshape(h * d, 1)
        if att.v_proj.bias is not None:
            att.v_proj.bias.data /= c.reshape(h * d)
        att.o_proj.weight.data *= c.repeat_interleave(hq // h, dim=0).reshape(1, hq * d)


def column_norms(lm) -> torch.Tensor:
    """``[layers, kv_heads, head_dim]``: the norm of the ``o_proj`` columns that read each value channel."""
    cfg = lm.model.config
    hq, h, d = cfg.num_attention_heads, lm.kv_heads, lm.head_dim
    out = []
    for layer in lm.model.model.layers:
        w = layer.self_attn.o_proj.weight.data.float()
        out.append(w.pow(2).sum(0).reshape(h, hq // h, d).sum(1).sqrt())
    return torch.stack(out)


def rotated_values(fmt: KVFormat) -> KVFormat:
    """``fmt`` with its values stored rotated: a spec kvpack refuses, built past the check for the simulate engine."""
    value = dataclasses.replace(fmt.value)
    object.__setattr__(value, "rotate", True)
    out = dataclasses.replace(fmt)
    object.__setattr__(out, "value", value)
    object.__setattr__(out, "name", fmt.name + " (values rotated)")
    return out


def _e4m3_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest e4m3 value >= ``s`` (float32, within e4m3's range)."""
    r8 = s.to(torch.float8_e4m3fn)
    r = r8.float()
    bits = r8.view(torch.uint8).int()
    # one e4m3 step towards +inf: a larger magnitude for r > 0, a smaller one for r < 0, the least subnormal from 0
    up = torch.where(r > 0, bits + 1, torch.where(r < 0, bits - 1, torch.ones_like(bits)))
    nxt = up.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.where(r < s, nxt, r)


def _e4m3_down(x: torch.Tensor) -> torch.Tensor:
    """The largest e4m3 value <= ``x``."""
    return -_e4m3_up(-x)


def grouped(v: torch.Tensor, g: int, scale: str, zero: str) -> torch.Tensor:
    """Asymmetric 4-bit codes over groups of ``g`` channels of ``v`` (``[..., head_dim]`` float32), read back.

    ``scale``: ``fp16`` or ``e4m3`` (rounded up). ``zero``: ``fp16`` (the group minimum), ``e4m3`` (the minimum
    rounded down) or ``int4`` (an integer zero-point: ``x = s * (q - z)``, the grid through 0)."""
    x = v.reshape(*v.shape[:-1], v.shape[-1] // g, g)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    store = (lambda t: _e4m3_up(t)) if scale == "e4m3" else (lambda t: t.half().float())
    if zero == "int4":
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        s = store(((hi - lo) / 15).clamp_min(1e-8))
        z = torch.round(-lo / s).clamp(0, 15)
        # the grid [-z s, (15 - z) s] must hold [lo, hi]: widen s where the rounding of z cut an end off
        need = torch.maximum(-lo / z.clamp_min(1), hi / (15 - z).clamp_min(1))
        s = torch.where(need > s, store(need), s)
        return ((torch.round(x / s + z).clamp(0, 15) - z) * s).reshape(v.shape)
    lo = _e4m3_down(lo) if zero == "e4m3" else lo.half().float()
    s = store(((hi - lo) / 15).clamp_min(1e-8))
    s = torch.where(lo + 15 * s < hi, store((hi - lo) / 15 * (1 + 2**-10)), s)
    return (torch.round((x - lo) / s).clamp(0, 15) * s + lo).reshape(v.shape)


def reconstruction(lm, ids: list[int]) -> dict[str, dict[str, float]]:
    """The values' relative reconstruction error of each grouping, one window, the mean over layers."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        lm.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    values = [cache.layers[i].values.float()[0] for i in range(lm.num_layers)]  # [kv_heads, T, head_dim]
    bits = {"fp16": 16, "e4m3": 8, "int4": 4}
    rows = {}
    g32 = parse_format("k=int8,v=int4:g32:asym").value

    def err(rec: list[torch.Tensor]) -> float:
        return statistics.mean(float(((r - v) ** 2).sum() / (v**2).sum()) for r, v in zip(rec, values))

    rows["int4:g32:asym (kvpack)"] = {
        "bits": 5.0,
        "rel_error": err([dequantize(quantize(v[:, None], g32), torch.float32)[:, 0] for v in values]),
    }
    for g, sc, zk in [(32, "fp16", "fp16"), (16, "fp16", "fp16"), (16, "e4m3", "e4m3"), (16, "e4m3", "int4")]:
        rows[f"g{g}, scale {sc}, zero {zk}"] = {
            "bits": 4 + (bits[sc] + bits[zk]) / g,
            "rel_error": err([grouped(v, g, sc, zk) for v in values]),
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--offsets", default="5000,13000,21000,29000")
    ap.add_argument("--format", default=BASE, help="the format whose values are smoothed and rotated")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/value_levers.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    offsets = [int(o) for o in args.offsets.split(",")]
    text = " ".join(pydoc_data.topics.topics.values())
    fmt = parse_format(args.format)

    lm = load(None if args.model == "embedded" else args.model)
    ids = lm.tokenizer(text)["input_ids"]
    recon = reconstruction(lm, ids[offsets[0] : offsets[0] + args.tokens])
    artifact = held_out_calibration(lm, text, offsets, args.tokens)
    sim = Runner(lm, engine="simulate", calibration=artifact)
    rows = {f"{k} (simulate)": v for k, v in kl_pooled(sim, ids, offsets, args.tokens, {fmt.name: fmt}).items()}
    rot = rotated_values(fmt)
    rows.update({f"{k} (simulate)": v for k, v in kl_pooled(sim, ids, offsets, args.tokens, {rot.name: rot}).items()})
    rows.update(
        kl_pooled(Runner(lm, engine="kvpack", calibration=artifact), ids, offsets, args.tokens, {fmt.name: fmt})
    )
    rms, norms = artifact.values.rms.clamp_min(1e-6), column_norms(lm)
    for label, base in ((f"rms ** {args.alpha}", rms), (f"(rms / w) ** {args.alpha}", rms / norms)):
        c = base**args.alpha
        c = c / c.mean(dim=-1, keepdim=True)  # the cache's magnitudes stay where they were
        lm = load(None if args.model == "embedded" else args.model)
        smooth(lm, c)
        art = held_out_calibration(lm, text, offsets, args.tokens)  # the smoothed cache's own statistics
        res = kl_pooled(Runner(lm, engine="kvpack", calibration=art), ids, offsets, args.tokens, {fmt.name: fmt})
        rows[f"{fmt.name}, values smoothed by {label}"] = res[fmt.name]

    print(f"{'variant':90s} {'KL mean':>9s} {'p99':>6s} {'top-1':>6s}")
    for name, r in rows.items():
        print(f"{name:90s} {r['kl_mean']:9.2e} {r['kl_p99']:6.3f} {100 * r['top1']:5.1f}%")
    print(f"\n{'values alone, one window':40s} {'bits':>6s} {'rel. error':>10s}")
    for name, r in recon.items():
        print(f"{name:40s} {r['bits']:6.3f} {r['rel_error']:10.2e}")
    out = {
        "command": "python benchmarks/value_levers.py " + " ".join(f"--{k} '{v}'" for k, v in vars(args).items()),
        "commit": commit(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1),
        "kl": rows,
        "reconstruction": recon,
    }
    atomic_write_text(Path(args.out), json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
