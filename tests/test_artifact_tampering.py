"""A tampered calibration artifact is refused, re-signed or not, by load_artifact and by kvpack export vllm.

The manifest's checksum has no key: each tamper below re-signs the artifact (both checksums recomputed) unless
the case is about the checksum itself, so what is tested is the validation, not the signature.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from kvpack.calibration import Artifact, KVObserver, fingerprint_from_config, load_artifact
from kvpack.calibration.artifact import MANIFEST_NAME, TENSORS_NAME, _manifest_digest
from kvpack.errors import CalibrationError, ConfigError
from kvpack.integrations.export import SCALES_FILE, export_vllm

LAYERS, H, D = 2, 2, 16
FMT = "k=int4:channel:asym:static,v=fp8:tensor:static:fp32"  # key scales, key zero-points, value scales
CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": H,
    "hidden_size": 4 * D,
    "head_dim": D,
    "vocab_size": 50,
    "rope_theta": 10000.0,
}


def _good(d: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    obs = KVObserver((50.0, 99.9))
    for layer in range(LAYERS):
        obs.observe(layer, torch.randn(2, H, 32, D, generator=g) * 3, torch.randn(2, H, 32, D, generator=g))
    keys, values = obs.stats()
    art = Artifact.build(keys, values, FMT, fingerprint_from_config(CONFIG), {"name": "t"}, "p99.9")
    return art.save(d)


def _read(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((d / MANIFEST_NAME).read_text()), load((d / TENSORS_NAME).read_bytes())


def _write(d: Path, manifest: dict, tensors: dict[str, torch.Tensor] | None = None, resign: bool = True) -> None:
    if tensors is not None:
        blob = save(tensors)
        (d / TENSORS_NAME).write_bytes(blob)
        if resign and isinstance(manifest.get("tensors"), dict):
            manifest["tensors"]["sha256"] = hashlib.sha256(blob).hexdigest()
    if resign:
        manifest["manifest_sha256"] = _manifest_digest(manifest)
    (d / MANIFEST_NAME).write_text(json.dumps(manifest))


def _load(d: Path, tmp: Path) -> None:
    load_artifact(d)


def _export(d: Path, tmp: Path) -> None:
    out = tmp / "exported"
    try:
        export_vllm(d, out)
    finally:
        assert not out.exists(), "a refused artifact must not leave an export folder behind"


READERS = pytest.mark.parametrize("reader", [_load, _export], ids=["load_artifact", "export_vllm"])


def _refused(reader, d: Path, tmp: Path, match: str) -> None:
    with pytest.raises(CalibrationError, match=match):
        reader(d, tmp)


# -- containment ----------------------------------------------------------------------------------------


@READERS
@pytest.mark.parametrize("name", ["/etc/passwd", "../../etc/passwd", "../outside.safetensors", "sub/x", 42, None])
def test_tensor_file_outside_the_artifact_is_refused_without_reading_it(tmp_path, reader, name):
    d = _good(tmp_path / "art")
    m, _ = _read(d)
    m["tensors"]["file"] = name
    _write(d, m)
    _refused(reader, d, tmp_path, "tensors.file")


@READERS
def test_tensor_file_symlinked_out_of_the_artifact_is_refused(tmp_path, reader):
    d = _good(tmp_path / "art")
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(d / TENSORS_NAME, outside)  # same bytes: the checksum in the manifest still matches
    (d / TENSORS_NAME).symlink_to(outside)
    _refused(reader, d, tmp_path, "symlink")


# -- schema ---------------------------------------------------------------------------------------------

SCHEMA_CASES = {
    "tensors missing": (lambda m: m.pop("tensors"), "'tensors'"),
    "tensors a string": (lambda m: m.update(tensors="x"), "'tensors'"),
    "sha256 not hex": (lambda m: m["tensors"].update(sha256="zz"), "tensors.sha256"),
    "percentiles reordered": (lambda m: m.update(percentiles=m["percentiles"][::-1]), "percentiles"),
    "percentiles not numbers": (lambda m: m.update(percentiles=["a"]), "percentiles"),
    "percentile of 100": (lambda m: m.update(percentiles=[50.0, 100.0]), "percentiles"),
    "source bogus": (lambda m: m.update(source="bogus"), "source"),
    "source not recorded": (lambda m: m.update(source="p75"), "source"),
    "source a number": (lambda m: m.update(source=7), "source"),
    "format unknown": (lambda m: m.update(format="int3"), "'format'"),
    "format missing": (lambda m: m.pop("format"), "'format'"),
    "num_layers a string": (lambda m: m["fingerprint"].update(num_layers="abc"), "fingerprint.num_layers"),
    "kv_heads zero": (lambda m: m["fingerprint"].update(kv_heads=0), "fingerprint.kv_heads"),
    "head_dim a bool": (lambda m: m["fingerprint"].update(head_dim=True), "fingerprint.head_dim"),
    "fingerprint a list": (lambda m: m.update(fingerprint=[1]), "'fingerprint'"),
    "data missing": (lambda m: m.pop("data"), "'data'"),
    "scales say none": (lambda m: m["scales"].update(keys=None), "scales.keys"),
    "version a number": (lambda m: m.update(kvpack_version=1), "kvpack_version"),
}


@READERS
@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_manifest_off_its_schema_is_refused_naming_the_field(tmp_path, reader, case):
    d = _good(tmp_path / "art")
    m, _ = _read(d)
    edit, field = SCHEMA_CASES[case]
    edit(m)
    _write(d, m)
    _refused(reader, d, tmp_path, field)


@READERS
def test_unknown_schema_is_refused(tmp_path, reader):
    d = _good(tmp_path / "art")
    m, _ = _read(d)
    m["schema"] = 2
    _write(d, m)
    _refused(reader, d, tmp_path, "schema 2")


# -- tensors --------------------------------------------------------------------------------------------


def _names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        return sorted(_read(_good(Path(t) / "a"))[1])


@READERS
@pytest.mark.parametrize("name", _names())
def test_every_tensor_is_checked_for_non_finite_values(tmp_path, reader, name):
    d = _good(tmp_path / "art")
    m, t = _read(d)
    x = t[name].clone()
    if x.is_floating_point():
        x.view(-1)[x.numel() // 2] = float("nan")
    else:  # token counts: a negative count
        x.view(-1)[0] = -1
    t[name] = x
    _write(d, m, t)
    _refused(reader, d, tmp_path, f"tensor {name} holds non-finite")


@READERS
def test_infinite_range_is_refused(tmp_path, reader):
    d = _good(tmp_path / "art")
    m, t = _read(d)
    t["keys.absmax"][0, 0, 0] = float("inf")
    _write(d, m, t)
    _refused(reader, d, tmp_path, "keys.absmax holds non-finite")


@READERS
def test_percentile_slices_swapped_are_refused(tmp_path, reader):
    d = _good(tmp_path / "art")
    m, t = _read(d)
    t["keys.percentile"] = t["keys.percentile"].flip(1).contiguous()
    _write(d, m, t)
    _refused(reader, d, tmp_path, "percentile")


@READERS
@pytest.mark.parametrize("edit", ["drop keys.scale", "drop keys.zero", "extra", "wrong shape", "wrong dtype"])
def test_tensors_that_contradict_the_manifest_are_refused(tmp_path, reader, edit):
    d = _good(tmp_path / "art")
    m, t = _read(d)
    if edit.startswith("drop"):
        name = edit.split()[1]
        t.pop(name)
        match = f"tensor {name} is missing"
    elif edit == "extra":
        t["keys.secret"] = torch.zeros(1)
        match = "unexpected tensors"
    elif edit == "wrong shape":
        t["values.rms"] = t["values.rms"][:1].contiguous()
        match = "values.rms is"
    else:
        t["keys.tokens"] = t["keys.tokens"].int()
        match = "keys.tokens is torch.int32"
    _write(d, m, t)
    _refused(reader, d, tmp_path, match)


# -- checksums ------------------------------------------------------------------------------------------


@READERS
def test_unsigned_edits_are_caught_by_the_checksums(tmp_path, reader):
    d = _good(tmp_path / "art")
    m, t = _read(d)
    t["keys.absmax"] = t["keys.absmax"] * 2
    _write(d, m, t, resign=False)
    _refused(reader, d, tmp_path, "does not match the checksum")
    d = _good(tmp_path / "art2")
    m, _ = _read(d)
    m["source"] = "absmax"
    _write(d, m, resign=False)
    _refused(reader, d, tmp_path, "manifest checksum")


def test_the_untampered_artifact_loads_and_exports(tmp_path):
    d = _good(tmp_path / "art")
    art = load_artifact(d, model=CONFIG, format=FMT)
    assert art.source == "p99.9" and art.key_scales.zero is not None
    summary = export_vllm(d, tmp_path / "out")
    assert len(summary["k_scale"]) == LAYERS and (tmp_path / "out" / SCALES_FILE).is_file()


def test_missing_key_scales_are_named_not_called_another_format(tmp_path):
    d = _good(tmp_path / "art")
    art = load_artifact(d)
    art.key_scales = None
    with pytest.raises(CalibrationError, match="holds no key scales") as e:
        art.check_format(FMT)
    assert "artifact has scales for" not in str(e.value)


# -- writing --------------------------------------------------------------------------------------------


def test_a_crash_while_recalibrating_keeps_the_previous_artifact(tmp_path, monkeypatch):
    d = _good(tmp_path / "art")
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    art = load_artifact(d)
    real = Path.write_text

    def killed(self, *a, **k):  # the tensors are written, the process dies before the manifest
        if self.name == MANIFEST_NAME:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        art.rescaled(FMT, source="p50").save(d)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert load_artifact(d).source == "p99.9"
    assert [p.name for p in tmp_path.iterdir()] == ["art"], "no temporary folder is left behind"
    art.rescaled(FMT, source="p50").save(d)  # and a completed save replaces it
    assert load_artifact(d).source == "p50"


def test_saving_never_overwrites_a_folder_that_is_not_an_artifact(tmp_path):
    art = load_artifact(_good(tmp_path / "art"))
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="non-empty folder"):
        art.save(other)
    assert (other / "notes.txt").read_text() == "keep"
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad in (afile, afile / "sub"):
        with pytest.raises(ConfigError, match="file"):
            art.save(bad)
    assert afile.read_text() == "x"


def test_export_leaves_other_files_and_no_temporaries(tmp_path):
    d = _good(tmp_path / "art")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    export_vllm(d, out)
    export_vllm(d, out)  # again, over its own files
    names = sorted(p.name for p in out.iterdir())
    assert "keep.txt" in names and not [n for n in names if n.startswith(".")]
    with pytest.raises(ConfigError, match="--out"):
        export_vllm(d, out / "keep.txt")
