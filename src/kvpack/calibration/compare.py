"""Quant-level comparison on a model's real keys: block-local vs static (calibrated) vs outlier-kept.

Run ``python -m kvpack.calibration.compare`` (embedded model by default). It calibrates on
``--samples`` windows of the pydoc corpus, then captures queries, keys (after RoPE) and values on
``--eval-samples`` *held-out* windows and, for every key variant, reports per layer (mean and worst over
layers):

* key SNR in dB (dequantized keys against the originals);
* the relative error of the causal attention output ``softmax(q k^T / sqrt(d)) v`` with the dequantized
  keys (values exact, so the number is the keys' share of the error);
* honest bits per key element (payload, scales, zero-points, the kept channels' fp16 residuals and their
  per-block indices, as the cache stores them);
* the fraction of key values clipped by static scales.

All keys of a window are quantized in blocks of 64 (no full-precision tail), which is harsher than the
cache, where the last partial block stays exact.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpack.calibration.observer import KVObserver, RoleStats
from kvpack.calibration.static import seal_with_static, static_scales
from kvpack.formats import parse_format
from kvpack.outliers import dequantize_outliers, quantize_outliers, select_outlier_channels
from kvpack.quant import dequantize, quantize, snr_db

__all__ = ["Variant", "capture_qkv", "evaluate_variants", "main", "standard_variants"]

BLOCK = 64


def capture_qkv(model: Any, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Queries and keys after RoPE, and values, of every layer for ``input_ids`` ``[batch, T]`` int64.

    Uses a registered transformers attention function that records its inputs and then runs SDPA, so the
    forward pass is unchanged. Returns per layer ``(q [batch, heads, T, D], k [batch, kv_heads, T, D],
    v [batch, kv_heads, T, D])`` float32.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query.detach().float(), key.detach().float(), value.detach().float())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvpack_capture", record)
    AttentionMaskInterface.register("kvpack_capture", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvpack_capture")
    try:
        with torch.no_grad():
            model.base_model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return [captured[i] for i in sorted(captured)]


def to_blocks(k: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` (T a multiple of 64) -> ``[B * T/64, H, 64, D]``."""
    b, h, t, d = k.shape
    return k.reshape(b, h, t // BLOCK, BLOCK, d).permute(0, 2, 1, 3, 4).reshape(-1, h, BLOCK, d)


def from_blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`."""
    n, h, blk, d = x.shape
    return x.reshape(b, n // b, h, blk, d).permute(0, 2, 1, 3, 4).reshape(b, h, -1, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, ``q`` ``[B, Hq, T, D]``, ``k``/``v`` ``[B, H, T, D]`` (GQA) -> ``[B, Hq, T, D]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


@dataclass
class Variant:
    """A way to store key blocks: ``run(blocks [n, H, 64, D], layer) -> (dequantized, bytes, clipped)``."""

    name: str
    run: Callable[[torch.Tensor, int], tuple[torch.Tensor, int, int]]


def _dynamic(spec_text: str) -> Callable:
    spec = parse_format(f"k={spec_text},v=fp16").key

    def run(x: torch.Tensor, layer: int) -> tuple[torch.Tensor, int, int]:
        qt = quantize(x, spec)
        return dequantize(qt), qt.nbytes(), 0

    return run


def _static(spec_text: str, keys: RoleStats, source: str) -> Callable:
    spec = parse_format(f"k={spec_text}:static,v=fp16").key
    scales = static_scales(keys, spec, "key", source)

    def run(x: torch.Tensor, layer: int) -> tuple[torch.Tensor, int, int]:
        qt, clipped = seal_with_static(x, spec, scales.layer(layer))
        # the scale table is per layer: count it once per layer, not once per block
        nbytes = qt.data.numel() * qt.data.element_size() + scales.layer(layer).scale.numel() * qt.scale.element_size()
        if qt.zero is not None:
            nbytes += scales.layer(layer).zero.numel() * qt.zero.element_size()
        return dequantize(qt), nbytes, clipped

    return run


def _outliers(spec_text: str, k: int, keys: RoleStats | None) -> Callable:
    spec = parse_format(f"k={spec_text}:o{k},v=fp16").key

    def run(x: torch.Tensor, layer: int) -> tuple[torch.Tensor, int, int]:
        # calibrated channels are copied into every block, as the cache stores them; None: chosen per block
        ch = None if keys is None else select_outlier_channels(keys.absmax[layer], k)
        oq = quantize_outliers(x, spec, ch)
        return dequantize_outliers(oq), oq.nbytes(), 0

    return run


def standard_variants(keys: RoleStats, k: int = 4) -> list[Variant]:
    """The rows of the table in docs/calibration.md."""
    return [
        Variant("int8 per-channel, block-local", _dynamic("int8:channel")),
        Variant("int8 per-channel, static abs-max", _static("int8:channel", keys, "absmax")),
        Variant("int8 per-channel, static RoPE bound", _static("int8:channel", keys, "rope")),
        Variant("fp8 e4m3 per-head, block-local", _dynamic("fp8:head")),
        Variant("fp8 e4m3 per-tensor, static fp32 (vLLM)", _static("fp8:tensor:fp32", keys, "absmax")),
        Variant("int4 per-token (asym)", _dynamic("int4:token:asym")),
        Variant(f"int4 per-token + {k} outliers (calibrated)", _outliers("int4:token:asym", k, keys)),
        Variant("int4 g32 per-token (asym)", _dynamic("int4:g32:asym")),
        Variant(f"int4 g32 + {k} outliers (calibrated)", _outliers("int4:g32:asym", k, keys)),
        Variant(f"int4 g32 + {k} outliers (seal-time)", _outliers("int4:g32:asym", k, None)),
        Variant("int4 per-channel, block-local", _dynamic("int4:channel:asym")),
        Variant("int4 per-channel, static abs-max", _static("int4:channel:asym", keys, "absmax")),
        Variant("int4 per-channel, static p99.9", _static("int4:channel:asym", keys, "p99.9")),
        Variant("int4 per-channel, static RoPE bound", _static("int4:channel:asym", keys, "rope")),
        Variant(f"int4 per-channel + {k} outliers (calibrated)", _outliers("int4:channel:asym", k, keys)),
        Variant("int2 per-channel, block-local", _dynamic("int2:channel:asym")),
        Variant(f"int2 per-channel + {k} outliers (calibrated)", _outliers("int2:channel:asym", k, keys)),
    ]


def evaluate_variants(
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], variants: list[Variant]
) -> list[dict[str, float | str]]:
    """Metrics of every variant over the captured layers (see the module docstring)."""
    rows = []
    exact = [attention(q, k, v) for q, k, v in qkv]
    for var in variants:
        snrs, errs, nbytes, elems, clipped = [], [], 0, 0, 0
        for layer, ((q, k, v), o) in enumerate(zip(qkv, exact)):
            kb = to_blocks(k)
            deq, nb, cl = var.run(kb, layer)
            k_hat = from_blocks(deq, k.shape[0])
            snrs.append(snr_db(k, k_hat))
            o_hat = attention(q, k_hat, v)
            errs.append(float((o_hat - o).norm() / o.norm()))
            nbytes += nb
            elems += k.numel()
            clipped += cl
        rows.append(
            {
                "variant": var.name,
                "bits": 8 * nbytes / elems,
                "snr_mean": sum(snrs) / len(snrs),
                "snr_worst": min(snrs),
                "err_mean": sum(errs) / len(errs),
                "err_worst": max(errs),
                "clipped": clipped / elems,
            }
        )
    return rows


def markdown(rows: list[dict[str, float | str]]) -> str:
    head = (
        "| key variant | bits/elem | key SNR dB (mean / worst layer) | attn-out rel. err % (mean / worst layer) "
        "| clipped % |\n|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['variant']} | {r['bits']:.2f} | {r['snr_mean']:.1f} / {r['snr_worst']:.1f} | "
        f"{100 * r['err_mean']:.3f} / {100 * r['err_worst']:.3f} | {100 * r['clipped']:.4f} |\n"
        for r in rows
    )
    return head + body


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpack.calibration.compare", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--samples", type=int, default=16, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=256, help="calibration window length")
    p.add_argument("--eval-samples", type=int, default=4, help="held-out windows")
    p.add_argument("--eval-seq-len", type=int, default=512, help="held-out window length (multiple of 64)")
    p.add_argument("--outliers", type=int, default=4, help="key channels kept per head")
    args = p.parse_args(argv)

    from kvpack.calibration.run import calibration_windows, load_model, observe_model

    torch.manual_seed(0)
    t0 = time.time()
    model, tok = load_model(args.model)
    observer = KVObserver((99.9, 99.99))
    ids, data = calibration_windows(tok, args.samples, args.seq_len, seed=0)
    observe_model(model, ids, observer)
    keys, _ = observer.stats()
    held, _ = calibration_windows(  # held-out: no token of the calibration windows
        tok, args.eval_samples, args.eval_seq_len, seed=1, exclude=data["offsets"], exclude_len=args.seq_len
    )
    qkv = capture_qkv(model, held)
    rows = evaluate_variants(qkv, standard_variants(keys, args.outliers))
    print(markdown(rows))
    print(
        f"model {model.config.model_type}, {len(qkv)} layers; calibration {args.samples} x {args.seq_len} tokens; "
        f"held-out {args.eval_samples} x {args.eval_seq_len} tokens; {time.time() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
