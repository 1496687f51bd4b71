"""Capacity planning from the byte formula: cache size per format, what fits on a GPU, prefix sharing.

Pure Python over :mod:`kvpack.formats`; every figure comes from :meth:`KVFormat.bytes_for_tokens`, so
scales, zero-points, padding and the one-block full-precision tail of each sequence are all counted.
Memory for activations and the runtime's workspace is *not* counted: the "fits" figures are for weights
plus cache only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kvpack.errors import ConfigError, FormatError
from kvpack.formats import PEER_PRESETS, PRESETS, DType, KVFormat, parse_format, split_formats
from kvpack.modelspecs import ModelShape
from kvpack.plans import LayerPlan, is_plan, parse_plan

__all__ = [
    "GIB",
    "MODEL_DTYPE_BYTES",
    "FormatRow",
    "SizeEstimate",
    "VllmPage",
    "VllmSpace",
    "advice",
    "estimate",
    "max_batch",
    "max_context",
    "parse_count",
    "parse_formats",
    "shared_prefix_bytes",
    "vllm_capacity_tokens",
    "vllm_float16_tails",
    "vllm_layers_per_block",
    "vllm_page",
    "vllm_refusal",
    "vllm_smaller_block",
    "vllm_tail_bytes",
]

GIB = 1024**3
WEIGHT_BYTES_PER_PARAM = 2  # fp16 / bf16 weights
SMALL_CACHE_SHARE = 0.15  # below this share of weights + cache, quantizing the cache buys little
TAIL_ELEMENT_BYTES = 2  # the tail is kept in fp16 / bf16

MAX_COUNT = 2**40  # no cache holds more tokens (or sequences): larger counts are typos
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_count(text: str | int, what: str = "value") -> int:
    """Parse a positive token or sequence count: ``8192``, ``8k``, ``128K``, ``1m``, ``1.5k`` (k = 1024).

    Raises:
        ConfigError: not a number, not a whole count, not positive, or above :data:`MAX_COUNT`.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _COUNT.match(str(text))
        if not m:
            raise ConfigError(f"{what} must be a positive count like 8192, 8k or 1m (k = 1024), got {text!r}")
        value = Fraction(m.group(1)) * _SUFFIX[m.group(2).lower()]  # exact: no float rounding of big counts
        if value.denominator != 1:
            raise ConfigError(f"{what} {text!r} is not a whole number ({float(value):g})")
        n = int(value)
    if n <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    if n > MAX_COUNT:
        raise ConfigError(f"{what} {text!r} is beyond any cache ({n} > 2**40 = {MAX_COUNT}); give a real count")
    return n


def parse_formats(items: list[str] | None) -> list[KVFormat | LayerPlan]:
    """Formats from repeated ``--format`` values; each may be one format or a comma list of formats.

    A value is first parsed whole (so a custom string such as ``k=int8,v=int4:g32,block=32`` keeps its
    commas); only if that fails is it split with :func:`~kvpack.formats.split_formats` (``int4,sink=1,int8``
    is two formats), and then every piece must parse on its own (or be ``all``: kvpack's presets, or
    ``peers``: other systems' layouts, :data:`~kvpack.formats.PEER_PRESETS`). ``None`` or empty means all
    (kvpack's) presets.
    """
    if not items:
        return list(PRESETS.values())
    out: list[KVFormat | LayerPlan] = []
    groups = {"all": PRESETS, "peers": PEER_PRESETS}

    def one(text: str) -> KVFormat | LayerPlan:
        return parse_plan(text) if is_plan(text) else parse_format(text)

    for item in items:
        if item.strip().lower() in groups:
            out += groups[item.strip().lower()].values()
            continue
        try:
            out.append(one(item))
        except FormatError:
            pieces = split_formats(item)  # fields (sink=1, v=...) stay with the format before them
            if len(pieces) < 2:
                raise  # one (custom) format that does not parse: its own message says why
            for p in pieces:  # a comma list of formats; an unknown one lists the presets
                out += groups[p.lower()].values() if p.lower() in groups else [one(p)]
    unique: dict[str, KVFormat | LayerPlan] = {}
    for f in out:
        unique.setdefault(f.spec_string(), f)
    return list(unique.values())


# ----------------------------------------------------------------------------------------------------
# The arithmetic


def max_context(fmt: KVFormat, budget: int, kv_heads: int, head_dim: int, layers: int) -> int:
    """Longest sequence (tokens) whose blocks and tail fit in ``budget`` bytes (0 when none fits)."""
    block = layers * fmt.block_bytes(kv_heads, head_dim)
    b = fmt.block_size
    if fmt.is_passthrough:
        return max(0, budget // block) * b
    # per sequence whatever its length: the one-block tail and the sink buffer
    tail = layers * (
        fmt.tail_bytes(kv_heads, head_dim, TAIL_ELEMENT_BYTES) + fmt.sink_bytes(kv_heads, head_dim, TAIL_ELEMENT_BYTES)
    )
    if budget < tail:
        return 0
    # n sealed blocks plus a tail of up to block_size - 1 tokens (the next token would seal)
    return ((budget - tail) // block) * b + b - 1


def max_batch(fmt: KVFormat, budget: int, context: int, kv_heads: int, head_dim: int, layers: int) -> int:
    """How many sequences of ``context`` tokens fit in ``budget`` bytes."""
    per_seq = fmt.bytes_for_tokens(context, kv_heads, head_dim, layers, TAIL_ELEMENT_BYTES)
    return max(0, budget // per_seq)


def shared_prefix_bytes(
    fmt: KVFormat, context: int, batch: int, prefix: int, kv_heads: int, head_dim: int, layers: int
) -> int:
    """Cache bytes of ``batch`` sequences of ``context`` tokens whose first ``prefix`` tokens are shared.

    Only whole sealed blocks are shared (a block holds its scales, so it can be shared as is); the
    prefix's partial last block and every tail stay per sequence.
    """
    per_seq = fmt.bytes_for_tokens(context, kv_heads, head_dim, layers, TAIL_ELEMENT_BYTES)
    shared_blocks = min(prefix, context) // fmt.block_size  # sealed when not passthrough: prefix <= context
    block = layers * fmt.block_bytes(kv_heads, head_dim)
    return batch * per_seq - (batch - 1) * shared_blocks * block


@dataclass
class FormatRow:
    """The figures for one format. Byte counts are for all ``layers``."""

    format: KVFormat
    bytes_per_token: float  # sealed bytes per token: a block's bytes over its tokens
    bits_per_element: float
    bytes_per_sequence: int  # sealed blocks + one-block fp16 tail (+ the sink buffer), per sequence
    total_bytes: int  # batch * bytes_per_sequence
    ratio_vs_fp16: float  # total_bytes / fp16 total_bytes
    max_batch: int | None = None
    max_context: int | None = None
    shared_prefix_total_bytes: int | None = None
    sink_bytes_per_sequence: int = 0  # the fp16 sink buffer of a format with sink > 0 (in bytes_per_sequence)
    vllm_tokens: int | None = None  # tokens vLLM holds with the kvpack backend in the given KV space
    vllm_refused: str | None = None  # why the kvpack vLLM backend does not serve this format on this model
    vllm_tail_bytes: int | None = None  # of the KV space, what the backend's full-precision tails take
    # the same format with a smaller block that holds more tokens in that space (shorter tails), and its tokens
    vllm_smaller_block: tuple[KVFormat, int] | None = None
    # a float32 model: the same format with float16 tails and sink rows (tail=fp16), and its tokens in that space
    vllm_float16_tails: tuple[KVFormat, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.format.name,
            "spec": self.format.spec_string(),
            "bytes_per_token": self.bytes_per_token,
            "bits_per_element": self.bits_per_element,
            "bytes_per_sequence": self.bytes_per_sequence,
            "total_bytes": self.total_bytes,
            "total_gib": self.total_bytes / GIB,
            "ratio_vs_fp16": self.ratio_vs_fp16,
        }
        if self.format.sink:
            d["sink"] = self.format.sink
            d["sink_bytes_per_sequence"] = self.sink_bytes_per_sequence
        if self.max_batch is not None:
            d["max_batch"] = self.max_batch
            d["max_context"] = self.max_context
        if self.shared_prefix_total_bytes is not None:
            d["shared_prefix_total_bytes"] = self.shared_prefix_total_bytes
        if self.vllm_tokens is not None:
            d["vllm_tokens"] = self.vllm_tokens
        if self.vllm_refused is not None:
            d["vllm_refused"] = self.vllm_refused
        if self.vllm_tail_bytes is not None:
            d["vllm_tail_bytes"] = self.vllm_tail_bytes
        if self.vllm_smaller_block is not None:
            fmt, tokens = self.vllm_smaller_block
            d["vllm_smaller_block"] = {"format": fmt.name, "block_size": fmt.block_size, "vllm_tokens": tokens}
        if self.vllm_float16_tails is not None:
            fmt, tokens = self.vllm_float16_tails
            d["vllm_float16_tails"] = {"format": fmt.name, "vllm_tokens": tokens}
        return d


@dataclass
class SizeEstimate:
    """Inputs and results of one ``kvpack size`` run."""

    model: ModelShape
    context: int
    batch: int
    rows: list[FormatRow]
    fp16_total_bytes: int
    weights_bytes: int | None = None
    gpu_mem_bytes: int | None = None
    shared_prefix: int | None = None
    fp16_shared_prefix_total_bytes: int | None = None
    skipped: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    vllm: VllmSizing | None = None

    @property
    def cache_budget_bytes(self) -> int | None:
        """GPU memory left for the cache once the weights are in (``None`` without ``--gpu-mem``)."""
        if self.gpu_mem_bytes is None:
            return None
        return max(0, self.gpu_mem_bytes - (self.weights_bytes or 0))

    def as_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "model": m.name,
            "layers": m.layers,
            "state_layers": m.state_layers,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "params": m.params,
            "context": self.context,
            "batch": self.batch,
            "gpu_mem_bytes": self.gpu_mem_bytes,
            "weights_bytes": self.weights_bytes,
            "cache_budget_bytes": self.cache_budget_bytes,
            "shared_prefix": self.shared_prefix,
            "tail_included": True,
            "tail_element_bytes": TAIL_ELEMENT_BYTES,
            "fp16_total_bytes": self.fp16_total_bytes,
            "fp16_shared_prefix_total_bytes": self.fp16_shared_prefix_total_bytes,
            "formats": [r.as_dict() for r in self.rows],
            "skipped": self.skipped,
            "advice": self.advice,
            **({"vllm": self.vllm.as_dict()} if self.vllm is not None else {}),
        }


@dataclass(frozen=True)
class VllmSizing:
    """The vLLM question: ``space_bytes`` of KV cache (``kv_cache_memory_bytes``), ``seqs`` = ``max_num_seqs``,
    activations of ``act_bytes``; ``default_tokens``: what vLLM's own cache holds there in the model's dtype."""

    space_bytes: int
    seqs: int
    act_bytes: int
    default_tokens: int
    speculative: bool = False  # speculative decoding: two tail slots per request (a reserve each)

    @property
    def tail_slots(self) -> int:
        """Full-precision tail slots per layer the backend pays for."""
        return self.seqs * (2 if self.speculative else 1)

    def as_dict(self) -> dict[str, Any]:
        return {"space_bytes": self.space_bytes, "max_num_seqs": self.seqs, "act_bytes": self.act_bytes,
                "default_tokens": self.default_tokens, "speculative": self.speculative,
                "tail_slots": self.tail_slots}  # fmt: skip


def estimate(
    model: ModelShape,
    context: int,
    batch: int = 1,
    formats: list[KVFormat] | None = None,
    gpu_mem_bytes: int | None = None,
    weights_bytes: int | None = None,
    shared_prefix: int | None = None,
    skip_invalid: bool = False,
    vllm: tuple[int, int, int] | None = None,
    speculative: int = 0,
) -> SizeEstimate:
    """Size the cache of ``batch`` sequences of ``context`` tokens in each format.

    Args:
        model: the shape (layers, kv_heads, head_dim, and optionally the parameter count).
        context, batch: tokens per sequence and sequences, both positive.
        formats: formats to compare (default: every preset).
        gpu_mem_bytes: GPU memory; enables the max_batch / max_context columns.
        weights_bytes: weights' size (default: ``model.params`` at 2 bytes each, when known).
        shared_prefix: tokens at the start of every sequence that are stored once.
        skip_invalid: drop formats that cannot store this head_dim (listed in ``skipped``) instead of
            raising :class:`FormatError`.
        vllm: ``(space_bytes, max_num_seqs, act_bytes)``: also how many tokens vLLM holds in that KV space with
            each format (:func:`vllm_capacity_tokens`) and with its own cache.
        speculative: vLLM's ``num_speculative_tokens`` (0: no speculative decoding): with drafts the backend keeps
            two tail slots per request (a sealed block's reserve, for drafts rolled back into it), and a smaller
            block it names must be longer than the drafts.
    """
    for name, v in (("context", context), ("batch", batch)):
        if not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if shared_prefix is not None and not 0 < shared_prefix <= context:
        raise ConfigError(f"--shared-prefix must be between 1 and the context ({context}), got {shared_prefix}")
    if gpu_mem_bytes is not None and gpu_mem_bytes <= 0:
        raise ConfigError(f"GPU memory must be positive, got {gpu_mem_bytes} bytes")
    if weights_bytes is not None and weights_bytes < 0:
        raise ConfigError(f"weights size must not be negative, got {weights_bytes} bytes")
    if weights_bytes is None and model.params is not None:
        weights_bytes = model.params * WEIGHT_BYTES_PER_PARAM
    if gpu_mem_bytes is not None and weights_bytes is None:
        raise ConfigError(
            f"model {model.name!r} has no parameter count, so the weights' size is unknown; "
            "give --weights-gib (or --model with a known model) together with --gpu-mem"
        )
    h, d, n_layers = model.kv_heads, model.head_dim, model.layers
    slots = None if vllm is None else vllm[1] * (2 if speculative else 1)  # tail slots per layer
    if vllm is not None and model.state_layers:
        raise ConfigError(
            f"model {model.name!r} is a hybrid ({model.state_layers} of its layers keep a state, not keys and values): "
            "vLLM's hybrid cache manager pages both kinds together, which kvpack size does not predict; drop "
            "--vllm-space (the kvpack cache of its attention layers is sized without it)"
        )

    fp16 = PRESETS["fp16"]
    fp16_total = batch * fp16.bytes_for_tokens(context, h, d, n_layers)
    result = SizeEstimate(model, context, batch, [], fp16_total, weights_bytes, gpu_mem_bytes, shared_prefix)
    if shared_prefix is not None:
        result.fp16_shared_prefix_total_bytes = shared_prefix_bytes(fp16, context, batch, shared_prefix, h, d, n_layers)
    budget = result.cache_budget_bytes
    space = (
        None if vllm is None else VllmSpace(n_layers, h, d, vllm[2], vllm[0], slots, model.windows, int(speculative))
    )
    for fmt in formats if formats is not None else PRESETS.values():
        reasons = fmt.reasons_invalid(d)
        if reasons:
            if not skip_invalid:
                fmt.check(d)
            result.skipped.append(f"{fmt.name}: {'; '.join(reasons)}")
            continue
        if isinstance(fmt, LayerPlan):
            row = _plan_row(fmt, context, batch, fp16_total, budget, shared_prefix, model)
            if vllm is not None:
                row.vllm_refused = vllm_refusal(fmt, model.windows)
            if space is not None and row.vllm_refused is None:
                row.vllm_tokens = space.tokens(fmt)
                row.vllm_tail_bytes = space.tail_bytes(fmt.base)
            result.rows.append(row)
            continue
        per_seq = fmt.bytes_for_tokens(context, h, d, n_layers, TAIL_ELEMENT_BYTES)
        row = FormatRow(
            format=fmt,
            bytes_per_token=fmt.bytes_per_token(h, d, n_layers),
            bits_per_element=fmt.bits_per_element(h, d),
            bytes_per_sequence=per_seq,
            total_bytes=batch * per_seq,
            ratio_vs_fp16=batch * per_seq / fp16_total,
            sink_bytes_per_sequence=n_layers * fmt.sink_bytes(h, d, TAIL_ELEMENT_BYTES),
        )
        if budget is not None:
            row.max_batch = max_batch(fmt, budget, context, h, d, n_layers)
            row.max_context = max_context(fmt, budget // batch, h, d, n_layers)
        if shared_prefix is not None:
            row.shared_prefix_total_bytes = shared_prefix_bytes(fmt, context, batch, shared_prefix, h, d, n_layers)
        if space is not None:
            row.vllm_tokens = space.tokens(fmt)
            row.vllm_tail_bytes = space.tail_bytes(fmt)
            row.vllm_smaller_block = vllm_smaller_block(fmt, space)
            row.vllm_float16_tails = vllm_float16_tails(fmt, space)
        result.rows.append(row)
    if vllm is not None:
        space, seqs, act = vllm
        if space <= 0 or seqs <= 0 or act not in (2, 4):
            raise ConfigError(f"the vLLM space, max_num_seqs and activation bytes must be positive, got {vllm}")
        page = 2 * h * d * act * 64  # vLLM's own cache, 64-token pages of K and V in the model's dtype
        result.vllm = VllmSizing(
            space, seqs, act, space // (page * vllm_layers_per_block(n_layers, model.windows)) * 64, bool(speculative)
        )
    if not result.rows:
        raise FormatError(f"no format can store head_dim {d}: " + "; ".join(result.skipped))
    result.advice = advice(result)
    return result


def _plan_row(
    p: LayerPlan, context: int, batch: int, fp16_total: int, budget: int | None, shared: int | None, model: ModelShape
) -> FormatRow:
    """The :class:`FormatRow` of a per-layer plan: each format's figures over its own layers, summed (every
    format keeps its own pool, tails and sinks: :class:`kvpack.cache.layered.LayeredKVCache`)."""
    h, d = model.kv_heads, model.head_dim
    counts = p.layer_counts(model.layers)

    def per_seq(tokens: int) -> int:
        return sum(f.bytes_for_tokens(tokens, h, d, n, TAIL_ELEMENT_BYTES) for f, n in counts)

    seq = per_seq(context)
    row = FormatRow(
        format=p,  # type: ignore[arg-type]  (a plan answers what a row reads of its format)
        bytes_per_token=sum(f.bytes_per_token(h, d, n) for f, n in counts),
        bits_per_element=p.bits_per_element(h, d, model.layers),
        bytes_per_sequence=seq,
        total_bytes=batch * seq,
        ratio_vs_fp16=batch * seq / fp16_total,
        sink_bytes_per_sequence=sum(n * f.sink_bytes(h, d, TAIL_ELEMENT_BYTES) for f, n in counts),
    )
    if budget is not None:
        row.max_batch = max(0, budget // seq)
        lo, hi, room = 0, 1, budget // batch  # the longest context whose bytes fit: per_seq grows with tokens
        while per_seq(hi) <= room and hi < 2**40:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if per_seq(mid) <= room else (lo, mid)
        row.max_context = lo if per_seq(lo) <= room and lo > 0 else 0
    if shared is not None:
        row.shared_prefix_total_bytes = sum(shared_prefix_bytes(f, context, batch, shared, h, d, n) for f, n in counts)
    return row


# ----------------------------------------------------------------------------------------------------
# Advice: when a quantized cache is worth it, after the reference article's "When not to bother"


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 1024**2:,.2f} MiB"


def advice(p: SizeEstimate) -> list[str]:
    """Plain-language lines about whether the cache is the thing to shrink."""
    lines: list[str] = []
    m = p.model
    cache = p.fp16_total_bytes
    best = min(p.rows, key=lambda r: r.total_bytes)
    if p.weights_bytes:
        share = cache / (p.weights_bytes + cache)
        lines.append(
            f"weights vs cache: weights {_gib(p.weights_bytes)}, fp16 cache {_gib(cache)} "
            f"({share:.1%} of weights plus cache)."
        )
        if share < SMALL_CACHE_SHARE:
            lines.append(
                f"the cache is a small share of memory at this context and batch: even {best.format.name} frees only "
                f"{_gib(cache - best.total_bytes)}; quantizing buys little here, keep fp16 unless memory is that tight."
            )
        elif cache > p.weights_bytes:
            lines.append("the cache outgrows the weights: it is what limits you, and a smaller format is the lever.")
    elif p.context <= 4096 and p.batch <= 4:
        lines.append(
            f"short context and small batch: the fp16 cache is only {_gib(cache)}; quantizing it buys little "
            "unless memory is that tight (give --model or --weights-gib to compare with the weights)."
        )
    if m.is_mqa:
        factor = f" {m.gqa_factor}x" if m.gqa_factor else ""
        lines.append(
            f"one kv head (MQA): the group factor already shrank the cache{factor}; with a modest context the "
            "cache may not be your constraint."
        )
    if p.shared_prefix is not None and p.fp16_shared_prefix_total_bytes is not None and p.batch > 1:
        dedup = cache - p.fp16_shared_prefix_total_bytes
        int8 = next((r for r in p.rows if r.format.name == "int8"), None)
        fmt_saving = cache - (int8.total_bytes if int8 else cache // 2)
        if dedup >= fmt_saving:
            lines.append(
                f"large shared prefix: storing it once saves {_gib(dedup)} ({dedup / cache:.0%}) at fp16, more than "
                f"int8 saves ({_gib(fmt_saving)}), and costs no accuracy: deduplicate first; the two compose."
            )
        else:
            lines.append(
                f"prefix sharing saves {_gib(dedup)} ({dedup / cache:.0%}) at fp16, less than int8 ({_gib(fmt_saving)}); "
                "both compose."
            )
    elif p.shared_prefix is not None and p.batch == 1:
        lines.append("a shared prefix saves nothing with one sequence: it is stored once either way.")
    if p.gpu_mem_bytes is not None and p.weights_bytes is not None and p.weights_bytes >= p.gpu_mem_bytes:
        lines.append(f"the weights alone ({_gib(p.weights_bytes)}) fill the GPU memory ({_gib(p.gpu_mem_bytes)}).")
    return lines


# ----------------------------------------------------------------------------------------------------
# vLLM pages (kvpack.integrations.vllm.layout lays them out from these numbers)

# A model's activation dtypes under vLLM and their bytes: its own cache, and kvpack's tails and sink rows, take them
MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_ALIGN = 16  # bytes: every region of a page starts on a multiple, so any element type is aligned


@dataclass(frozen=True)
class VllmPage:
    """The bytes of one kvpack block of one layer inside a vLLM page.

    Attributes:
        regions: ``(name, offset, nbytes)`` in page order: ``k_data``, ``k_scale``, ``k_zero``, ``v_data``,
            ``v_scale``, ``v_zero`` (those the format has), then ``sink_k``, ``sink_v`` with a sink.
        cell_bytes: ``C``, vLLM's bytes per token slot, a multiple of the activation size (vLLM views the cells
            in the model's dtype); ``page_bytes = block_size * C``.
        page_bytes: the page, as vLLM allocates it.
    """

    regions: tuple[tuple[str, int, int], ...]
    cell_bytes: int
    page_bytes: int


def vllm_page(fmt: KVFormat, kv_heads: int, head_dim: int, act_bytes: int) -> VllmPage:
    """The page of ``fmt`` for a layer of ``kv_heads`` x ``head_dim`` whose activations take ``act_bytes`` each
    (the sink rows are kept in the tail dtype, the format's ``tail`` or else the model's, in every page: vLLM shares
    a first block without telling the backend)."""
    h, b, d = kv_heads, fmt.block_size, head_dim
    sizes = []
    for prefix, spec in (("k", fmt.key), ("v", fmt.value)):
        sizes.append((f"{prefix}_data", spec.payload_bytes(h, b, d)))
        shape = spec.scale_shape(h, b, d)
        if shape is not None:
            n = math.prod(shape)
            sizes.append((f"{prefix}_scale", n * spec.scale_dtype.bytes))
            if spec.has_zero:
                sizes.append((f"{prefix}_zero", n * spec.zero_dtype.bytes))
        if spec.has_outliers:  # keys only: residuals [H, B, w] (fp16, or packed refinement codes), indices [H, k]
            sizes.append((f"{prefix}_outlier", h * b * spec.residual_width * spec.residual_itemsize))
            sizes.append((f"{prefix}_outlier_idx", h * spec.outliers * spec.outlier_index_bytes(d)))
    if fmt.sink:  # in the tail dtype: the format's own (tail=), else the model's
        sink = h * fmt.sink * d * fmt.tail_element_bytes(act_bytes)
        sizes += [("sink_k", sink), ("sink_v", sink)]
    regions, offset = [], 0
    for name, n in sizes:
        regions.append((name, offset, n))
        offset += -(-n // VLLM_ALIGN) * VLLM_ALIGN
    cell = -(-offset // b)
    cell = -(-cell // act_bytes) * act_bytes  # vLLM views a page's cells in the model's dtype
    return VllmPage(tuple(regions), cell, cell * b)


def vllm_tail_bytes(fmt: KVFormat, layers: int, kv_heads: int, head_dim: int, act_bytes: int, seqs: int) -> int:
    """The kvpack backend's full-precision tails in vLLM: one block of K and V per layer for each of ``seqs``
    running requests (``max_num_seqs``), paid from the KV space."""
    return seqs * layers * fmt.tail_bytes(kv_heads, head_dim, act_bytes)


# Smaller blocks tried where the tails take much of a vLLM space, and the least gain in tokens worth naming
VLLM_SMALLER_BLOCKS = (32, 16)
VLLM_SMALLER_BLOCK_GAIN = 1.05


@dataclass(frozen=True)
class VllmSpace:
    """One vLLM worker's KV space for a model's shape: what the kvpack backend's capacity depends on besides the
    format (:func:`vllm_capacity_tokens`'s arguments)."""

    layers: int
    kv_heads: int
    head_dim: int
    act_bytes: int
    space_bytes: int
    seqs: int
    windows: Sequence[int | None] | None = None
    drafts: int = 0  # num_speculative_tokens: the backend keeps a step's drafts inside one block, so blocks > drafts

    def tokens(self, fmt: KVFormat | LayerPlan) -> int:
        """:func:`vllm_capacity_tokens` of ``fmt`` in this space."""
        return vllm_capacity_tokens(fmt, self.layers, self.kv_heads, self.head_dim, self.act_bytes, self.space_bytes,
                                    self.seqs, self.windows)  # fmt: skip

    def tail_bytes(self, fmt: KVFormat) -> int:
        """:func:`vllm_tail_bytes` of ``fmt`` for this space's requests."""
        return vllm_tail_bytes(fmt, self.layers, self.kv_heads, self.head_dim, self.act_bytes, self.seqs)


def vllm_smaller_block(fmt: KVFormat, space: VllmSpace) -> tuple[KVFormat, int] | None:
    """``fmt`` with the smaller block (:data:`VLLM_SMALLER_BLOCKS`) that holds the most tokens in this vLLM space,
    and those tokens, when that is at least 5% more than ``fmt`` holds; else None.

    Each running request keeps its open block in full precision (its tail), so where the tails take much of the
    space a smaller block holds more, though each sealed token then carries more scale bytes (per-channel key
    scales cover fewer tokens)."""
    have = space.tokens(fmt)
    best: tuple[KVFormat, int] | None = None
    for b in VLLM_SMALLER_BLOCKS:
        if b >= fmt.block_size or fmt.sink > b or b <= space.drafts:
            continue
        try:
            other = fmt.with_block_size(b)
        except (ConfigError, FormatError):
            continue
        if other.reasons_invalid(space.head_dim):
            continue
        tokens = space.tokens(other)
        if tokens >= have * VLLM_SMALLER_BLOCK_GAIN and (best is None or tokens > best[1]):
            best = (other, tokens)
    return best


def vllm_float16_tails(fmt: KVFormat, space: VllmSpace) -> tuple[KVFormat, int] | None:
    """For a float32 model (``space.act_bytes == 4``), ``fmt`` with its tails and sink rows in float16
    (``tail=fp16``) and the tokens it holds in this vLLM space, when that is at least 5% more than ``fmt`` holds;
    else None (a 16-bit model, a format that names its tail dtype, or a passthrough format)."""
    if space.act_bytes != 4 or fmt.tail is not None or fmt.is_passthrough:
        return None
    other = fmt.with_tail(DType.FP16)
    tokens = space.tokens(other)
    return (other, tokens) if tokens >= space.tokens(fmt) * VLLM_SMALLER_BLOCK_GAIN else None


VLLM_PLAN_WITH_WINDOWS = (
    "a per-layer plan on a model with sliding-window layers: the kvpack vLLM backend does not serve it (vLLM groups "
    "such a model's layers by attention type, a group needing pages of one size)"
)


def vllm_refusal(fmt: KVFormat | LayerPlan, windows: Sequence[int | None] | None) -> str | None:
    """Why the kvpack vLLM backend does not serve ``fmt`` on a model whose layers have these sliding windows
    (None: it does)."""
    if isinstance(fmt, LayerPlan) and fmt.overrides and windows and any(w is not None for w in windows):
        return VLLM_PLAN_WITH_WINDOWS
    return None


def vllm_layers_per_block(layers: int, windows: Sequence[int | None] | None = None) -> int:
    """How many layers' pages one vLLM block id costs.

    A model whose layers all attend alike has one KV cache group: a block id names a page in every layer. A model
    with sliding-window layers beside others (``windows``: each layer's window, ``None`` for full attention) is
    split by vLLM into groups of equal size, one attention type each, with their own block tables over one pool
    of block ids, so an id costs a page in one group's layers. The group size is vLLM's rule: the fewest layers
    of any attention type, or the most when no type has 1.5x the fewest's.
    """
    if not windows or len(set(windows)) == 1:
        return layers
    counts = [sum(1 for w in windows if w == kind) for kind in dict.fromkeys(windows)]
    fewest, most = min(counts), max(counts)
    return most if most < fewest * 1.5 else fewest


def vllm_capacity_tokens(
    fmt: KVFormat | LayerPlan,
    layers: int,
    kv_heads: int,
    head_dim: int,
    act_bytes: int,
    space_bytes: int,
    seqs: int,
    windows: Sequence[int | None] | None = None,
) -> int:
    """Tokens vLLM holds with the kvpack backend in ``space_bytes`` of KV space: its block ids times the block
    size, after the tails of ``seqs`` requests. A per-layer plan's layers each take their own format's page (one
    block id names a page in every layer, so a block costs the sum of the layers' pages); its formats share the
    base's block size, so the tails cost what the base format's do. With sliding-window layers (``windows``) a
    block id costs the pages of one group's layers (:func:`vllm_layers_per_block`)."""
    fmts = fmt.formats(layers) if isinstance(fmt, LayerPlan) else [fmt] * layers
    left = space_bytes - vllm_tail_bytes(fmts[0], layers, kv_heads, head_dim, act_bytes, seqs)
    refused = vllm_refusal(fmt, windows)
    if refused:
        raise ConfigError(f"{refused}; give one format")
    per_block = vllm_layers_per_block(layers, windows)
    if per_block == layers:
        block = sum(vllm_page(f, kv_heads, head_dim, act_bytes).page_bytes for f in fmts)
    else:
        block = per_block * vllm_page(fmts[0], kv_heads, head_dim, act_bytes).page_bytes
    return max(left, 0) // block * fmts[0].block_size
