"""Validation of a calibration artifact read from disk: every field and every tensor is untrusted input.

The manifest's checksum has no key, so whoever can edit an artifact can also re-sign it; the checksums only
catch accidents (truncation, a flipped bit, a hand edit that forgot to re-sign). What keeps a hostile
artifact harmless is this module: the manifest is checked against its schema (types, ranges, the percentile
order, the range source), the tensor file must be the one plain file inside the artifact folder (no absolute
path, no ``..``, no symlink leading out), and the tensors must have exactly the names, shapes and dtypes the
manifest implies, with finite values in the ranges statistics and scales can take. Each refusal is a
:class:`~kvpack.errors.CalibrationError` naming the field or tensor.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any

import torch

from kvpack.errors import CalibrationError, FormatError
from kvpack.formats import KVFormat, QuantSpec, parse_format

__all__ = ["check_manifest", "check_tensors", "tensor_file"]

_HEX64 = re.compile(r"[0-9a-f]{64}")
_SHAPE_FIELDS = ("num_layers", "kv_heads", "attention_heads", "head_dim", "hidden_size")
_REQUIRED = ("num_layers", "kv_heads", "head_dim")
STATS = ("absmax", "min", "max", "rms", "pair_absmax")


def _bad(d: Path, field: str, why: str) -> CalibrationError:
    return CalibrationError(
        f"calibration artifact {d} is invalid: manifest field {field!r} {why}; recreate it with `kvpack calibrate`"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _check_fingerprint(d: Path, fp: Any) -> None:
    """The shape fields are required; the others (a full fingerprint has them all) are type-checked."""
    if not isinstance(fp, dict):
        raise _bad(d, "fingerprint", f"must be an object, got {type(fp).__name__}")
    for name in _SHAPE_FIELDS:
        if (name in _REQUIRED or name in fp) and (not _is_int(fp.get(name)) or fp[name] <= 0):
            raise _bad(d, f"fingerprint.{name}", f"must be a positive integer, got {fp.get(name)!r}")
    if "vocab_size" in fp and (not _is_int(fp["vocab_size"]) or fp["vocab_size"] < 0):
        raise _bad(d, "fingerprint.vocab_size", f"must be a non-negative integer, got {fp['vocab_size']!r}")
    for name, kind in (("architecture", str), ("rope", dict)):
        if name in fp and not isinstance(fp[name], kind):
            raise _bad(d, f"fingerprint.{name}", f"must be a {kind.__name__}, got {fp[name]!r}")


def _check_percentiles(d: Path, pct: Any) -> list[float]:
    if not isinstance(pct, list) or not all(_is_num(p) for p in pct):
        raise _bad(d, "percentiles", f"must be a list of numbers, got {pct!r}")
    if any(not 0 < p < 100 for p in pct):
        raise _bad(d, "percentiles", f"must lie strictly between 0 and 100, got {pct!r}")
    if any(a >= b for a, b in itertools.pairwise(pct)):
        raise _bad(d, "percentiles", f"must be strictly ascending (the order of the stacked tensor), got {pct!r}")
    return [float(p) for p in pct]


def _check_source(d: Path, source: Any, percentiles: list[float]) -> None:
    if source in ("absmax", "rope"):
        return
    m = re.fullmatch(r"p(\d+(?:\.\d+)?)", source) if isinstance(source, str) else None
    if m is None:
        raise _bad(d, "source", f"must be 'absmax', 'rope' or 'p<percentile>', got {source!r}")
    if float(m.group(1)) not in percentiles:
        raise _bad(d, "source", f"is {source!r} but the artifact records only the percentiles {percentiles}")


def check_manifest(d: Path, m: dict[str, Any], tensors_name: str) -> tuple[KVFormat, list[float]]:
    """Check every field the loader reads (``kind`` and ``schema`` are checked before); returns the parsed
    format and the percentiles."""
    for name in ("kvpack_version", "format", "format_name", "manifest_sha256"):
        if not isinstance(m.get(name), str):
            raise _bad(d, name, f"must be a string, got {m.get(name)!r}")
    try:
        fmt = parse_format(m["format"])
    except FormatError as e:
        raise _bad(d, "format", f"is not a kvpack format ({e})") from None
    percentiles = _check_percentiles(d, m.get("percentiles"))
    _check_source(d, m.get("source"), percentiles)
    _check_fingerprint(d, m.get("fingerprint"))
    fmt.check(m["fingerprint"]["head_dim"])
    for name, value in (("data", m.get("data")), ("model", m.get("model", {}))):
        if not isinstance(value, dict):
            raise _bad(d, name, f"must be an object, got {type(value).__name__}")
    scales = m.get("scales")
    if not isinstance(scales, dict):
        raise _bad(d, "scales", f"must be an object, got {scales!r}")
    from kvpack.calibration.static import spec_takes_static

    for role, spec in (("keys", fmt.key), ("values", fmt.value)):
        want = str(spec) if spec_takes_static(spec) else None
        if scales.get(role) != want:
            raise _bad(d, f"scales.{role}", f"is {scales.get(role)!r}; the format {m['format']!r} implies {want!r}")
    t = m.get("tensors")
    if not isinstance(t, dict):
        raise _bad(d, "tensors", f"must be an object with 'file' and 'sha256', got {t!r}")
    if not isinstance(t.get("sha256"), str) or not _HEX64.fullmatch(t["sha256"]):
        raise _bad(d, "tensors.sha256", f"must be 64 lowercase hex digits, got {t.get('sha256')!r}")
    if t.get("file") != tensors_name:
        raise _bad(d, "tensors.file", f"must be {tensors_name!r} (a file inside the artifact), got {t.get('file')!r}")
    return fmt, percentiles


def tensor_file(d: Path, name: str) -> Path:
    """``d / name``, refused unless it is a regular file that resolves inside ``d`` (no symlink out)."""
    path = d / name
    if path.is_symlink() or (path.exists() and path.resolve().parent != d.resolve()):
        raise CalibrationError(
            f"calibration artifact {d} is invalid: {name} is a symlink or leads outside the artifact folder; "
            "an artifact's files must be plain files inside it: recreate it with `kvpack calibrate`"
        )
    return path


def _tensor(d: Path, t: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype):
    x = t.get(name)
    if x is None:
        raise CalibrationError(f"calibration artifact {d} is invalid: tensor {name} is missing; recalibrate")
    if tuple(x.shape) != shape or x.dtype != dtype:
        raise CalibrationError(
            f"calibration artifact {d} is invalid: tensor {name} is {x.dtype} {tuple(x.shape)}, the manifest "
            f"implies {dtype} {shape}; recalibrate"
        )
    return x


def _finite(d: Path, name: str, x: torch.Tensor, lo: float | None = None) -> None:
    xf = x.float()
    bad = ~torch.isfinite(xf) if lo is None else ~(torch.isfinite(xf) & (xf >= lo))
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        what = "non-finite" if lo is None else f"non-finite or below {lo:g}"
        raise CalibrationError(
            f"calibration artifact {d} is invalid: tensor {name} holds {what} values ({int(bad.sum())}, the first "
            f"at index {at}: {xf[tuple(at)].item()}); recalibrate"
        )


def _check_scales(d: Path, t: dict[str, torch.Tensor], role: str, spec: QuantSpec, layers: int, h: int, hd: int):
    from kvpack.calibration.static import spec_takes_static
    from kvpack.quant import decode_scale, scale_torch_dtype

    names = {f"{role}.scale", f"{role}.zero"}
    if not spec_takes_static(spec):
        extra = sorted(names & set(t))
        if extra:
            raise CalibrationError(f"calibration artifact {d} is invalid: {extra} present but {spec} takes none")
        return
    shape = (layers, *spec.scale_shape(h, 1, hd))
    s = _tensor(d, t, f"{role}.scale", shape, scale_torch_dtype(spec.scale_dtype))
    _finite(d, f"{role}.scale", decode_scale(s, spec.scale_dtype), lo=torch.finfo(torch.float32).tiny)
    if spec.has_zero:
        z = _tensor(d, t, f"{role}.zero", shape, scale_torch_dtype(spec.zero_dtype))
        _finite(d, f"{role}.zero", decode_scale(z, spec.zero_dtype))
    elif f"{role}.zero" in t:
        raise CalibrationError(f"calibration artifact {d} is invalid: {role}.zero present but {spec} is symmetric")


def check_tensors(d: Path, t: dict[str, torch.Tensor], fmt: KVFormat, fp: dict[str, Any], pct: list[float]) -> None:
    """Every tensor the manifest implies is present with its shape and dtype, finite and in range; no others."""
    layers, h, hd = fp["num_layers"], fp["kv_heads"], fp["head_dim"]
    expected = set()
    for role in ("keys", "values"):
        x = {n: _tensor(d, t, f"{role}.{n}", (layers, h, hd), torch.float32) for n in STATS}
        for n in ("absmax", "rms", "pair_absmax"):
            _finite(d, f"{role}.{n}", x[n], lo=0.0)
        for n in ("min", "max"):
            _finite(d, f"{role}.{n}", x[n])
        if bool((x["min"] > x["max"]).any()):
            raise CalibrationError(f"calibration artifact {d} is invalid: {role}.min exceeds {role}.max; recalibrate")
        _finite(d, f"{role}.tokens", _tensor(d, t, f"{role}.tokens", (layers,), torch.int64), lo=0.0)
        expected |= {f"{role}.{n}" for n in (*STATS, "tokens")}
        if pct:
            p = _tensor(d, t, f"{role}.percentile", (layers, len(pct), h, hd), torch.float32)
            _finite(d, f"{role}.percentile", p, lo=0.0)
            # magnitudes grow with the percentile and are capped at the abs-max: a relabelled order shows here
            if bool((p.diff(dim=1) < 0).any()) or bool((p > x["absmax"].unsqueeze(1)).any()):
                raise CalibrationError(
                    f"calibration artifact {d} is invalid: {role}.percentile does not grow with the percentiles "
                    f"{pct} or exceeds the abs-max (labels out of order?); recalibrate"
                )
            expected.add(f"{role}.percentile")
        spec = fmt.key if role == "keys" else fmt.value
        _check_scales(d, t, role, spec, layers, h, hd)
        expected |= {f"{role}.scale", f"{role}.zero"} & set(t)
    if "queries.energy" in t:  # optional: present when the model's queries were observed
        _finite(d, "queries.energy", _tensor(d, t, "queries.energy", (layers, h, hd), torch.float32), lo=0.0)
        expected.add("queries.energy")
    extra = sorted(set(t) - expected)
    if extra:
        raise CalibrationError(f"calibration artifact {d} is invalid: unexpected tensors {extra}; recalibrate")
