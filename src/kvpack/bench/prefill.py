"""``kvpack bench prefill``: a chunk of ``T`` queries over a long cached history, every provider in the same run.

A declarative sweep: (context, chunk, batch) x providers -> rows. Providers:

* ``sdpa-fp32`` / ``sdpa-bf16``: ``torch.nn.functional.scaled_dot_product_attention`` over the dense
  full-precision history ``[batch, kv_heads, n, head_dim]``, the chunk's causal mask as a boolean
  ``[G * T, n]`` mask; grouped-query attention as rows (``q`` viewed ``[batch, kv_heads, G * T, head_dim]``, the
  decode benchmark's fastest fair form: no expanded K/V);
* ``reference-<format>``: the oracle (:func:`kvpack.kernels.reference.paged_attention_reference`: the history
  dequantized, full score matrix), the vLLM backend's prefill before the fused kernel;
* ``dequant-sdpa-<format>``: the transformers chunk path's fallback
  (:func:`kvpack.integrations.hf_attention.dequantized_chunk_attention`: the history dequantized once per
  sequence, SDPA over it in query chunks of 512);
* ``kvpack-<format>``: :func:`kvpack.kernels.chunk_attention` on the fused CPU kernel.

Columns: provider, context, chunk, batch, median_ms, the ratio to sdpa-fp32 (> 1: faster), and extra_mb: the
peak resident memory one call adds above what it had before (Linux ``VmHWM``, after the inputs and the output
buffer exist), for the kernel at least the scratch it allocates (:func:`kvpack.kernels.cpu_chunk.scratch_bytes`
plus the tails it copies to float32), since freed memory the allocator reuses does not show in ``VmHWM``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpack.bench.decode import _rss_peak_probe, build_paged_kv
from kvpack.errors import ConfigError
from kvpack.formats import parse_format

__all__ = ["PrefillConfig", "format_table", "run_sweep"]


@dataclass(frozen=True)
class PrefillConfig:
    """Shape and protocol of a sweep (defaults: the issue's benchmark)."""

    contexts: tuple[int, ...] = (8192, 32768)
    chunks: tuple[int, ...] = (512,)
    batches: tuple[int, ...] = (1, 4)
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 64
    formats: tuple[str, ...] = ("int8", "fp8", "int4", "kivi2")
    reference: bool = True  # the reference rows (slow, and their score matrix needs [Hq, T, n] floats)
    repeats: int = 3
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads {self.q_heads} must be a multiple of kv_heads {self.kv_heads}")
        if min((*self.contexts, *self.chunks, *self.batches, self.repeats), default=0) < 1:
            raise ConfigError("contexts, chunks, batches and repeats must be positive")
        for n in self.contexts:
            if any(t > n for t in self.chunks):
                raise ConfigError(f"a chunk longer than the history ({n} tokens, the chunk's own included)")
        for f in self.formats:
            parse_format(f).check(self.head_dim)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q ``[batch, T, Hq, D]``, k/v ``[batch, H, n, D]``, mask ``[G * T, n]`` bool -> ``[batch, T, Hq, D]``."""
    b, t, hq, d = q.shape
    h = k.shape[1]
    qg = q.view(b, t, h, hq // h, d).permute(0, 2, 3, 1, 4).reshape(b, h, hq // h * t, d)  # rows (g, t)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.view(b, h, hq // h, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def _time(fn: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    from kvpack.bench.membw import time_calls

    return time_calls(fn, repeats, warmup)


def run_sweep(cfg: PrefillConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run the sweep; one row per (context, chunk, batch, provider)."""
    from kvpack.integrations.hf_attention import dequantized_chunk_attention
    from kvpack.kernels import chunk_attention, cpu_chunk
    from kvpack.kernels.reference import paged_attention_reference

    say = progress or (lambda s: None)
    probe = _rss_peak_probe()
    rows: list[dict[str, Any]] = []
    g_n = cfg.q_heads // cfg.kv_heads
    for n in cfg.contexts:
        for batch in cfg.batches:
            gen = torch.Generator().manual_seed(cfg.seed + n + batch)
            shape = (batch, cfg.kv_heads, n, cfg.head_dim)
            k = torch.randn(*shape, generator=gen)
            outl = torch.randperm(cfg.head_dim, generator=gen)[:4]
            k[..., outl] = k[..., outl] * 12.0 + 6.0  # persistent outlier channels, as real keys have
            v = torch.randn(*shape, generator=gen)
            paged = {f: build_paged_kv(f, k, v, cfg.block_size, cfg.seed) for f in cfg.formats}
            dense = {"fp32": (k, v), "bf16": (k.bfloat16(), v.bfloat16())}
            for t in cfg.chunks:
                q = torch.randn(batch, t, cfg.q_heads, cfg.head_dim, generator=gen)
                pos = torch.arange(n - t, n).view(-1, 1)
                mask = (torch.arange(n).view(1, -1) <= pos).repeat(g_n, 1)  # [G * T, n], rows (g, t)
                out = torch.empty_like(q)
                cases: list[tuple[str, Callable[[], Any], int, int]] = []
                for dt, (kk, vv) in dense.items():
                    qq = q.to(kk.dtype)
                    cases.append(
                        (f"sdpa-{dt}", lambda qq=qq, kk=kk, vv=vv, m=mask: _sdpa(qq, kk, vv, m), 0, cfg.repeats)
                    )
                for f, kv in paged.items():
                    if cfg.reference:
                        cases.append((f"reference-{f}", lambda kv=kv, q=q: paged_attention_reference(q, kv), 0, 1))
                    # the transformers chunk path without a fused kernel: dequantize once, SDPA in query chunks
                    cases.append((f"dequant-sdpa-{f}", lambda kv=kv, q=q: dequantized_chunk_attention(q, kv), 0,
                                  cfg.repeats))  # fmt: skip
                    floor = cpu_chunk.scratch_bytes(kv, t, g_n) + 2 * kv.tail_k.numel() * 4
                    cases.append((f"kvpack-{f}", lambda kv=kv, q=q, o=out: chunk_attention(q, kv, backend="cpu", out=o), floor,
                                  cfg.repeats))  # fmt: skip
                for name, fn, floor, reps in cases:
                    times = _time(fn, reps, cfg.warmup if reps > 1 else 0)
                    extra = None
                    if probe is not None:
                        probe[0]()
                        fn()
                        extra = max(probe[1](), floor)
                    med = statistics.median(times)
                    rows.append({"provider": name, "context": n, "chunk": t, "batch": batch,
                                 "q_heads": cfg.q_heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                                 "threads": torch.get_num_threads(), "median_ms": med * 1e3, "repeats": reps,
                                 "extra_mb": None if extra is None else extra / 2**20,
                                 "history_fp16_mb": 2 * batch * cfg.kv_heads * n * cfg.head_dim * 2 / 2**20})  # fmt: skip
                    say(f"context {n:>6} chunk {t:>4} batch {batch}  {name:<18} {med * 1e3:10.1f} ms")
            del paged, dense, k, v
    for r in rows:
        base = next(b for b in rows if b["provider"] == "sdpa-fp32" and all(
            b[c] == r[c] for c in ("context", "chunk", "batch")))  # fmt: skip
        r["vs_sdpa_fp32"] = base["median_ms"] / r["median_ms"]
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the rows."""
    head = ["provider", "context", "chunk", "batch", "median_ms", "vs sdpa-fp32", "extra_mb", "% fp16 hist"]
    table = [head]
    for r in rows:
        extra = "-" if r["extra_mb"] is None else f"{r['extra_mb']:.1f}"
        share = "-" if r["extra_mb"] is None else f"{100 * r['extra_mb'] / r['history_fp16_mb']:.1f}"
        table.append([r["provider"], str(r["context"]), str(r["chunk"]), str(r["batch"]), f"{r['median_ms']:.1f}",
                      f"{r['vs_sdpa_fp32']:.2f}x", extra, share])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    t0 = rows[0] if rows else {"threads": torch.get_num_threads()}
    lines = [f"{t0.get('q_heads', '?')} q / {t0.get('kv_heads', '?')} kv heads, head_dim {t0.get('head_dim', '?')}, "
             f"{t0['threads']} threads, shuffled block ids"]  # fmt: skip
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
