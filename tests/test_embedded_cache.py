"""The converted embedded-model folder: verified against the sizes and checksums recorded at conversion,
converted again when a file is truncated or rewritten, and temporary folders of dead conversions removed.

The conversion itself (transformers' GGUF loader) is replaced by a stand-in writing small files: what is
tested is the bookkeeping around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpack.models import embedded


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPACK_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / embedded.GGUF_FILE
    gguf.write_bytes(b"gguf")
    monkeypatch.setattr(embedded, "find_gguf", lambda: gguf)
    calls = []

    def convert(src, out):
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
        (out / "model.safetensors").write_bytes(os.urandom(4096))
        (out / "tokenizer.json").write_text("{}")
        embedded._write_marker(out, {"conversion_version": embedded._CONVERSION_VERSION})

    monkeypatch.setattr(embedded, "_convert", convert)
    return calls


def test_marker_records_every_file_with_size_and_checksum(fake):
    folder = embedded.ensure_converted()
    files = json.loads((folder / embedded._MARKER).read_text())["files"]
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert files["model.safetensors"]["bytes"] == 4096 and len(files["model.safetensors"]["sha256"]) == 64
    assert embedded.ensure_converted() == folder and len(fake) == 1  # complete: not converted again


def test_a_truncated_weights_file_is_converted_again(fake):
    folder = embedded.ensure_converted()
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    embedded.ensure_converted()
    assert len(fake) == 2 and path.stat().st_size == 4096


def test_a_rewritten_file_of_the_same_size_is_caught_by_its_checksum(fake):
    folder = embedded.ensure_converted()
    path = folder / "model.safetensors"
    path.write_bytes(bytes(4096))  # same size, other bytes, new mtime
    embedded.ensure_converted()
    assert len(fake) == 2 and path.read_bytes() != bytes(4096)


def test_a_touched_but_intact_file_is_kept_and_its_new_time_recorded(fake):
    folder = embedded.ensure_converted()
    path = folder / "model.safetensors"
    os.utime(path, ns=(1, 1))
    embedded.ensure_converted()
    assert len(fake) == 1
    assert json.loads((folder / embedded._MARKER).read_text())["files"]["model.safetensors"]["mtime_ns"] == 1


def test_an_old_marker_without_checksums_is_converted_again(fake):
    folder = embedded.ensure_converted()
    (folder / embedded._MARKER).write_text(json.dumps({"conversion_version": embedded._CONVERSION_VERSION}))
    embedded.ensure_converted()
    assert len(fake) == 2


def test_temporary_folders_of_dead_conversions_are_removed(fake):
    final = embedded.converted_dir()
    final.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_dir = final.parent / f".{final.name}.{int(dead.stdout)}.abcd"
    live_dir = final.parent / f".{final.name}.{os.getppid()}.efgh"  # a live process (the parent of pytest)
    for d in (dead_dir, live_dir):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    embedded.ensure_converted()
    assert not dead_dir.exists() and live_dir.exists()
    assert not [p for p in final.parent.iterdir() if p.name.startswith(".") and p != live_dir]


def test_a_failed_conversion_leaves_nothing_behind(fake, monkeypatch):
    def broken(src, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        embedded.ensure_converted()
    assert [p.name for p in embedded.converted_dir().parent.iterdir()] == []
