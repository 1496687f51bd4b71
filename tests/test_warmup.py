"""The CPU kernels' first compile: telling a cold numba cache from a warm one, and saying so on stderr."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest

from kvpack.cli import compile_note
from kvpack.kernels import warmup

numba = pytest.importorskip("numba")


def _module(tmp_path, name="tiny_numba"):
    path = tmp_path / f"{name}.py"
    path.write_text(
        textwrap.dedent(
            """
            from numba import njit


            @njit(cache=True)
            def work(x):
                return x + 1
            """
        ),
        encoding="utf-8",
    )
    return path


def _import(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cold_until_numba_writes_its_index_then_warm(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    path = _module(tmp_path)
    assert warmup._first_line(path, "work") == 5  # the decorator's line, as numba names the cache files
    assert warmup._fresh_index(path, "work") is None
    assert _import(path).work(1) == 2  # numba compiles and writes its cache next to the module
    found = warmup._fresh_index(path, "work")
    assert found is not None and found.parent == tmp_path / "__pycache__" and found.suffix == ".nbi"
    assert warmup._fresh_index(path, "other") is None
    later = found.stat().st_mtime + 10
    os.utime(path, (later, later))  # the source changed since: numba would recompile
    assert warmup._fresh_index(path, "work") is None


def test_numba_cache_dir_is_where_it_looks(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(cache))
    (tmp_path / "src").mkdir()
    path = _module(tmp_path / "src", name="elsewhere_numba")
    assert warmup.cache_dirs(path)[0].parent == cache
    assert warmup._fresh_index(path, "work") is None
    _import(path).work(2)
    found = warmup._fresh_index(path, "work")
    assert found is not None and found.is_relative_to(cache)
    assert not list(path.parent.glob("__pycache__/*.nbi"))  # not in the tree: numba used the folder given


def test_warm_up_compiles_the_real_kernels():
    seconds = warmup.warm_up()  # compiles on a cold machine, loads from the cache otherwise
    assert seconds >= 0
    assert warmup.cold_entries() == []  # both entry points are in numba's cache now


def test_compile_note_only_when_cold(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(warmup, "warm_up", lambda: ran.append(1) or 81.4)
    monkeypatch.setattr(warmup, "cold_entries", lambda: [])
    assert compile_note.compile_cpu_kernels("auto") is None
    assert capsys.readouterr().err == "" and not ran
    monkeypatch.setattr(warmup, "cold_entries", lambda: ["cpu_decode_numba.launch_one"])
    assert compile_note.compile_cpu_kernels("reference") is None and not ran  # no CPU kernel will run
    assert compile_note.compile_cpu_kernels("auto") == 81.4
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "compiling the CPU attention kernels" in err[0] and "once per machine" in err[0]
    assert err[1] == "kvpack: CPU kernels compiled in 81 s"


def test_bench_decode_says_it_compiles_before_the_sweep(monkeypatch, capsys):
    from kvpack.bench import decode
    from kvpack.cli.main import main

    monkeypatch.setattr(warmup, "cold_entries", lambda: ["cpu_decode_numba.launch_one"])
    monkeypatch.setattr(warmup, "warm_up", lambda: 3.0)
    seen = []

    def sweep(cfg, progress):
        seen.append(capsys.readouterr().err)
        return [], 0.0

    monkeypatch.setattr(decode, "run_sweep", sweep)
    monkeypatch.setattr(decode, "format_table", lambda rows, bw: "")
    assert main(["bench", "decode", "--formats", "int4", "--contexts", "1k"]) == 0
    assert "compiling the CPU attention kernels" in seen[0] and "compiled in 3 s" in seen[0]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths")
def test_cold_entries_is_cheap():
    import time

    t = time.perf_counter()
    for _ in range(5):
        warmup.cold_entries()
    assert (time.perf_counter() - t) / 5 < 0.5


def test_generate_says_it_compiles_after_the_model_loads(monkeypatch, capsys):
    import torch

    import kvpack.models
    from kvpack.cli.main import main
    from kvpack.evaluation.tiny import ByteTokenizer, tiny_model

    class Tok(ByteTokenizer):
        def __call__(self, text, return_tensors=None, **kw):
            ids = super().__call__(text)["input_ids"]
            return {"input_ids": torch.tensor([ids])} if return_tensors == "pt" else {"input_ids": ids}

    model, _ = tiny_model(seed=0, max_positions=256)
    order = []
    monkeypatch.setattr(kvpack.models, "load_model", lambda path=None: order.append("load") or (model, Tok()))
    monkeypatch.setattr(warmup, "cold_entries", lambda: ["cpu_decode_numba.launch_one"])
    monkeypatch.setattr(warmup, "warm_up", lambda: order.append("compile") or 2.0)
    assert main(["generate", "--prompt", "Hello", "--max-new-tokens", "2", "--raw", "--format", "int8"]) == 0
    assert order == ["load", "compile"]
    err = capsys.readouterr().err
    assert "compiling the CPU attention kernels" in err and "compiled in 2 s" in err
    assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "1", "--raw", "--backend", "reference"]) == 0
    assert order == ["load", "compile", "load"]  # the reference backend runs no compiled kernel


def test_numba_pool_start_keeps_torchs_thread_count():
    """numba's omp layer shares torch's OpenMP runtime and sets its thread count when the pool starts:
    ``torch.set_num_threads(1)`` before the first kernel call must still hold after it (fresh process: the
    pool starts once per process; bench generate --threads 1 ran its later rows on two threads)."""
    import subprocess

    code = (
        "import torch; torch.set_num_threads(1)\n"
        "torch.randn(1 << 22).exp_()\n"  # a parallel region: torch's OpenMP runtime now reads the shared count
        "from kvpack.kernels import cpu_decode\n"
        "cpu_decode.passive_pool()\n"
        "import numba; print(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)\n"
    )
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "2"]
