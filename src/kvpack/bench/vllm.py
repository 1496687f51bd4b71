"""``kvpack bench vllm``: vLLM offline on the embedded model at a fixed KV space, kvpack formats against vLLM's own.

Each workload (:data:`WORKLOADS`) is one a default cache must preempt on: requests with prompts of real prose
(the standard library's ``pydoc_data.topics``) sharing a prefix, all submitted at once, greedy, a fixed number of
new tokens each (``ignore_eos``): many long prompts (``full``, the default), fewer and shorter ones (``quick``),
or few short prompts with long answers in a small space (``long-output``). Every provider runs in a fresh process (:func:`kvpack.integrations.vllm.engine.run_engine`)
with the same KV space (``kv_cache_memory_bytes``: kvpack's full-precision tails are paid from it), the same
scheduler limits and the same prompts. ``greedy_match`` is the share of sequences whose tokens equal vLLM's
default cache's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpack.errors import ConfigError
from kvpack.integrations.vllm.config import names_block
from kvpack.integrations.vllm.engine import run_engine
from kvpack.plans import parse_plan
from kvpack.sizing import MODEL_DTYPE_BYTES

__all__ = [
    "PROVIDERS",
    "WORKLOADS",
    "Row",
    "base_job",
    "make_row",
    "prose_token_ids",
    "provider_job",
    "run",
    "workload",
]

# (row name, kvpack format or None, vLLM kv_cache_dtype)
PROVIDERS = {
    "vllm-default": (None, "auto"),
    "vllm-fp8": (None, "fp8"),
    "int8": ("int8", "auto"),
    "int4": ("int4", "auto"),
    "k4v2": ("k4v2", "auto"),
}
# The embedded model runs in float32: vLLM's default cache then holds 46 KiB a token (30 layers), and kvpack's
# tails (one float32 block of K and V per layer for each of max_num_seqs requests) come out of the same space.
# Decode dominates (more new tokens than prompt tokens after the shared prefix) and the space is what limits the
# running batch: at their longest the quick workload's sequences need about 14k tokens of KV, and vLLM's own
# float32 cache holds 4k of them in 192 MiB, so it runs about a third of the requests at once and preempts.
FULL = {"requests": 48, "prefix": 256, "extra": (128, 384), "max_tokens": 256, "kv_mib": 320, "max_num_seqs": 32}
QUICK = {"requests": 32, "prefix": 128, "extra": (64, 192), "max_tokens": 160, "kv_mib": 192, "max_num_seqs": 32}
# Long answers to short prompts: the KV grows while decoding, to about 550 tokens a request, and 128 MiB holds
# about five such requests in vLLM's float32 cache, so its running batch is what the space allows (a step costs
# much less than its batch's share: the weights are read once per step). Where KV capacity buys throughput.
LONG_OUTPUT = {"requests": 16, "prefix": 64, "extra": (96, 160), "max_tokens": 384, "kv_mib": 128, "max_num_seqs": 16}
WORKLOADS = {"full": FULL, "quick": QUICK, "long-output": LONG_OUTPUT}


@dataclass
class Row:
    format: str
    block_size: int  # vLLM's block: the format's own, or a smaller one the backend served (config.serve_block)
    kv_capacity_tokens: int
    max_running: int
    preemptions: int
    tokens_per_s: float
    wall_s: float
    greedy_match: float
    prefix_hit_tokens: int


def prose_token_ids(model_path: str) -> list[int]:
    """Token ids of real prose (every ``pydoc_data.topics`` entry, in name order) under the model's tokenizer."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return tok(" ".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]


def workload(ids: list[int], requests: int, prefix: int, extra: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """``requests`` prompts: a shared ``prefix`` of ``ids``, then each its own stretch of ``extra`` tokens."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(extra[0], extra[1] + 1, size=requests)
    starts = rng.integers(prefix, len(ids) - extra[1], size=requests)
    return [ids[:prefix] + ids[s : s + n] for s, n in zip(starts.tolist(), lens.tolist())]


def base_job(
    quick: bool = False,
    model: str | None = None,
    kv_mib: int | None = None,
    max_num_seqs: int | None = None,
    kernel: str = "auto",
    dtype: str = "float32",
    workload_name: str | None = None,
) -> dict[str, Any]:
    """The engine job every provider of a run shares (:mod:`kvpack.integrations.vllm.engine`): the workload's
    prompts, limits, KV space and the model's dtype (``float32``, ``bfloat16`` or ``float16``: vLLM's own cache
    and kvpack's tails and sink rows take it); a provider adds its keys (:func:`provider_job`). The workload is
    ``workload_name`` (a key of :data:`WORKLOADS`), else ``quick`` or ``full`` as ``quick`` says."""
    if dtype not in MODEL_DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(MODEL_DTYPE_BYTES)}; got {dtype!r}")
    name = workload_name or ("quick" if quick else "full")
    if name not in WORKLOADS:
        raise ConfigError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    from kvpack.models.embedded import ensure_converted

    cfg = WORKLOADS[name]
    path = str(model or ensure_converted())
    prompts = workload(prose_token_ids(path), cfg["requests"], cfg["prefix"], cfg["extra"])
    longest = max(len(p) for p in prompts) + cfg["max_tokens"]
    return {
        "model": path,
        "prompts": prompts,
        "max_tokens": cfg["max_tokens"],
        "kv_bytes": int((kv_mib or cfg["kv_mib"]) * 2**20),
        "max_num_seqs": max_num_seqs or cfg["max_num_seqs"],
        "max_model_len": -(-longest // 64) * 64,
        "max_num_batched_tokens": 512,
        "kernel": kernel,
        "dtype": dtype,
        "warmup_requests": 4,  # decode on several threads compiles in the warm-up, not in the timing
    }


def run(
    providers: list[str] | None = None,
    quick: bool = False,
    model: str | None = None,
    kv_mib: int | None = None,
    max_num_seqs: int | None = None,
    kernel: str = "auto",
    dtype: str = "float32",
    workload_name: str | None = None,
    calibration: str | None = None,
) -> list[Row]:
    """Run each provider once in a fresh process; returns one row per provider (the first is the reference).
    ``calibration`` (a ``kvpack calibrate`` folder) goes to the providers whose formats need one."""
    base = base_job(quick, model, kv_mib, max_num_seqs, kernel, dtype, workload_name)
    jobs = [(name, provider_job(name, calibration)) for name in providers or list(PROVIDERS)]  # all checked first
    rows, reference = [], None
    for name, job in jobs:
        res = run_engine({**base, **job})
        if reference is None:
            reference = res["outputs"]
        rows.append(make_row(name, res, reference))
    return rows


def provider_job(name: str, calibration: str | None = None) -> dict[str, Any]:
    """A provider's keys of an engine job: the kvpack format (None: vLLM's own cache), vLLM's kv_cache_dtype and
    block size (64 for vLLM's own cache; a kvpack format's own where it names one, ``int8,block=32`` running with
    32-token blocks; else None, left to the kvpack backend, which serves a smaller block where the tails crowd the
    space, as for a user who gives none), and ``calibration`` where the format needs an artifact (static specs,
    query-ranked outlier channels ``o<N>q``). ``name`` is a key of :data:`PROVIDERS` or a kvpack format string.

    Raises:
        FormatError: ``name`` is no provider and no format.
        ConfigError: the format needs an artifact and ``calibration`` is None.
    """
    fmt, dtype = PROVIDERS.get(name, (name, "auto"))
    plan = None if fmt is None else parse_plan(fmt)  # a bad format stops here
    block: int | None = 64 if plan is None else plan.base.block_size
    if fmt is not None and not names_block(fmt):
        block = None  # what a user who names no block gets: the backend's choice for the space (config.serve_block)
    job = {"format": fmt, "kv_cache_dtype": dtype, "block_size": block}
    if plan is not None and any(f.needs_artifact for f in plan.distinct_formats):
        if calibration is None:
            raise ConfigError(
                f"--formats {name!r} needs a calibration artifact (static scales or o<N>q query statistics): pass "
                "--calibration DIR, DIR from `kvpack calibrate --out DIR` (with --model for another model)"
            )
        job["calibration"] = calibration
    return job


def make_row(name: str, res: dict[str, Any], reference: list[list[int]]) -> Row:
    """The row of one engine result (:func:`~kvpack.integrations.vllm.engine.run_engine`); ``greedy_match``
    against ``reference``, the reference provider's outputs."""
    match = float(np.mean([a == b for a, b in zip(res["outputs"], reference)]))
    return Row(name, res["block_size"], res["kv_capacity_tokens"], res["max_running"], res["preemptions"],
               res["tokens_per_s"], res["wall_s"], match, sum(res["cached_tokens"]))  # fmt: skip


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width table."""
    head = f"{'format':<14}{'block':>6}{'kv_capacity_tokens':>19}{'max_running':>12}{'preemptions':>12}"
    head += f"{'tokens_per_s':>13}{'wall_s':>9}{'greedy_match':>13}{'prefix_hits':>12}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.format:<14}{r.block_size:>6}{r.kv_capacity_tokens:>19,}{r.max_running:>12}{r.preemptions:>12}"
            f"{r.tokens_per_s:>13.1f}{r.wall_s:>9.1f}{r.greedy_match:>13.2f}{r.prefix_hit_tokens:>12,}"
        )
    return "\n".join(lines)


def to_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
