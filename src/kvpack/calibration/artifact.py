"""Calibration artifact: statistics and static scales on disk, refused unless they fit.

An artifact is a directory with two files:

* ``kvpack_calibration.safetensors``: per-channel statistics of keys and values (``keys.absmax``,
  ``keys.min``, ``keys.max``, ``keys.rms`` ``[layers, kv_heads, head_dim]`` float32, ``keys.tokens``
  ``[layers]`` int64, ``keys.percentile`` ``[layers, P, kv_heads, head_dim]`` float32; the same under
  ``values.``) and the static scales for the artifact's format (``keys.scale`` / ``keys.zero``
  ``[layers, Hs, 1, Cs]`` in the stored scale dtype; ``values.*`` likewise where values can be static) and,
  when the model's queries were observed, ``queries.energy`` ``[layers, kv_heads, head_dim]`` float32 (their
  mean square per kv head and channel, the weight of query-ranked outlier channels ``o<k>q``);
* ``kvpack_calibration.json``: the manifest: format, range source, model fingerprint, the data used
  (name, samples, seq_len, seed, a hash of the token ids), kvpack version, the percentiles, the sha256 of
  the tensor file, and a sha256 of the manifest itself.

:func:`load_artifact` verifies both checksums and, when told the model and format, the fingerprint and
the format; any mismatch is a :class:`~kvpack.errors.CalibrationError` naming what differs. Nothing is
ever replaced by a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpack.calibration.fingerprint import diff_fingerprints, fingerprint_from_config
from kvpack.calibration.manifest import STATS, check_manifest, check_tensors, tensor_file
from kvpack.calibration.observer import RoleStats
from kvpack.calibration.static import StaticScales, same_quantization, spec_takes_static, static_scales
from kvpack.errors import CalibrationError, FormatError
from kvpack.formats import KVFormat, QuantSpec, parse_format

__all__ = ["MANIFEST_NAME", "SCHEMA", "TENSORS_NAME", "Artifact", "CalibratedScales", "load_artifact"]

MANIFEST_NAME = "kvpack_calibration.json"
TENSORS_NAME = "kvpack_calibration.safetensors"
SCHEMA = 1
_KIND = "kvpack-calibration"
_STATS = STATS


@dataclass(frozen=True)
class CalibratedScales:
    """The static scales a format needs: ``key`` / ``value`` are ``None`` for roles that are not static."""

    format: KVFormat
    key: StaticScales | None
    value: StaticScales | None


def value_source(source: str) -> str:
    """The range source used for values: values carry no RoPE, so ``"rope"`` means abs-max for them."""
    return "absmax" if source == "rope" else source


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return _sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _fingerprint_of(model: Any) -> dict[str, Any]:
    """A fingerprint from a fingerprint dict, a config dict / object, or a model (its ``.config``)."""
    if isinstance(model, dict) and "num_layers" in model and "kv_heads" in model:
        return model
    if hasattr(model, "config") and not isinstance(model, dict):
        model = model.config
    return fingerprint_from_config(model)


@dataclass
class Artifact:
    """Calibration statistics of one model plus the static scales for one format.

    Attributes:
        format: the format the scales are for (only its static-capable specs have scales).
        source: ``"absmax"`` or ``"p<P>"``, the statistic the scales come from.
        fingerprint: the model fingerprint (:func:`~kvpack.calibration.fingerprint.fingerprint_from_config`).
        data: what was run through the model (name, samples, seq_len, seed, tokens_sha256).
        keys, values: the statistics.
        key_scales, value_scales: static scales for the format's key / value spec, or ``None`` where that
            spec cannot be static (per-token, per-group, passthrough).
        kvpack_version: the version that made it.
        model: informational (for example ``name_or_path``); never compared.
        query_energy: ``[layers, kv_heads, head_dim]`` float32, the queries' mean square per channel (each kv
            head's query heads averaged), or ``None`` where queries were not observed.
    """

    format: KVFormat
    source: str
    fingerprint: dict[str, Any]
    data: dict[str, Any]
    keys: RoleStats
    values: RoleStats
    key_scales: StaticScales | None = None
    value_scales: StaticScales | None = None
    kvpack_version: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    query_energy: torch.Tensor | None = None

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        keys: RoleStats,
        values: RoleStats,
        format: str | KVFormat,
        fingerprint: dict[str, Any],
        data: dict[str, Any],
        source: str = "absmax",
        model: dict[str, Any] | None = None,
        query_energy: torch.Tensor | None = None,
    ) -> Artifact:
        """Compute the static scales for ``format`` from the statistics and assemble the artifact.

        Raises:
            CalibrationError: the statistics (or ``query_energy``) do not have the fingerprint's shape, or
                ``source`` is missing.
        """
        from kvpack import __version__

        fmt = parse_format(format)
        want = (fingerprint["num_layers"], fingerprint["kv_heads"], fingerprint["head_dim"])
        for role, st in (("keys", keys), ("values", values)):
            if tuple(st.absmax.shape) != want:
                raise CalibrationError(
                    f"{role} statistics have shape {tuple(st.absmax.shape)}, the model fingerprint says "
                    f"layers x kv_heads x head_dim = {want}; observe the same model the fingerprint describes"
                )
        if query_energy is not None:
            if tuple(query_energy.shape) != want:
                raise CalibrationError(
                    f"query statistics have shape {tuple(query_energy.shape)}, the model fingerprint says {want}"
                )
            query_energy = query_energy.detach().float().cpu().contiguous()
        fmt.check(fingerprint["head_dim"])
        ks = static_scales(keys, fmt.key, "key", source) if spec_takes_static(fmt.key) else None
        vsource = value_source(source)
        vs = static_scales(values, fmt.value, "value", vsource) if spec_takes_static(fmt.value) else None
        info = dict(model or {})
        return cls(fmt, source, dict(fingerprint), dict(data), keys, values, ks, vs, __version__, info, query_energy)

    def rescaled(self, format: str | KVFormat, source: str | None = None) -> Artifact:
        """The same statistics with scales recomputed for another format or range source (an explicit step:
        loading never converts an artifact silently)."""
        return Artifact.build(
            self.keys,
            self.values,
            format,
            self.fingerprint,
            self.data,
            source or self.source,
            self.model,
            query_energy=self.query_energy,
        )

    def select_layers(self, layers: Sequence[int]) -> Artifact:
        """The artifact of ``layers`` only, in that order: what the part of a per-layer plan's cache that holds
        those layers takes (its statistics, scales and query statistics are those layers' rows; the fingerprint
        counts them). Not meant to be saved: it no longer describes the whole model.

        Raises:
            CalibrationError: a layer the artifact does not have.
        """
        n = int(self.fingerprint["num_layers"])
        bad = [i for i in layers if not 0 <= i < n]
        if bad or not layers:
            raise CalibrationError(f"the calibration artifact has {n} layers; cannot select layers {list(layers)}")
        idx = torch.as_tensor(list(layers), dtype=torch.long)

        def cut(sc: StaticScales | None) -> StaticScales | None:
            if sc is None:
                return None
            return dataclasses.replace(sc, scale=sc.scale[idx], zero=None if sc.zero is None else sc.zero[idx])

        return dataclasses.replace(
            self,
            fingerprint={**self.fingerprint, "num_layers": len(idx)},
            keys=self.keys.select(layers),
            values=self.values.select(layers),
            key_scales=cut(self.key_scales),
            value_scales=cut(self.value_scales),
            query_energy=None if self.query_energy is None else self.query_energy[idx],
        )

    # -- checks ---------------------------------------------------------------------------------------
    def check_model(self, model: Any) -> None:
        """Refuse a model whose fingerprint differs (``model``: a model, its config, a config.json dict, or a
        fingerprint dict); the error names every differing field."""
        diffs = diff_fingerprints(self.fingerprint, _fingerprint_of(model))
        if diffs:
            raise CalibrationError(
                "the calibration artifact was made for another model (" + "; ".join(diffs) + "); "
                "run `kvpack calibrate --model PATH --out DIR` for this model"
            )

    def _roles(self, fmt: KVFormat) -> list[tuple[str, QuantSpec, QuantSpec, StaticScales | None]]:
        return [
            ("keys", fmt.key, self.format.key, self.key_scales),
            ("values", fmt.value, self.format.value, self.value_scales),
        ]

    def check_format(self, format: str | KVFormat) -> None:
        """Refuse a format whose static specs are not the ones this artifact's scales were made for."""
        fmt = parse_format(format)
        problems = []
        for role, want, have, scales in self._roles(fmt):
            if not want.static:
                continue
            if scales is None:
                problems.append(f"{role}: the artifact holds no {role[:-1]} scales, requested static {want}")
            elif not same_quantization(want, have):
                problems.append(f"{role}: artifact has scales for {have}, requested {want}")
        if problems:
            raise CalibrationError(
                "the calibration artifact was made for format "
                f"{self.format.name!r}, not {fmt.name!r} (" + "; ".join(problems) + "); run `kvpack calibrate "
                f"--format '{fmt.spec_string()}'` or recompute with Artifact.rescaled(format)"
            )

    def scales_for(self, format: str | KVFormat, model: Any = None) -> CalibratedScales:
        """The static scales ``format`` needs, after checking the format (and the model, when given).

        Raises:
            CalibrationError: the format takes no static scales, or differs from the artifact's, or the
                model's fingerprint differs.
        """
        fmt = parse_format(format)
        if not fmt.is_static:
            raise CalibrationError(
                f"format {fmt.name!r} takes no static scales (no spec is marked 'static'), so a calibration "
                "artifact would be ignored; drop the artifact or mark the key spec static, e.g. "
                "'k=int8:channel:static,v=int8:token'"
            )
        if model is not None:
            self.check_model(model)
        self.check_format(fmt)
        return CalibratedScales(
            fmt, self.key_scales if fmt.key.static else None, self.value_scales if fmt.value.static else None
        )

    # -- disk -----------------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for role, st in (("keys", self.keys), ("values", self.values)):
            for name in _STATS:
                out[f"{role}.{name}"] = getattr(st, name).float().contiguous()
            out[f"{role}.tokens"] = st.tokens.to(torch.int64).contiguous()
            if st.percentiles:
                out[f"{role}.percentile"] = torch.stack([st.percentiles[p] for p in self.percentiles], 1).contiguous()
        for role, sc in (("keys", self.key_scales), ("values", self.value_scales)):
            if sc is not None:
                out[f"{role}.scale"] = sc.scale.contiguous()
                if sc.zero is not None:
                    out[f"{role}.zero"] = sc.zero.contiguous()
        if self.query_energy is not None:
            out["queries.energy"] = self.query_energy.float().contiguous()
        return out

    @property
    def percentiles(self) -> list[float]:
        return sorted(self.keys.percentiles)

    def manifest(self, tensors_sha256: str) -> dict[str, Any]:
        m = {
            "kind": _KIND,
            "schema": SCHEMA,
            "kvpack_version": self.kvpack_version,
            "format": self.format.spec_string(),
            "format_name": self.format.name,
            "source": self.source,
            "percentiles": self.percentiles,
            "fingerprint": self.fingerprint,
            "data": self.data,
            "model": self.model,
            "scales": {
                "keys": None if self.key_scales is None else str(self.key_scales.spec),
                "values": None if self.value_scales is None else str(self.value_scales.spec),
            },
            "tensors": {"file": TENSORS_NAME, "sha256": tensors_sha256},
        }
        m["manifest_sha256"] = _manifest_digest(m)
        return m

    def save(self, directory: str | Path) -> Path:
        """Write the two files into ``directory`` and return it.

        The files are written into a temporary folder beside ``directory``, which then replaces it in one step
        (:func:`kvpack.fsutil.replace_dir`): a crash leaves the previous artifact, never a mix of old and new
        files. An existing ``directory`` must be empty or an artifact (it is replaced whole).

        Raises:
            ConfigError: ``directory`` is a file, lies under one, cannot be written, or is a non-empty folder
                that holds no artifact (it is never overwritten).
        """
        from safetensors.torch import save

        from kvpack.errors import ConfigError
        from kvpack.fsutil import check_output_dir, replace_dir

        d = check_output_dir(directory, "directory")
        if d.is_dir() and any(d.iterdir()) and not (d / MANIFEST_NAME).is_file():
            raise ConfigError(
                f"{d} is a non-empty folder without {MANIFEST_NAME}; an artifact replaces its folder whole, so "
                "pass a new or empty folder (or an existing artifact's folder)"
            )
        blob = save(self._tensors(), metadata={"kind": _KIND, "format": self.format.spec_string()})
        manifest = self.manifest(_sha256(blob))

        def fill(tmp: Path) -> None:
            (tmp / TENSORS_NAME).write_bytes(blob)
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

        return replace_dir(d, fill)


def _corrupt(path: Path, why: str) -> CalibrationError:
    return CalibrationError(
        f"calibration artifact {path} is corrupted or incomplete: {why}; recreate it with `kvpack calibrate`"
    )


def _role_stats(t: dict[str, torch.Tensor], role: str, percentiles: list[float]) -> RoleStats:
    pct = {}
    if percentiles:
        stacked = t[f"{role}.percentile"]
        pct = {p: stacked[:, i].contiguous() for i, p in enumerate(percentiles)}
    return RoleStats(**{n: t[f"{role}.{n}"] for n in _STATS}, tokens=t[f"{role}.tokens"], percentiles=pct)


def _scales(t: dict[str, torch.Tensor], role: str, spec: QuantSpec, source: str) -> StaticScales | None:
    if f"{role}.scale" not in t:
        return None
    src = source if role == "keys" else value_source(source)
    return StaticScales(role[:-1], spec, t[f"{role}.scale"], t.get(f"{role}.zero"), src)


def _named(fmt: KVFormat, name: Any) -> KVFormat:
    """``fmt`` under the name it was calibrated as (``fp8@static``) when that name still spells it."""
    try:
        same = isinstance(name, str) and parse_format(name) == fmt
    except FormatError:
        same = False
    return KVFormat(fmt.key, fmt.value, fmt.block_size, name=name, sink=fmt.sink) if same else fmt


def load_artifact(directory: str | Path, *, model: Any = None, format: str | KVFormat | None = None) -> Artifact:
    """Load and verify an artifact.

    Args:
        directory: the artifact directory (or its manifest file).
        model: when given (a model, its config, a config.json dict or a fingerprint dict), the fingerprint
            must match.
        format: when given, its static specs must match the artifact's scales.

    Raises:
        CalibrationError: missing files, checksum mismatch (corrupted or edited), unknown schema, tensors
            that contradict the manifest, or a model / format mismatch (the differing fields named).
    """
    from safetensors.torch import load

    d = Path(directory)
    if d.is_file():
        d = d.parent
    mpath = d / MANIFEST_NAME
    if not mpath.is_file():
        raise CalibrationError(
            f"no calibration artifact at {d}: {MANIFEST_NAME} is missing; run `kvpack calibrate --out {d}`"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(d, f"the manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != _KIND:
        raise _corrupt(d, f"{MANIFEST_NAME} is not a kvpack calibration manifest")
    if manifest.get("schema") != SCHEMA:
        raise CalibrationError(
            f"calibration artifact {d} has schema {manifest.get('schema')!r}, this kvpack reads schema {SCHEMA}; "
            "recalibrate with this version"
        )
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise _corrupt(d, "the manifest checksum does not match its content (was it edited?)")
    # the checksum has no key (anyone can re-sign): every field and tensor is validated as untrusted input
    fmt, percentiles = check_manifest(d, manifest, TENSORS_NAME)
    tpath = tensor_file(d, TENSORS_NAME)
    if not tpath.is_file():
        raise _corrupt(d, f"{tpath.name} is missing")
    blob = tpath.read_bytes()
    if _sha256(blob) != manifest["tensors"]["sha256"]:
        raise _corrupt(d, f"{tpath.name} does not match the checksum in the manifest")
    try:
        tensors = load(blob)
    except Exception as e:  # safetensors raises its own error type for a malformed header
        raise _corrupt(d, f"{tpath.name} is not a readable safetensors file ({e})") from None
    fp = manifest["fingerprint"]
    check_tensors(d, tensors, fmt, fp, percentiles)
    fmt = _named(fmt, manifest["format_name"])
    source = manifest["source"]
    art = Artifact(
        format=fmt,
        source=source,
        fingerprint=fp,
        data=manifest["data"],
        keys=_role_stats(tensors, "keys", percentiles),
        values=_role_stats(tensors, "values", percentiles),
        key_scales=_scales(tensors, "keys", fmt.key, source),
        value_scales=_scales(tensors, "values", fmt.value, source),
        kvpack_version=manifest["kvpack_version"],
        model=manifest.get("model", {}),
        query_energy=tensors.get("queries.energy"),
    )
    if model is not None:
        art.check_model(model)
    if format is not None:
        art.check_format(format)
    return art
