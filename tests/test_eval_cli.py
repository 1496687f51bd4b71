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
        (["--lengths", "100k"], "do not fit the model's context"),
    ],
)
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, argv, message):
    rc = main(["eval", "--out", str(tmp_path), "--no-progress", *argv])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "results.json").exists()
