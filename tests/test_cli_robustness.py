"""Every subcommand given bad arguments: no traceback, a non-zero exit, and one line that names the argument.

The table is generated (each bad value of each option, in each subcommand) and run in-process through
``kvpack.cli.main.main``; every case must be refused before a model loads or a benchmark starts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvpack.cli.main import main

INTS = ["abc", "-1", "1.5", "", "1e400"]  # never an integer
COUNTS = ["inf", "1e400", "abc", "0", "-5", "1.5", "99999999999999999999999", "nan"]
REALS = ["nan", "inf", "-inf", "abc", ""]
FORMATS = ["int3", "k=int4:o0,v=int4", "int4@static@static", "int4,block=99999999999", "int4,block=0", "@static"]


def _table(paths: dict[str, str]) -> list[tuple[list[str], str]]:
    """``(argv, what the error line must name)``."""
    bad_cfg, kv0, afile, proc = paths["bad_cfg"], paths["kv0"], paths["file"], "/proc/kvpack-out"
    t: list[tuple[list[str], str]] = [(["bogus"], "bogus"), (["--bogus"], "--bogus")]
    # size
    size = ["size", "--layers", "4", "--kv-heads", "2", "--head-dim", "64"]
    t += [([*size, "--context", c], "--context") for c in COUNTS]
    t += [([*size, "--context", "8k", "--batch", c], "--batch") for c in COUNTS]
    t += [([*size, "--context", "8k", "--shared-prefix", c], "--shared-prefix") for c in COUNTS[:4]]
    t += [(["size", "--layers", v, "--kv-heads", "2", "--head-dim", "64", "--context", "1k"], "--layers") for v in INTS]
    t += [(["size", "--layers", "2", "--kv-heads", "0", "--head-dim", "64", "--context", "1k"], "--kv-heads")]
    t += [([*size, "--context", "8k", "--format", f], "format") for f in FORMATS]
    t += [([*size, "--context", "8k", "--gpu-mem", g], "--gpu-mem") for g in ["abc", "0", "-80", "inf"]]
    t += [([*size, "--context", "8k", "--weights-gib", "x"], "--weights-gib"), (size, "--context")]
    t += [
        (["size", "--model", m, "--context", "8k"], k)
        for m, k in [(bad_cfg, "num_hidden_layers"), (kv0, "num_key_value_heads"), ("no-such-model", "model")]
    ]
    # generate (every case is refused before the model loads)
    gen = ["generate", "--prompt", "hi"]
    t += [([*gen, "--max-new-tokens", v], "--max-new-tokens") for v in [*INTS, "0", "100000000"]]
    t += [([*gen, "--temperature", v], "--temperature") for v in [*REALS, "-1", "1e9"]]
    t += [([*gen, "--top-p", v], "--top-p") for v in [*REALS, "-1", "0", "5"]]
    t += [([*gen, "--format", f], "--format") for f in FORMATS]
    t += [([*gen, "--backend", "gpu"], "--backend"), ([*gen, "--seed", "x"], "--seed")]
    t += [
        (["generate", "--prompt", "", "--raw"], "--prompt"),
        (["generate", "--prompt", "  "], "--prompt"),
        (["generate"], "--prompt"),
    ]
    t += [
        ([*gen, "--model", m], k)
        for m, k in [
            (paths["dir_bad"], "num_hidden_layers"),
            (paths["dir_kv0"], "num_key_value_heads"),
            ("/nonexistent", "--model"),
            (afile, "--model"),
        ]
    ]
    # calibrate
    cal = ["calibrate", "--out", paths["out"]]
    t += [(["calibrate", "--out", o], "--out") for o in [afile, f"{afile}/sub", proc, "", " "]]
    t += [([*cal, "--samples", v], "--samples") for v in [*INTS, "0"]]
    t += [([*cal, "--seq-len", v], "--seq-len") for v in [*INTS, "0", "1"]]
    t += [([*cal, "--batch-size", v], "--batch-size") for v in ["0", "abc"]]
    t += [([*cal, "--percentile", v], "--percentile") for v in [*REALS, "0", "100", "101"]]
    t += [([*cal, "--format", f], "--format") for f in FORMATS]
    t += [([*cal, "--range", r], "range") for r in ["bogus", "p", "pabc"]]
    t += [([*cal, "--model", paths["dir_bad"]], "num_hidden_layers"), (["calibrate"], "--out")]
    # export
    t += [
        (["export", "vllm", "--artifact", paths["artifact"], "--out", o], "--out")
        for o in [afile, f"{afile}/x", proc, ""]
    ]
    t += [
        (["export", "vllm", "--artifact", a, "--out", paths["out"]], "artifact")
        for a in ["/nonexistent", afile, paths["tampered"]]
    ]
    t += [(["export", "sglang", "--artifact", paths["artifact"], "--out", paths["out"]], "engine")]
    t += [(["export", "vllm", "--artifact", paths["artifact"], "--out", paths["out"], "--range", "bogus"], "range")]
    t += [(["export", "vllm", "--out", paths["out"]], "--artifact")]
    # eval
    t += [(["eval", "--lengths", c], "--lengths") for c in COUNTS]
    t += [(["eval", "--lengths", "1k,", "--lengths", "32"], "lengths")]
    t += [(["eval", "--depths", v], "--depths") for v in [*REALS[:4], "2", "-0.1"]]
    t += [(["eval", "--formats", f], "--formats") for f in FORMATS[:4]]
    t += [(["eval", "--kinds", "bogus"], "kinds"), (["eval", "--threads", "0"], "--threads")]
    t += [(["eval", "--fidelity-tokens", v], "fidelity") for v in ["-1", "abc", "1"]]
    t += [(["eval", "--speculative-tokens", "-1"], "--speculative-tokens"), (["eval", "--engine", "x"], "--engine")]
    t += [(["eval", "--out", o], "--out") for o in [afile, proc, ""]]
    # bench
    dec = ["bench", "decode"]
    t += [([*dec, "--contexts", c], "--contexts") for c in COUNTS]
    t += [
        ([*dec, f"--{o}", v], f"--{o}")
        for o in ["batch", "q-heads", "kv-heads", "head-dim", "block-size", "repeats", "threads", "membw-mb"]
        for v in ["0", "abc"]
    ]
    t += [([*dec, "--formats", f], "--formats") for f in FORMATS[:4]]
    t += [([*dec, "--dequant-formats", "int3"], "--dequant-formats"), ([*dec, "--kv-heads", "3"], "kv_heads")]
    t += [([*dec, "--json", j], "--json") for j in [paths["out_parent"], f"{afile}/x.json", f"{proc}/x.json", ""]]
    t += [([*dec, "--block-order", "random"], "--block-order")]
    t += [(["bench", "generate", o, "x"], o) for o in ["--context", "--new-tokens", "--threads"]]
    t += [(["bench", "generate", "--bogus"], "--bogus")]
    if importlib.util.find_spec("vllm") is not None:  # the providers are checked once vLLM is known to be there
        t += [(["bench", "vllm", "--formats", f], "--formats") for f in [*FORMATS[:4], "int4/int8[x]", "int4/int3[0]"]]
        t += [(["bench", "vllm", "--model", m], "--model") for m in [paths["out_parent"], "no-such-model", ""]]
        t += [(["bench", "vllm", "--quick", "--long-output"], "--long-output")]
    return t


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "head_dim": 16, "vocab_size": 50, "max_position_embeddings": 128}  # fmt: skip
    out = {}
    for name, over in (("bad", {"num_hidden_layers": "abc"}), ("kv0", {"num_key_value_heads": 0})):
        d = root / f"model-{name}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, **over}))
        out[f"dir_{name}"] = str(d)
    out["bad_cfg"], out["kv0"] = out["dir_bad"] + "/config.json", out["dir_kv0"] + "/config.json"
    (root / "afile").write_text("not a folder")
    out["file"], out["out"], out["out_parent"] = str(root / "afile"), str(root / "out"), str(root)
    import torch

    from kvpack.calibration import Artifact, KVObserver, fingerprint_from_config

    obs = KVObserver((99.9,))
    for layer in range(2):
        obs.observe(layer, torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    art = Artifact.build(*obs.stats(), "k=int8:channel:static,v=int8:token", fingerprint_from_config(cfg), {})
    out["artifact"] = str(art.save(root / "artifact"))
    tampered = art.save(root / "tampered")
    m = json.loads((tampered / "kvpack_calibration.json").read_text())
    m["tensors"]["file"] = "/etc/passwd"
    (tampered / "kvpack_calibration.json").write_text(json.dumps(m))
    out["tampered"] = str(tampered)
    return out


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def test_bad_arguments_give_one_line_naming_them_and_no_traceback(paths, capsys, monkeypatch):
    monkeypatch.delenv("KVPACK_DEBUG", raising=False)
    import kvpack.bench.decode
    import kvpack.evaluation.suite
    import kvpack.models.embedded

    def heavy(*a, **k):  # every case must be refused before this point
        raise AssertionError("a bad argument reached a model load or a benchmark")

    monkeypatch.setattr(kvpack.models.embedded, "ensure_converted", heavy)
    monkeypatch.setattr(kvpack.bench.decode, "run_sweep", heavy)
    monkeypatch.setattr(kvpack.evaluation.suite, "run_eval", heavy)
    table = _table(paths)
    assert len(table) >= 100
    failures = []
    for argv, name in table:
        rc, err = _run(argv, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        ok = rc == 2 and len(lines) == 1 and "Traceback" not in err and name in lines[0]
        if not ok:
            failures.append(f"{argv}: rc={rc}, stderr={err!r} (should name {name!r})")
    assert not failures, f"{len(failures)} of {len(table)} cases:\n" + "\n".join(failures)
    assert not Path(paths["out"]).exists(), "a refused command wrote its output"


def test_an_unexpected_exception_is_one_line_that_says_it_is_a_bug(capsys, monkeypatch):
    import kvpack.cli.size_cmd as size_cmd

    def boom(args):
        raise RuntimeError("something broke")

    monkeypatch.setattr(size_cmd, "run", boom)
    monkeypatch.delenv("KVPACK_DEBUG", raising=False)
    rc, err = _run(["size", "--list-models"], capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "bug in kvpack" in err and "KVPACK_DEBUG" in err
    monkeypatch.setenv("KVPACK_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something broke"):
        main(["size", "--list-models"])


def test_exact_counts_are_printed_as_given(capsys):
    rc, _ = _run(["size", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "1099511627776"], capsys)
    assert rc == 0


def test_a_reader_that_leaves_the_pipe_stops_the_command_quietly():
    """``kvpack size ... | head`` where head has already exited: no "internal error", no traceback, status 141."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "kvpack.cli.main", "size", "--layers", "4", "--kv-heads", "2", "--head-dim", "64",
            "--context", "1k", "--format", "all"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before anything is written (the interpreter takes ~1 s to start)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""
