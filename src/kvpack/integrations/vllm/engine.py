"""Run one vLLM engine in a fresh process and report what it did: outputs, KV capacity, scheduling, time.

vLLM keeps process-wide state (distributed groups, the current platform), so a second engine in one process is
not clean; each run here is ``python -m kvpack.integrations.vllm.engine`` with a JSON job on stdin and a JSON
result on stdout. The same driver serves the tests and ``kvpack bench vllm``, and a benchmark's providers each
get a fresh process.

A job (all keys optional but ``model`` and ``prompts``)::

    {"model": PATH, "format": "int4" | null (vLLM's own cache) , "kv_cache_dtype": "auto" | "fp8",
     "kernel": "auto", "calibration": null (a `kvpack calibrate` folder, for static formats),
     "prompts": [[token ids], ...], "max_tokens": 64, "temperature": 0.0, "seed": 0,
     "kv_bytes": 268435456, "max_num_seqs": 16, "max_model_len": 2048, "max_num_batched_tokens": 512,
     "enable_prefix_caching": true, "dtype": "float32", "block_size": 64 (null: vLLM's default), "threads": null,
     "warmup": true, "warmup_requests": 1, "detokenize": true, "n": 1, "prompt_logprobs": false,
     "abort": null | {"every": 3, "after_steps": 8},
     "engine_kwargs": {...more vllm.LLM arguments}}

``warmup`` runs ``warmup_requests`` (default 1) requests first, outside the counts and the timing (kernel
compilation, first calls).
``engine_kwargs`` with ``tensor_parallel_size`` / ``pipeline_parallel_size`` above 1 runs vLLM's multiprocess
executor (its CPU workers unbound from NUMA nodes, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, unless set; ``threads``
is then each worker's).
On CUDA a kvpack format needs ``engine_kwargs={"attention_backend": "CUSTOM"}`` (vLLM's CUDA platform picks its own
backend otherwise); a job with a format whose engine holds no kvpack tail table fails rather than measure vLLM's
own cache under kvpack's name.

The result: ``outputs`` (generated token ids per prompt), ``texts`` (the same, detokenized; empty without
``detokenize``), ``cached_tokens`` (prompt tokens served from the prefix cache, per prompt), ``num_blocks``,
``block_size`` (vLLM's, in tokens), ``served_format`` (the kvpack format the engine serves: the job's, or the
same with a smaller block where the tails crowd the space and the job's ``block_size`` is null; null for vLLM's
cache), ``kv_capacity_tokens``, ``max_running``, ``preemptions``, ``wall_s``, ``generated_tokens``, ``tokens_per_s``,
``completions`` (with ``"n": N`` > 1 in the job: the N sampled completions per prompt, unseeded: vLLM's CPU
sampler refuses a seed there), ``prompt_logprobs`` (with ``"prompt_logprobs": true``: each prompt token's
log-probability given the tokens before it, as the prefill computed it),
``tails_left`` (kvpack tails still held once drained, summed over the workers: after the step that tells the
workers which requests finished, which a serving engine runs at once and ``LLM.generate`` at its next call; null
for vLLM's cache),
``aborted`` (with ``"abort": {"every": K, "after_steps": N}`` in the job: ``{"requests": [...], "running": n}``, the
indices of the requests aborted after ``N`` engine steps, every ``K``-th one not yet finished then, whose
``outputs`` are empty, and how many of them were running; else null),
``reserves_reopened`` (with speculative decoding: sealed blocks that rejected drafts wrote into again, from their
reserves, summed over the workers and the warm-up; null for vLLM's cache), ``steps``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

__all__ = ["run_engine"]


def run_engine(job: dict[str, Any], timeout: float = 1800, python: str | None = None) -> dict[str, Any]:
    """Run ``job`` in a fresh Python process (see the module docstring); returns its result.

    Raises:
        RuntimeError: the engine process failed; the message carries the last lines of its stderr.
    """
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the job's kv_bytes is the budget
    proc = subprocess.run(
        [python or sys.executable, "-m", "kvpack.integrations.vllm.engine"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the vLLM engine process failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _instrument(scheduler, stats: dict[str, int]) -> None:
    """Count scheduling steps, the most requests running at once, and preemptions."""
    schedule, preempt = scheduler.schedule, scheduler._preempt_request

    def counted_schedule(*a, **k):
        out = schedule(*a, **k)
        stats["steps"] += 1
        stats["max_running"] = max(stats["max_running"], len(scheduler.running))
        return out

    def counted_preempt(*a, **k):
        stats["preemptions"] += 1
        return preempt(*a, **k)

    scheduler.schedule = counted_schedule
    scheduler._preempt_request = counted_preempt


def _run_with_aborts(
    engine, scheduler, prompts: list, params, every: int, after_steps: int
) -> tuple[list, dict[str, Any]]:
    """Step ``engine`` through ``prompts``, aborting every ``every``-th request (0, every, 2 * every, ...) that has
    not finished after ``after_steps`` steps, as a server does when its clients go away. Returns the outputs (None
    for an aborted request) and ``{"requests": indices aborted, "running": how many of them were running}``."""
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    report: dict[str, Any] = {"requests": [], "running": 0}
    step = 0
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
        step += 1
        if step == after_steps:
            report["requests"] = [i for i in range(0, len(ids), every) if ids[i] not in done]
            running = len(scheduler.running)
            engine.abort_request([ids[i] for i in report["requests"]])
            report["running"] = running - len(scheduler.running)
    return [done.get(rid) for rid in ids], report


def _main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its state is readable
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if job.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if job.get("format"):  # what the general plugin does, also where kvpack runs from a checkout (no entry points)
        from kvpack.integrations.vllm import register

        register()

    kw: dict[str, Any] = dict(
        enforce_eager=True,
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=job.get("max_num_seqs", 16),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 512),
        enable_prefix_caching=job.get("enable_prefix_caching", True),
        kv_cache_memory_bytes=int(job.get("kv_bytes", 256 * 2**20)),
        seed=job.get("seed", 0),
        kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
    )
    block = job.get("block_size", 64)  # None: vLLM's default, which the kvpack platform sets (config.serve_block)
    if block is not None:
        kw["block_size"] = block
    if job.get("format"):
        kw["additional_config"] = {"kvpack": {"format": job["format"], "kernel": job.get("kernel", "auto")}}
        if job.get("calibration"):
            kw["additional_config"]["kvpack"]["calibration"] = str(job["calibration"])
    kw.update(job.get("engine_kwargs") or {})
    workers = int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))
    if workers > 1:  # vLLM's CPU workers would each bind a NUMA node; one node here, and the OS schedules them
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kw.setdefault("distributed_executor_backend", "mp")
    llm = LLM(job["model"], **kw)
    if job.get("format"):
        from kvpack.integrations.vllm.hooks import worker_tails

        if None in llm.collective_rpc(worker_tails):  # every worker's builders register their tail tables
            from kvpack.errors import ConfigError

            raise ConfigError(
                "kvpack: a format was given but vLLM chose another attention backend; on CUDA pass "
                'engine_kwargs={"attention_backend": "CUSTOM"}'
            )
    core = llm.llm_engine.engine_core.engine_core
    if job.get("warmup", True):  # compiled kernels and first-call costs out of the timing, for every provider
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=job.get("detokenize", True))
        # with warmup_requests > 1 (the benchmarks: 4), requests of up to 448 tokens: enough blocks that decode
        # also runs on several threads (its own compiled entry, for the page views' array layouts)
        many = int(job.get("warmup_requests", 1))
        n = max(1, min(448 if many > 1 else 80, kw["max_model_len"] - 8))
        warm_prompts = [TokensPrompt(prompt_token_ids=[7 + (i * (r + 1)) % 50 for i in range(n)]) for r in range(many)]
        llm.generate(warm_prompts, warm, use_tqdm=False)
        while core.scheduler.has_requests():
            llm.llm_engine.step()
    stats = {"steps": 0, "max_running": 0, "preemptions": 0}
    _instrument(core.scheduler, stats)
    engine_config = llm.llm_engine.vllm_config
    num_blocks = int(engine_config.cache_config.num_gpu_blocks)
    block_size = int(engine_config.cache_config.block_size)
    served = (engine_config.additional_config or {}).get("kvpack") if job.get("format") else None
    sp = SamplingParams(
        temperature=job.get("temperature", 0.0), max_tokens=job.get("max_tokens", 64), n=job.get("n", 1),
        seed=job.get("seed", 0) if job.get("n", 1) == 1 else None,  # vLLM's CPU sampler takes no seed with n > 1
        ignore_eos=job.get("ignore_eos", True), detokenize=job.get("detokenize", True),
        prompt_logprobs=0 if job.get("prompt_logprobs") else None,
    )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    t0 = time.perf_counter()
    aborted = None
    if job.get("abort"):
        outs, aborted = _run_with_aborts(llm.llm_engine, core.scheduler, prompts, sp, **job["abort"])
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    while core.scheduler.has_requests():  # the step that tells the workers which requests finished
        llm.llm_engine.step()
    tails_left = reopened = None
    if job.get("format"):
        from kvpack.integrations.vllm.hooks import worker_reopened

        tails_left = sum(llm.collective_rpc(worker_tails))
        reopened = sum(llm.collective_rpc(worker_reopened))
    generated = sum(len(o.outputs[0].token_ids) for o in outs if o is not None)
    result = {
        "outputs": [[] if o is None else list(o.outputs[0].token_ids) for o in outs],
        "texts": ["" if o is None else o.outputs[0].text for o in outs],
        "cached_tokens": [0 if o is None else int(o.num_cached_tokens or 0) for o in outs],
        "aborted": aborted,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "served_format": served.get("format") if isinstance(served, dict) else served,
        "kv_capacity_tokens": num_blocks * block_size,
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "tails_left": tails_left,
        "reserves_reopened": reopened,
        **stats,
    }
    if job.get("n", 1) > 1:
        result["completions"] = [[list(c.token_ids) for c in o.outputs] for o in outs]
    if job.get("prompt_logprobs"):  # each prompt token's log-probability given the tokens before it
        result["prompt_logprobs"] = [
            [lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])] for o in outs
        ]
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if workers > 1:  # worker processes outlive an os._exit of this one, spinning
        llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # skip vLLM's teardown: nothing is left to flush, and it can hang on exit


if __name__ == "__main__":
    _main()
