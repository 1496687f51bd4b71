"""Outlier key channels chosen by what the queries read: teacher-forced KL of int4 keys with k channels per block kept
in full precision, chosen by the key's own range (what kvpack's ``o<k>`` does) or by that range weighted by the
queries' energy in the channel (simulate engine; measured, not built).

    python benchmarks/query_weighted_outliers.py [--tokens 512] [--models embedded,biased,gemma3-270m]

A key channel's quantization error reaches the attention score through the query: the score's error is
``sum_c q_c * err_c``, and an int4 channel's error grows with the channel's range in the block. Keeping the channels
of the largest ``range`` (kvpack's seal-time choice) spends the kept channels on keys the queries may barely read;
ranking them by ``E[q_c^2] * range_c^2`` spends them where the score's error is. ``E[q_c^2]`` per layer, kv head
and channel (the mean over the head's query heads) comes from other windows of the same prose than those measured,
as a calibration would give it. Each variant seals keys with :func:`kvpack.cache.write.seal_outliers` (the cache's
own seal, channels given per block), values as the format's; everything else is the simulate engine's.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import time

import torch
from _meta import write_results
from format_families import pooled

from kvpack.cache.write import seal_outliers
from kvpack.evaluation.fidelity import teacher_forced
from kvpack.evaluation.runner import Runner, load
from kvpack.formats import parse_format
from kvpack.models.stress import add_key_bias
from kvpack.outliers import apply_residual, seal_time_channels
from kvpack.quant import dequantize

# (name, format, ranked by): the format's key spec says how many channels are kept; ``range`` is kvpack's choice
# (:func:`kvpack.outliers.seal_time_channels`), ``query`` the query-weighted one; None keeps the format's own seal
VARIANTS = [
    ("int4", "int4", None),
    ("int4,block=32 (for comparison)", "int4,block=32", None),
    ("int4, 2 kept by range", "k=int4:channel:asym:o2,v=int4:g32:asym,sink=1", "range"),
    ("int4, 2 kept by query x range", "k=int4:channel:asym:o2,v=int4:g32:asym,sink=1", "query"),
    ("int4, 4 kept by range (int4-o4)", "int4-o4", "range"),
    ("int4, 4 kept by query x range", "int4-o4", "query"),
    ("int4, 8 kept by range", "k=int4:channel:asym:o8,v=int4:g32:asym,sink=1", "range"),
    ("int4, 8 kept by query x range", "k=int4:channel:asym:o8,v=int4:g32:asym,sink=1", "query"),
]


def query_energy(lm, ids: list[int], offsets: list[int], tokens: int) -> dict[int, torch.Tensor]:
    """``E[q_c^2]`` per layer: ``[kv_heads, head_dim]``, the queries as the attention reads them (after any QK-norm
    and RoPE), averaged over the windows' tokens and each kv head's query heads."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sums: dict[int, torch.Tensor] = {}
    orig = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, attention_mask, **kw):
        hq, hkv = query.shape[1], key.shape[1]
        e = query[0].float().pow(2).mean(1).view(hkv, hq // hkv, -1).mean(1)  # [kv_heads, head_dim]
        sums[module.layer_idx] = sums.get(module.layer_idx, 0) + e
        return orig(module, query, key, value, attention_mask, **kw)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    impl = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            for off in offsets:
                lm.model(torch.tensor([ids[off : off + tokens]]))
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = orig
        lm.model.config._attn_implementation = impl
    if not sums:
        raise RuntimeError("no attention call went through sdpa: this model's queries were not seen")
    return {k: v / len(offsets) for k, v in sums.items()}


def _layer_class():
    from kvpack.evaluation.simulate import _layer_class as simulated

    class ChosenChannelsLayer(simulated()):
        """The simulate engine's layer whose sealed keys keep the key spec's outlier channels per block and kv head,
        ranked by the block's range (``by="range"``) or by that range squared times the queries' energy
        (``by="query"``)."""

        def __init__(self, fmt, by: str | None, energy: torch.Tensor | None):
            super().__init__(fmt)
            self.by, self.energy = by, energy

        def seal_keys(self, keys: torch.Tensor, s: slice) -> torch.Tensor:
            if self.by is None:
                return super().seal_keys(keys, s)
            x = keys[..., s, :].float()
            b, h, t, d = x.shape
            bs = self.fmt.block_size
            flat = x.reshape(b, h, t // bs, bs, d).permute(0, 2, 1, 3, 4).reshape(-1, h, bs, d)  # [n, H, B, D]
            k = self.fmt.key.outliers
            if self.by == "range":
                channels = seal_time_channels(flat, k)  # [n, H, k]
            else:
                score = self.energy[None] * (flat.amax(-2) - flat.amin(-2)).pow(2)
                channels = score.topk(k, dim=-1).indices.sort(dim=-1).values
            qt, _, (residual, idx) = seal_outliers(flat, self.fmt.key, None, channels)
            rec = apply_residual(dequantize(qt, torch.float32), residual, idx)
            rec = rec.reshape(b, t // bs, h, bs, d).permute(0, 2, 1, 3, 4).reshape(b, h, t, d)
            return rec.to(keys.dtype)

    return ChosenChannelsLayer


def measure(model: str, tokens: int, offsets: list[int], calib: list[int]) -> dict[str, dict[str, float]]:
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    lm = load(None if model in ("embedded", "biased") else model)
    ids = lm.tokenizer(" ".join(pydoc_data.topics.topics.values()))["input_ids"]
    if model == "biased":
        add_key_bias(lm.model, ids[:256])
    energy = query_energy(lm, ids, calib, tokens)
    layers = sorted(energy)
    layer = _layer_class()
    r = Runner(lm, engine="simulate")
    kl: dict[str, list[torch.Tensor]] = {v[0]: [] for v in VARIANTS}
    agree: dict[str, list[torch.Tensor]] = {v[0]: [] for v in VARIANTS}
    for off in offsets:
        doc = ids[off : off + tokens]
        caches = {
            name: Cache(layers=[layer(parse_format(f), by, energy[i]) for i in layers]) for name, f, by in VARIANTS
        }
        for n, x in teacher_forced(r.forward, doc, DynamicCache(), caches, chunk=128).items():
            kl[n].append(x.kl.flatten())
            agree[n].append(x.agree.flatten().float())
    out = {n: pooled(kl[n], agree[n]) for n in kl}
    for name, f, _ in VARIANTS:
        out[name]["format"] = f
        out[name]["bits"] = parse_format(f).bits_per_element(lm.model.config.num_key_value_heads, _head_dim(lm))
    return out


def _head_dim(lm) -> int:
    cfg = lm.model.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="embedded,biased,gemma3-270m")
    ap.add_argument("--offsets", default="5000,21000", help="token offsets of the measured windows, pooled")
    ap.add_argument("--calibration", default="30000,33000", help="token offsets of the windows E[q^2] comes from")
    ap.add_argument("--out", default="benchmarks/results/query_weighted_outliers.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    offsets = [int(o) for o in args.offsets.split(",")]
    calib = [int(o) for o in args.calibration.split(",")]
    t0 = time.time()
    rows = {}
    for m in args.models.split(","):
        rows[m] = measure(m, args.tokens, offsets, calib)
        print(f"\n{m}: KL mean (p99, top-1)")
        for n, v in rows[m].items():
            print(f"  {n:36s} {v['bits']:.3f} bits  {v['kl_mean']:.2e} ({v['kl_p99']:.2e}, {100 * v['top1']:.1f}%)")
    fields = {
        "benchmark": "query_weighted_outliers",
        "engine": "simulate",
        "tokens": args.tokens,
        "offsets": offsets,
        "calibration_offsets": calib,
        "threads": args.threads,
        "results": rows,
    }
    write_results(args.out, fields, t0)


if __name__ == "__main__":
    main()
