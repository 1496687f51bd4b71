"""``kvpack eval``: options, outputs and errors (on the tiny model, patched in for the embedded one)."""

import json

import pytest
import torch

from kvpack.cli.main import main
from kvpack.evaluation import runner
from kvpack.evaluation.tiny import tiny_model


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    model, tok = tiny_model(seed=1)
    loaded = runner.wrap(model, tok, "tiny-llama")
    asked = []

    def fake_load(path=None):
        asked.append(path)
        return loaded

    monkeypatch.setattr(runner, "load", fake_load)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield asked
    torch.set_num_threads(n)


SMALL = ["--lengths", "256", "--depths", "0.5", "--kinds", "number", "--fidelity-tokens", "256", "--no-progress"]


def test_json_output_and_report(tmp_path, capsys, tiny):
    out = tmp_path / "rep"
    rc = main(["eval", "--quick", "--formats", "int8", "--out", str(out), "--json", "--seed", "3", *SMALL])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert list(res["formats"]) == ["fp16", "int8"]  # the baseline is added when missing
    assert res["config"]["seed"] == 3 and res["config"]["lengths"] == [256]
    assert res["config"]["attribution"] == ["int8"]
    assert (out / "index.html").is_file() and (out / "results.json").is_file()
    assert tiny == [None]  # no --model: the embedded model


def test_table_output(tmp_path, capsys):
    rc = main(["eval", "--formats", "fp16,kivi2", "--out", str(tmp_path), "--speculative-tokens", "0", *SMALL])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bits/elem" in text and "kivi2:" in text and "report:" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--depths", "1.5"], "[0, 1]"),
        (["--formats", "int9"], "unknown format preset"),
        (["--formats", "fp16,int4/int8[0-2"], "each part after a '/' is FORMAT[LAYERS]"),
        (["--formats", "fp16,int4/int9[3]"], "unknown format preset 'int9'"),
        (["--plan", "0.01", "--plan-formats", "int4,int4/int8[0]"], "'int4/int8[0]' is a plan (give it to --formats"),
        (["--lengths", "100k"], "do not fit the model's context"),
        (["--plan", "0.01", "--plan-windows", "0"], "--plan-windows"),
        (["--plan-windows", "4"], "is for the plan search: give a KL budget too (--plan)"),
    ],
)
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, argv, message):
    rc = main(["eval", "--out", str(tmp_path), "--no-progress", *argv])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "results.json").exists()


def _text_file(tmp_path, sentences=300):
    path = tmp_path / "notes.txt"
    path.write_text(" ".join(f"Line {i} of my own notes says something." for i in range(sentences)), encoding="utf-8")
    return path


def test_own_text(tmp_path, capsys):
    notes = _text_file(tmp_path)
    rep = tmp_path / "rep"
    rc = main(
        ["eval", "--text", str(notes), "--formats", "int4", "--out", str(rep), "--speculative-tokens", "0", *SMALL]
    )
    assert rc == 0
    out, err = capsys.readouterr()
    n = notes.stat().st_size  # the tiny model's tokens are bytes
    assert f"text: {notes} ({n:,} tokens)" in out
    res = json.loads((rep / "results.json").read_text())
    assert res["text"]["files"][0]["tokens"] == n and res["environment"]["haystack_corpus"] == str(notes)
    assert str(notes) in (rep / "index.html").read_text()
    assert "kvpack eval: about " in err and "tok/s prefill" in err


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.txt", "no such file"),
        (b'{"prompt": "hi"}\n', "chat.jsonl", 'line 1 has no "text" field'),
        (b"\xff\xfe not utf-8", "bad.txt", "not UTF-8 text"),
        (b"Far too short a text.", "short.txt", "--text has 21 tokens of text"),
    ],
)
def test_bad_text_exits_2_with_one_line(tmp_path, capsys, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    rc = main(["eval", "--text", str(path), "--out", str(tmp_path / "rep"), *SMALL])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("kvpack eval: error: ")
    assert not (tmp_path / "rep" / "results.json").exists()


def test_lengths_max(tmp_path, capsys, monkeypatch):
    model, tok = tiny_model(seed=1, max_positions=384)
    monkeypatch.setattr(runner, "load", lambda path=None: runner.wrap(model, tok, "tiny-384"))
    small = ["--depths", "0.5", "--kinds", "number", "--fidelity-tokens", "0", "--speculative-tokens", "0"]
    rc = main(["eval", "--formats", "int8", "--lengths", "128,max", "--json", "--out", str(tmp_path), *small])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["lengths"] == [128, 320] and res["config"]["lengths_requested"] == [128, "max"]
    rc = main(["eval", "--lengths", "1k,bogus", "--out", str(tmp_path)])
    assert rc == 2 and "or max" in capsys.readouterr().err


def test_first_run_says_it_compiles_then_estimates(tmp_path, capsys, monkeypatch):
    from kvpack.kernels import warmup

    monkeypatch.setattr(warmup, "cold_entries", lambda: ["cpu_decode_numba.launch_one", "cpu_chunk_numba.chunk"])
    monkeypatch.setattr(warmup, "warm_up", lambda: 78.2)
    rc = main(["eval", "--formats", "int8", "--out", str(tmp_path), "--speculative-tokens", "0", *SMALL])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    assert "compiling the CPU attention kernels" in err[0]
    assert err[1] == "kvpack: CPU kernels compiled in 78 s" and err[2].startswith("kvpack eval: about ")
    # the simulate engine runs no kvpack kernel: nothing to compile
    rc = main(["eval", "--engine", "simulate", "--formats", "int8", "--out", str(tmp_path), *SMALL])
    assert rc == 0 and "compiling" not in capsys.readouterr().err
