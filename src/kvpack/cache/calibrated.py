"""Calibrated (static) scales in a :class:`~kvpack.cache.PagedKVCache`: checked once, at construction.

A format with ``static`` specs seals its blocks with the scales of a calibration artifact
(:func:`kvpack.calibration.seal_with_static`) instead of block-local ones. Everything that could make a seal
fail later is checked here first (fail closed): a static format without scales, scales for a format that
takes none, scales made for another spec, or of another shape than ``[num_layers, Hs, 1, Cs]``
(``[num_layers, kv_heads, 1, head_dim]`` per channel). The digest of the scales salts the prefix keys, so
blocks sealed with different scales are never shared.

A key spec with outlier channels takes its channels from an :class:`~kvpack.calibration.Artifact` when one
is given (the top-k of the observed key abs-max per layer and head, :func:`resolve_outlier_channels`);
without an artifact (or with bare :class:`CalibratedScales`, which carry no statistics) they are chosen per
block at seal time. A query-ranked key spec (``o<k>q``) takes the artifact's query statistics instead
(:func:`resolve_query_energy`) and chooses per block by them; without an artifact that holds them it is refused.
An artifact given to a format that has neither static specs nor outlier channels is
refused: it would be ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from kvpack.calibration.artifact import Artifact, CalibratedScales
from kvpack.calibration.static import StaticScales, require_static_scales, same_quantization
from kvpack.errors import CalibrationError
from kvpack.formats import KVFormat, QuantSpec
from kvpack.quant import decode_scale, scale_torch_dtype

__all__ = [
    "channels_digest",
    "energy_digest",
    "resolve_calibration",
    "resolve_outlier_channels",
    "resolve_query_energy",
    "scales_digest",
]


def _check_role(
    role: str, spec: QuantSpec, sc: StaticScales | None, want: tuple[int, ...], device: torch.device
) -> StaticScales | None:
    """One role's scales, checked against the cache's spec and geometry and moved to the cache device."""
    if not spec.static:
        if sc is not None:
            raise CalibrationError(
                f"the calibration carries {role} scales but {role} in this format ({spec}) are not static, so "
                f"they would be ignored; drop them (Artifact.scales_for(format) leaves them out) or mark {role} static"
            )
        return None
    if sc is None:
        raise CalibrationError(
            f"{role} in this format ({spec}) take static scales and the calibration carries none for them; "
            "use load_artifact(dir).scales_for(format) with an artifact made for this format"
        )
    if not same_quantization(spec, sc.spec):
        raise CalibrationError(
            f"{role}: the calibration's scales were made for {sc.spec}, the cache stores {spec}; recalibrate for "
            f"this format (kvpack calibrate --format ...) or use Artifact.rescaled(format)"
        )
    tensors = [("scale", sc.scale, scale_torch_dtype(spec.scale_dtype))]
    if spec.has_zero:
        if sc.zero is None:
            raise CalibrationError(f"{role}: {spec} is asymmetric and the calibration carries no zero-points")
        tensors.append(("zero", sc.zero, scale_torch_dtype(spec.zero_dtype)))
    for name, t, dtype in tensors:
        if tuple(t.shape) != want:
            raise CalibrationError(
                f"{role} static {name}s have shape {tuple(t.shape)}, this cache needs {want} (num_layers, Hs, 1, Cs "
                "for the spec's granularity); the artifact was made for another model: recalibrate"
            )
        if t.dtype != dtype:
            raise CalibrationError(f"{role} static {name}s are {t.dtype}, {spec} stores them as {dtype}")
    s = decode_scale(sc.scale, spec.scale_dtype)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise CalibrationError(f"{role} static scales hold zero, negative or non-finite values; recalibrate")
    if spec.has_zero and not bool(torch.isfinite(decode_scale(sc.zero, spec.zero_dtype)).all()):
        raise CalibrationError(f"{role} static zero-points hold non-finite values; recalibrate")
    zero = None if sc.zero is None or not spec.has_zero else sc.zero.to(device)
    return dataclasses.replace(sc, scale=sc.scale.to(device), zero=zero)


def resolve_calibration(
    fmt: KVFormat,
    calibration: CalibratedScales | Artifact | None,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> CalibratedScales | None:
    """The cache's calibrated scales, checked and on ``device``; ``None`` for a format without static specs.

    Args:
        calibration: ``load_artifact(dir, model=config).scales_for(fmt)`` (a :class:`CalibratedScales`), an
            :class:`Artifact` (its :meth:`~Artifact.scales_for` is taken here), or ``None``.

    Raises:
        CalibrationError: a static format without calibration, a calibration for a format without static
            specs, scales made for another spec, or scales whose shape is not ``[num_layers, Hs, 1, Cs]``.
    """
    if isinstance(calibration, Artifact):
        if not fmt.is_static and fmt.has_outliers:
            return None  # the artifact supplies outlier channels only (resolve_outlier_channels)
        calibration = calibration.scales_for(fmt)
    require_static_scales(fmt, calibration)
    if calibration is None:
        return None
    if not isinstance(calibration, CalibratedScales):
        raise CalibrationError(
            f"calibration must be a kvpack.calibration.CalibratedScales (load_artifact(dir).scales_for(format)) "
            f"or an Artifact, got {type(calibration).__name__}"
        )
    key, value = (
        _check_role(role, spec, sc, (num_layers, *spec.scale_shape(kv_heads, 1, head_dim)), device)
        for role, spec, sc in (("keys", fmt.key, calibration.key), ("values", fmt.value, calibration.value))
    )
    return CalibratedScales(fmt, key, value)


def scales_digest(calibration: CalibratedScales) -> str:
    """A hex digest of the scales (spec strings and the stored bytes of every scale and zero-point tensor)."""
    h = hashlib.blake2b(digest_size=16)
    for sc in (calibration.key, calibration.value):
        if sc is None:
            h.update(b"-")
            continue
        h.update(str(sc.spec).encode())
        for t in (sc.scale, sc.zero):
            if t is not None:
                h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def resolve_outlier_channels(
    fmt: KVFormat,
    calibration: CalibratedScales | Artifact | None,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The calibrated outlier key channels ``[num_layers, kv_heads, k]`` int64 on ``device``, or ``None``
    (chosen per block at seal time): only a format with ``outliers`` ranked by range and an :class:`Artifact`
    give channels.

    Raises:
        CalibrationError: the artifact's key statistics do not have this cache's geometry.
    """
    if not fmt.has_outliers or fmt.query_ranked or not isinstance(calibration, Artifact):
        return None
    from kvpack.outliers import artifact_outlier_channels

    return artifact_outlier_channels(calibration, fmt.key.outliers, num_layers, kv_heads, head_dim).to(device)


def _digest(t: torch.Tensor, dtype: torch.dtype) -> str:
    data = t.detach().to(dtype).contiguous().cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def channels_digest(channels: torch.Tensor) -> str:
    """A hex digest of calibrated outlier channels (blocks sealed with other channels hold other bytes)."""
    return _digest(channels, torch.int64)


def resolve_query_energy(
    fmt: KVFormat,
    calibration: CalibratedScales | Artifact | None,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The queries' mean square per channel ``[num_layers, kv_heads, head_dim]`` float32 on ``device`` that a
    query-ranked key spec (``o<k>q``) ranks outlier channels by; ``None`` for any other format.

    Raises:
        CalibrationError: a query-ranked format without an :class:`Artifact`, with one that holds no query
            statistics (made before they were recorded, or from a model whose attention kvpack could not
            observe), or with statistics of another geometry.
    """
    if not fmt.query_ranked:
        return None
    how = f"run `kvpack calibrate --format '{fmt.spec_string()}' --out DIR` and pass the artifact (calibration=DIR)"
    if not isinstance(calibration, Artifact):
        got = "none" if calibration is None else "bare scales, which carry no statistics"
        raise CalibrationError(
            f"format {fmt.name!r} ranks outlier key channels by the queries' energy, which a calibration artifact "
            f"holds, and got {got}; {how}"
        )
    energy = calibration.query_energy
    if energy is None:
        raise CalibrationError(
            f"format {fmt.name!r} ranks outlier key channels by the queries' energy, and the calibration artifact "
            f"holds no query statistics (made by an older kvpack, or its model's attention was not observed); {how}"
        )
    want = (num_layers, kv_heads, head_dim)
    if tuple(energy.shape) != want:
        raise CalibrationError(
            f"the calibration artifact's query statistics have shape {tuple(energy.shape)}, this cache needs "
            f"layers x kv_heads x head_dim = {want}: the artifact was made for another model; recalibrate"
        )
    if not bool(torch.isfinite(energy).all()) or bool((energy < 0).any()):
        raise CalibrationError("the calibration artifact's query statistics hold negative or non-finite values")
    return energy.to(device, torch.float32)


def energy_digest(energy: torch.Tensor) -> str:
    """A hex digest of query statistics (blocks ranked by other statistics may keep other channels)."""
    return _digest(energy, torch.float32)
