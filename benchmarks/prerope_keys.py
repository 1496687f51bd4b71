"""Keys quantized before or after RoPE: teacher-forced KL of the same formats both ways (simulate engine).

    python benchmarks/prerope_keys.py [--tokens 1024] [--models embedded,biased,gemma3-270m] [--formats "int4;fp8;..."]

kvpack stores keys as the model hands them to its cache: after the rotary embedding. A key channel's constant
part (a ``k_proj`` bias, QK-norm's per-channel weight) is constant before RoPE; after it, each channel pair turns
at its own frequency, so in the fast pairs that constant sweeps the channel's whole range within one block. This
measures what quantizing the keys *before* RoPE would gain, before any kernel is written for it: each sealed block's
keys are rotated back to their pre-RoPE values with the cos/sin the model used, quantized and dequantized per the
format (block-local scales, sink and tail as kvpack's cache keeps them), and rotated forward again. Both variants run
through the same simulate engine (:mod:`kvpack.evaluation.simulate`), so their difference is the rotation alone.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import time

import torch
from _meta import write_simulate_results
from format_families import pooled

from kvpack.evaluation.fidelity import teacher_forced
from kvpack.evaluation.runner import Runner, load
from kvpack.evaluation.simulate import roundtrip_blocks
from kvpack.formats import KVFormat, parse_format, split_formats
from kvpack.models.stress import add_key_bias

DEFAULT = "int4;int4,block=32;fp8;fp8-plain;k=fp8:channel:asym,v=fp8:head,sink=1;int8;k4v2"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _layer_class():
    from kvpack.evaluation.simulate import _layer_class as simulated

    class RopeAwareLayer(simulated()):
        """The simulate engine's layer, whose sealed keys are quantized as stored (``pre=False``) or rotated back to
        before RoPE first (``pre=True``); ``rope[idx]`` holds the chunk's (cos, sin)."""

        def __init__(self, fmt: KVFormat, pre: bool, rope: dict, idx: int):
            super().__init__(fmt)
            self.pre, self.rope, self.idx = pre, rope, idx
            self.cos: torch.Tensor | None = None  # [T, head_dim] for every position so far
            self.sin: torch.Tensor | None = None

        def update(self, key_states, value_states, *args, **kwargs):
            cos, sin = self.rope[self.idx]  # [1, t, head_dim]
            self.cos = cos[0] if self.cos is None else torch.cat([self.cos, cos[0]])
            self.sin = sin[0] if self.sin is None else torch.cat([self.sin, sin[0]])
            return super().update(key_states, value_states, *args, **kwargs)

        def seal_keys(self, keys: torch.Tensor, s: slice) -> torch.Tensor:
            if not self.pre:
                return super().seal_keys(keys, s)
            k = keys[..., s, :].float()
            c, si = self.cos[s].float(), self.sin[s].float()
            k_pre = roundtrip_blocks(k * c - _rotate_half(k) * si, self.fmt.key, self.fmt.block_size).float()
            return (k_pre * c + _rotate_half(k_pre) * si).to(keys.dtype)

    return RopeAwareLayer


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]


def measure(model: str, tokens: int, formats: list[str], offsets: list[int]) -> dict[str, dict[str, float]]:
    """KL mean and top-1 of every format with keys quantized after RoPE (``post``) and before it (``pre``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    lm = load(None if model in ("embedded", "biased") else model)
    ids = lm.tokenizer(" ".join(pydoc_data.topics.topics.values()))["input_ids"]
    if model == "biased":
        add_key_bias(lm.model, ids[:256])
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def grab(mod, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is None:
            pe = args[1]
        rope[mod.layer_idx] = pe

    mods = _attention_modules(lm.model)
    hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in mods]
    layer = _layer_class()
    r = Runner(lm, engine="simulate")
    names = [f"{f} [{v}]" for f in formats for v in ("post", "pre")]
    kl: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    agree: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    try:
        for off in offsets:
            doc = ids[off : off + tokens]
            caches = {
                f"{f} [{v}]": Cache(layers=[layer(parse_format(f), v == "pre", rope, i) for i in range(len(mods))])
                for f in formats
                for v in ("post", "pre")
            }
            res = teacher_forced(r.forward, doc, DynamicCache(), caches, chunk=128)
            for n, x in res.items():
                kl[n].append(x.kl.flatten())
                agree[n].append(x.agree.flatten().float())
    finally:
        for h in hooks:
            h.remove()
    return {n: pooled(kl[n], agree[n]) for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--formats", default=DEFAULT, help="formats separated by ';' or a kvpack format list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="embedded,biased,gemma3-270m")
    ap.add_argument("--offsets", default="5000", help="token offsets of the prose windows, pooled")
    ap.add_argument("--out", default="benchmarks/results/prerope_keys.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    formats = split_formats(args.formats)
    offsets = [int(o) for o in args.offsets.split(",")]
    t0 = time.time()
    rows = {}
    for m in args.models.split(","):
        rows[m] = measure(m, args.tokens, formats, offsets)
        print(f"\n{m}: KL mean (top-1), keys quantized after RoPE -> before RoPE")
        for f in formats:
            a, b = rows[m][f"{f} [post]"], rows[m][f"{f} [pre]"]
            print(
                f"  {f:44s} {a['kl_mean']:.2e} ({100 * a['top1']:.1f}%) -> {b['kl_mean']:.2e} ({100 * b['top1']:.1f}%)"
            )
    write_simulate_results(args.out, "prerope_keys", args, offsets, rows, t0)


if __name__ == "__main__":
    main()
