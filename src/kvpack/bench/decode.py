"""``kvpack bench decode``: decode attention over a long cache, every provider measured in the same run.

A declarative sweep: x values (context lengths) x providers -> rows. Providers:

* ``sdpa-fp32`` / ``sdpa-bf16``: ``torch.nn.functional.scaled_dot_product_attention`` over a dense
  full-precision cache ``[batch, kv_heads, n, head_dim]``. Grouped-query attention is formulated as
  ``q.view(batch, kv_heads, Hq / kv_heads, head_dim)`` against the un-expanded K/V (the query heads of a kv
  head become query rows; decode attends every position, so no mask): measured here about 3x faster than
  ``enable_gqa=True`` and far faster than expanding K/V, so the fastest fair baseline;
* ``dequant-sdpa-<format>``: what transformers' ``QuantizedCache`` does every step: dequantize the whole
  paged history with :func:`kvpack.quant.dequantize` into a scratch buffer, append the tail, call fp32 SDPA;
* ``kvpack-<format>``: :func:`kvpack.kernels.decode_attention` with the fused CPU kernel.

Per row: median milliseconds, GB/s of cache bytes read (the stored cache of that provider: fp32 or bf16
K/V for SDPA, packed payload + scales + tail for the others), that rate as a share of the memory read
bandwidth measured in the same process (:mod:`kvpack.bench.membw`), the speed ratio against every
baseline, and the extra peak memory of one call (peak RSS above the RSS before it, from Linux's
``VmHWM``; ``None`` where the OS cannot tell). Kernel rows also get the block-read ceiling of their cache
(:mod:`kvpack.bench.blockread`: the same blocks read in the kernel's order with its prefetching and no
arithmetic, measured right after the kernel) and the kernel's speed as a share of it.

Caches are built fast: keys and values are random (keys with persistent outlier channels), quantized in
large batched calls over whole blocks, scattered into pools with shuffled block ids (``block_order
"shuffled"``: a long-running server's fragmented pool) or ascending ids per sequence (``"ascending"``: a
fresh pool, each prompt prefilled in one go, as :class:`kvpack.cache.PagedKVCache` then allocates).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpack.cache import hugepages
from kvpack.errors import ConfigError
from kvpack.formats import parse_format
from kvpack.kernels.views import PagedKV
from kvpack.quant import QuantizedTensor, dequantize, quantize
from kvpack.rotation import key_rotation, rotate

__all__ = ["BASELINES", "DecodeConfig", "Provider", "default_providers", "format_table", "run_sweep"]

BASELINES = ("sdpa-fp32", "sdpa-bf16")
BLOCK_ORDERS = ("shuffled", "ascending")


@dataclass(frozen=True)
class DecodeConfig:
    """Shape and protocol of a sweep (defaults: the issue's benchmark)."""

    contexts: tuple[int, ...] = (8192, 16384, 32768)
    batch: int = 4
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 64
    formats: tuple[str, ...] = ("int8", "fp8", "int4", "kivi2")
    dequant_formats: tuple[str, ...] = ("int4",)
    repeats: int = 10
    slow_repeats: int = 3  # dequantize-then-SDPA is an order of magnitude slower
    warmup: int = 2
    threads: int | None = None
    seed: int = 0
    membw_bytes: int = 512 * 2**20  # the bandwidth probe's buffer: keep it far above the last-level cache
    block_order: str = "shuffled"  # block ids of the paged caches: "shuffled" or "ascending" (see the module doc)

    def __post_init__(self) -> None:
        if self.block_order not in BLOCK_ORDERS:
            raise ConfigError(f"block_order must be one of {', '.join(BLOCK_ORDERS)}, got {self.block_order!r}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads {self.q_heads} must be a multiple of kv_heads {self.kv_heads}")
        if min(self.contexts, default=0) < 1 or self.batch < 1 or self.repeats < 1:
            raise ConfigError("contexts, batch and repeats must be positive")
        for f in (*self.formats, *self.dequant_formats):
            parse_format(f).check(self.head_dim)


@dataclass(frozen=True)
class Provider:
    """One column of the sweep: ``kind`` is ``sdpa``, ``dequant-sdpa`` or ``kvpack``."""

    name: str
    kind: str
    format: str
    baseline: bool = False


def default_providers(formats: Sequence[str], dequant_formats: Sequence[str]) -> list[Provider]:
    """fp32 and bf16 SDPA, dequantize-then-SDPA per ``dequant_formats``, the kernel per ``formats``."""
    out = [Provider("sdpa-fp32", "sdpa", "fp32", True), Provider("sdpa-bf16", "sdpa", "bf16", True)]
    out += [Provider(f"dequant-sdpa-{f}", "dequant-sdpa", f, True) for f in dequant_formats]
    out += [Provider(f"kvpack-{f}", "kvpack", f) for f in formats]
    return out


# ----------------------------------------------------------------------------------------------------
# Inputs


@dataclass
class _Case:
    """The tensors of one context length, shared by every provider."""

    n: int
    q: torch.Tensor  # [batch, Hq, D] float32
    k: torch.Tensor  # [batch, H, n, D] float32
    v: torch.Tensor
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    paged: dict[str, PagedKV] = field(default_factory=dict)


def _make_case(cfg: DecodeConfig, n: int) -> _Case:
    g = torch.Generator().manual_seed(cfg.seed + n)
    shape = (cfg.batch, cfg.kv_heads, n, cfg.head_dim)
    k = torch.randn(*shape, generator=g)
    outliers = torch.randperm(cfg.head_dim, generator=g)[:4]
    k[..., outliers] = k[..., outliers] * 12.0 + 6.0  # persistent outlier channels, as real keys have
    v = torch.randn(*shape, generator=g)
    q = torch.randn(cfg.batch, cfg.q_heads, cfg.head_dim, generator=g)
    return _Case(n, q, k, v)


def build_paged_kv(
    fmt_name: str, k: torch.Tensor, v: torch.Tensor, block_size: int, seed: int = 0, block_order: str = "shuffled"
) -> PagedKV:
    """A :class:`PagedKV` holding ``k``/``v`` ``[batch, H, n, D]`` (float32), blocks quantized in batched
    calls and scattered to shuffled block ids (``block_order="ascending"``: ids 1, 2, 3, ... sequence after
    sequence); the last ``n % block_size`` tokens form the tail. Keys of a rotating spec (the ``fp8``
    preset) are stored rotated, as the cache stores them."""
    if block_order not in BLOCK_ORDERS:
        raise ConfigError(f"block_order must be one of {', '.join(BLOCK_ORDERS)}, got {block_order!r}")
    fmt = parse_format(fmt_name).with_block_size(block_size)
    batch, h, n, d = k.shape
    rot = key_rotation(d) if fmt.key.rotate else None
    if rot is not None:
        k = rotate(k, rot)
    nb, t = divmod(n, block_size)
    total = batch * nb
    if block_order == "ascending":
        ids = torch.arange(1, total + 1)
    else:
        ids = torch.randperm(max(total, 1), generator=torch.Generator().manual_seed(seed))[:total] + 1
    tables = torch.zeros(batch, nb + 1, dtype=torch.int32)
    tables[:, :nb] = ids.view(batch, nb).to(torch.int32)
    pools = []
    for spec, x in ((fmt.key, k), (fmt.value, v)):
        blocks = x[:, :, : nb * block_size].reshape(batch, h, nb, block_size, d).permute(0, 2, 1, 3, 4)
        blocks = blocks.reshape(total, h, block_size, d)
        parts = [quantize(blocks[i : i + 512].contiguous(), spec) for i in range(0, max(total, 1), 512)]
        if not parts:
            parts = [quantize(torch.randn(1, h, block_size, d), spec)]
        pool = []
        for attr in ("data", "scale", "zero"):
            if getattr(parts[0], attr) is None:
                pool.append(None)
                continue
            src = torch.cat([getattr(q, attr) for q in parts])
            dst = hugepages.zeros((total + 1, *src.shape[1:]), src.dtype)  # as the cache allocates its pools
            if total:
                dst[ids.long()] = src[:total]
            pool.append(dst)
        pools.append(pool)
    tail_k = torch.zeros(batch, h, block_size, d)
    tail_v = torch.zeros(batch, h, block_size, d)
    tail_k[:, :, :t] = k[:, :, nb * block_size :]
    tail_v[:, :, :t] = v[:, :, nb * block_size :]
    (kd, ks, kz), (vd, vs, vz) = pools
    sink = {}
    if fmt.sink:  # the presets keep each sequence's first positions in full precision, as the cache does
        sink = {"sink_k": k[:, :, : fmt.sink].contiguous(), "sink_v": v[:, :, : fmt.sink].contiguous()}
    lens = torch.full((batch,), n, dtype=torch.int32)
    return PagedKV(fmt, d, kd, ks, kz, vd, vs, vz, tables, lens, tail_k, tail_v, key_rotation=rot, **sink)


def cycle_blocks(kv: PagedKV, blocks: int) -> None:
    """Point each sequence's sealed blocks at its first ``blocks`` block ids over and over, in place. A kernel
    timed on ``kv`` then reads the same few blocks, which stay in the caches: its compute alone (the
    ``--hot-blocks`` option of ``benchmarks/cpu_kernel_perf.py`` and ``benchmarks/cpu_spec_ab.py``)."""
    for b, row in enumerate(kv.block_tables):
        nb = int(kv.seq_lens[b]) // kv.block_size
        if nb > blocks:
            row[:nb] = row[:blocks].repeat(nb // blocks + 1)[:nb].clone()


def add_case_options(ap: argparse.ArgumentParser, threads: int) -> None:
    """The options the CPU kernel's scripts share (``benchmarks/cpu_kernel_perf.py``, ``cpu_spec_ab.py``):
    ``--format``, ``--context``, ``--threads`` (default ``threads``) and ``--hot-blocks``."""
    ap.add_argument("--format", default="int8")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--hot-blocks", type=int, default=0, help="each sequence cycles over its first N blocks (8: in L2)")


def case_from_options(args: argparse.Namespace) -> tuple[_Case, PagedKV]:
    """The sweep's case and cache (batch 4, 32 q / 8 kv heads, head_dim 128, block 64, shuffled block ids) for
    the options of :func:`add_case_options`; sets torch's thread count and applies :func:`cycle_blocks`."""
    torch.set_num_threads(args.threads)
    cfg = DecodeConfig(contexts=(args.context,), formats=(args.format,))
    case = _make_case(cfg, args.context)
    kv = build_paged_kv(args.format, case.k, case.v, cfg.block_size)
    if args.hot_blocks:
        cycle_blocks(kv, args.hot_blocks)
    return case, kv


def cache_bytes(kv: PagedKV) -> int:
    """Bytes of the stored cache the sequences of ``kv`` occupy: sealed blocks (payload, scales, zeros)
    plus the tail tokens and the sink rows read instead of block rows, which is what a decode step reads."""
    fmt, h, d = kv.format, kv.kv_heads, kv.head_dim
    total = 0
    for n in kv.seq_lens.tolist():
        nb, t = divmod(int(n), kv.block_size)
        total += (
            nb * fmt.block_bytes(h, d) + 2 * (t + min(kv.sink, nb * kv.block_size)) * h * d * kv.tail_k.element_size()
        )
    return total


# ----------------------------------------------------------------------------------------------------
# Providers -> a zero-argument callable and the bytes it reads


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q ``[batch, Hq, D]``, k/v ``[batch, H, n, D]`` -> ``[batch, Hq, D]`` (query heads grouped per kv head)."""
    b, hq, d = q.shape
    h = k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q.view(b, h, hq // h, d), k, v)
    return out.reshape(b, hq, d)


def dequant_then_sdpa(q: torch.Tensor, kv: PagedKV) -> torch.Tensor:
    """Dequantize every sealed block into a dense fp32 scratch history, append the tail, run SDPA."""
    b, h, d, bs = kv.batch, kv.kv_heads, kv.head_dim, kv.block_size
    n = int(kv.seq_lens[0])
    nb, t = divmod(n, bs)
    ids = kv.block_tables[:, :nb].reshape(-1).long()
    dense = []
    s = min(kv.sink, nb * bs)  # sink positions are read from the sink rows, as every backend does
    for data, scale, zero, spec, tail, sink in (
        (kv.k_data, kv.k_scale, kv.k_zero, kv.format.key, kv.tail_k, kv.sink_k),
        (kv.v_data, kv.v_scale, kv.v_zero, kv.format.value, kv.tail_v, kv.sink_v),
    ):
        qt = QuantizedTensor(data[ids], None if scale is None else scale[ids], None if zero is None else zero[ids],
                             spec, d)  # fmt: skip
        x = dequantize(qt).view(b, nb, h, bs, d).permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, d)
        if s:
            x[:, :, :s] = sink[:, :, :s].float()
        dense.append(torch.cat([x, tail[:, :, :t].float()], dim=2))
    if kv.key_rotation is not None:  # stored keys are k @ R: unrotate them, as QuantizedCache has no rotation
        dense[0] = dense[0] @ kv.key_rotation.T
    return _sdpa(q, dense[0], dense[1])


def _prepare(p: Provider, case: _Case, cfg: DecodeConfig) -> tuple[Callable[[], Any], int]:
    if p.kind == "sdpa":
        if p.format not in case.dense:
            dt = torch.float32 if p.format == "fp32" else torch.bfloat16
            case.dense[p.format] = tuple(hugepages.zeros(x.shape, dt).copy_(x) for x in (case.k, case.v))
        k, v = case.dense[p.format]
        q = case.q.to(k.dtype)
        return (lambda: _sdpa(q, k, v)), k.nbytes + v.nbytes
    if p.format not in case.paged:
        case.paged[p.format] = build_paged_kv(p.format, case.k, case.v, cfg.block_size, cfg.seed, cfg.block_order)
    kv = case.paged[p.format]
    if p.kind == "dequant-sdpa":
        return (lambda: dequant_then_sdpa(case.q, kv)), cache_bytes(kv)
    from kvpack.kernels import decode_attention

    out = torch.empty_like(case.q)
    return (lambda: decode_attention(case.q, kv, backend="cpu", out=out)), cache_bytes(kv)


def _rss_peak_probe() -> tuple[Callable[[], None], Callable[[], int]] | None:
    """(reset, peak-above-reset) from Linux's VmHWM, or None where it is unavailable."""

    def _status(field_name: str) -> int:
        with open("/proc/self/status") as fh:
            return int(re.search(rf"{field_name}:\s+(\d+) kB", fh.read()).group(1)) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        _status("VmHWM")
    except (OSError, AttributeError):
        return None
    base = [0]

    def reset() -> None:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets the peak RSS to the current RSS
        base[0] = _status("VmRSS")

    return reset, lambda: max(_status("VmHWM") - base[0], 0)


def _block_read(kv: PagedKV, repeats: int, warmup: int) -> tuple[float, float] | None:
    """The block-read ceiling of ``kv`` (median seconds, GB/s), or None where the probe cannot run (no numba)."""
    try:
        from kvpack.bench.blockread import measure_block_read
    except ImportError:  # pragma: no cover - numba is part of the cpu extra
        return None
    return measure_block_read(kv, repeats, warmup)


def run_sweep(
    cfg: DecodeConfig,
    providers: Sequence[Provider] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Run the sweep: returns ``(rows, memory_bandwidth_gbps)`` (bandwidth: the best of a probe before and
    after the kernels, so a noisy neighbour lowers it rather than flattering the kernels)."""
    from kvpack.bench.membw import measure_read_bandwidth, time_calls

    providers = list(providers or default_providers(cfg.formats, cfg.dequant_formats))
    old_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    say = progress or (lambda s: None)
    try:
        bw = measure_read_bandwidth(cfg.membw_bytes)
        say(f"memory read bandwidth: {bw:.1f} GB/s ({torch.get_num_threads()} threads)")
        probe = _rss_peak_probe()
        rows = []
        for n in cfg.contexts:
            case = _make_case(cfg, n)
            for p in providers:
                fn, nbytes = _prepare(p, case, cfg)
                reps = cfg.slow_repeats if p.kind == "dequant-sdpa" else cfg.repeats
                times = time_calls(fn, reps, 1 if p.kind == "dequant-sdpa" else cfg.warmup)
                scratch = None
                if probe is not None:
                    probe[0]()
                    fn()
                    scratch = probe[1]()
                med = statistics.median(times)
                ceiling = _block_read(case.paged[p.format], reps, cfg.warmup) if p.kind == "kvpack" else None
                rows.append({"provider": p.name, "kind": p.kind, "format": p.format, "context": n,
                             "batch": cfg.batch, "q_heads": cfg.q_heads, "kv_heads": cfg.kv_heads,
                             "head_dim": cfg.head_dim, "block_size": cfg.block_size,
                             "threads": torch.get_num_threads(), "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                             "repeats": reps, "cache_bytes": nbytes, "gbps": nbytes / med / 1e9,
                             "scratch_bytes": scratch, "baseline": p.baseline,
                             "block_order": cfg.block_order})  # fmt: skip
                if ceiling is not None:
                    rows[-1].update(block_read_ms=ceiling[0] * 1e3, block_read_gbps=ceiling[1],
                                    pct_block_read=100.0 * ceiling[0] / med)  # fmt: skip
                say(f"context {n:>6}  {p.name:<22} {med * 1e3:9.2f} ms")
            del case
        bw = max(bw, measure_read_bandwidth(cfg.membw_bytes))
    finally:
        torch.set_num_threads(old_threads)
    for r in rows:
        r["memory_bandwidth_gbps"] = bw
        r["pct_bandwidth"] = 100.0 * r["gbps"] / bw
        for base in (q for q in rows if q["baseline"] and q["context"] == r["context"]):
            r[f"speedup_vs_{base['provider']}"] = base["median_ms"] / r["median_ms"]
    return rows, bw


def format_table(rows: list[dict[str, Any]], bandwidth_gbps: float) -> str:
    """A plain-text table of the rows (one block per context)."""
    bases = list(dict.fromkeys(r["provider"] for r in rows if r["baseline"]))
    head = ["provider", "median ms", "GB/s", "% bw", *[f"vs {b}" for b in bases], "extra MB", "ceiling ms", "% ceil"]
    lines = [f"memory read bandwidth (measured): {bandwidth_gbps:.1f} GB/s"]
    for n in dict.fromkeys(r["context"] for r in rows):
        sub = [r for r in rows if r["context"] == n]
        r0 = sub[0]
        lines.append("")
        lines.append(
            f"context {n} tokens, batch {r0['batch']}, {r0['q_heads']} q / {r0['kv_heads']} kv heads, "
            f"head_dim {r0['head_dim']}, {r0['threads']} threads, {r0.get('block_order', 'shuffled')} block ids"
        )
        table = [head]
        for r in sub:
            extra = "-" if r["scratch_bytes"] is None else f"{r['scratch_bytes'] / 2**20:.0f}"
            ceil = (f"{r['block_read_ms']:.2f}", f"{r['pct_block_read']:.0f}") if "block_read_ms" in r else ("-", "-")
            table.append([r["provider"], f"{r['median_ms']:.2f}", f"{r['gbps']:.1f}", f"{r['pct_bandwidth']:.0f}",
                          *[f"{r[f'speedup_vs_{b}']:.2f}x" for b in bases], extra, *ceil])  # fmt: skip
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if any("block_read_ms" in r for r in rows):
        lines += ["", "ceiling ms: the same cache's blocks read in the kernel's order with its prefetching and no "
                  "arithmetic (kvpack.bench.blockread); % ceil = ceiling ms / median ms"]  # fmt: skip
    return "\n".join(lines)


def parse_tokens(text: str) -> int:
    """``"8k"`` -> 8192, ``"32768"`` -> 32768 (:func:`kvpack.sizing.parse_count`: exact, positive, bounded)."""
    from kvpack.sizing import parse_count

    return parse_count(text, "a context length")


def ab_round(call: Callable[[], Any], threads: int, pairs: int) -> float:
    """One round of an in-process A/B timing of ``call`` (one warm call first): with one thread the best of 5
    calls' thread CPU time in ns per (token, kv head), ``pairs`` of them in a call; with more, the median wall
    time of 5 calls in ms (``benchmarks/cpu_spec_ab.py``, ``cpu_format_ab.py``)."""
    call()
    ts = []
    for _ in range(5):
        if threads == 1:
            t = time.thread_time_ns()
            call()
            ts.append((time.thread_time_ns() - t) / pairs)
        else:
            t = time.perf_counter()
            call()
            ts.append((time.perf_counter() - t) * 1e3)
    return min(ts) if threads == 1 else statistics.median(ts)


def ab_report(title: str, threads: int, res: dict[str, list[float]]) -> None:
    """Print each setting's median of its :func:`ab_round` figures and, round by round, its ratio to the first
    setting's."""
    unit = "ns per (token, kv head), one thread's CPU time" if threads == 1 else f"ms, {threads} threads"
    print(f"{title}: {unit}")
    first = next(iter(res.values()))
    for label, xs in res.items():
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(xs, first))
        print(f"{statistics.median(xs):8.3f}  {label}  ratios {ratios}")
