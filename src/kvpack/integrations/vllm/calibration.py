"""Calibrated (static) scales in the vLLM backend, from an artifact of ``kvpack calibrate``.

The engine's settings name the artifact: ``additional_config={"kvpack": {"format": "int8@static", "calibration":
"calib/"}}``. At start-up (:func:`calibration_reasons`) it is loaded and checked against the model (its
fingerprint) and against every static format of the plan; anything that does not match stops the engine with one
line. Each layer then takes its own row of the artifact (:func:`layer_calibration`): the static scales of its
static specs and, for a key spec with outlier channels, the artifact's channels, exactly as kvpack's own cache takes
them (:mod:`kvpack.cache.calibrated`). Blocks are sealed with those scales (:func:`kvpack.calibration.seal_with_static`,
:func:`kvpack.cache.write.seal_outliers`), so a page holds what the same format holds in kvpack's own cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kvpack.calibration.artifact import Artifact, load_artifact
from kvpack.calibration.static import LayerScales
from kvpack.errors import CalibrationError, ConfigError
from kvpack.formats import KVFormat
from kvpack.plans import LayerPlan

__all__ = ["LayerCalibration", "calibration_reasons", "layer_calibration", "worker_heads"]


@dataclass(frozen=True)
class LayerCalibration:
    """One layer's share of an artifact.

    Attributes:
        key, value: the static scales of the layer's static key / value spec (``[Hs, 1, Cs]``), else None.
        channels: ``[kv_heads, k]`` int64, the artifact's outlier key channels of the layer (key specs with
            outlier channels), else None: chosen per block at seal time.
        layer: the layer's number (its clip monitor's warnings name it).
        energy: ``[kv_heads, head_dim]`` float32, the queries' mean square per channel of the layer (key specs
            with query-ranked outlier channels, ``o<k>q``), else None.
    """

    key: LayerScales | None
    value: LayerScales | None
    channels: torch.Tensor | None
    layer: int = 0
    energy: torch.Tensor | None = None


def calibration_reasons(model_config: Any, plan: LayerPlan, path: str | None) -> list[str]:
    """Why an engine of ``model_config`` (the model's transformers config; None: not checked) cannot take the
    calibration artifact in folder ``path`` for ``plan`` (empty: it can). Each reason says what to change."""
    static = [f for f in plan.distinct_formats if f.is_static]
    ranked = [f for f in plan.distinct_formats if f.query_ranked and not f.is_static]
    if path is None:
        return [
            f'format {f.name or f.spec_string()} needs {what}: add "calibration": DIR to '
            f"additional_config['kvpack'], DIR from `kvpack calibrate --format '{f.spec_string()}' --out DIR`"
            for fs, what in ((static, "calibrated (static) scales"), (ranked, "the queries' statistics (o<N>q)"))
            for f in fs
        ]
    if not static and not any(f.has_outliers for f in plan.distinct_formats):
        return [
            f"additional_config['kvpack'] names a calibration, but {plan.name} takes no static scales or outlier "
            'channels, so it would be ignored: drop "calibration" or use a static format such as int8@static'
        ]
    try:
        art = load_artifact(path, model=model_config)
        for f in static:
            art.check_format(f)
        if any(f.query_ranked for f in plan.distinct_formats) and art.query_energy is None:
            return [
                f"calibration {path} holds no query statistics, which o<N>q outlier channels are ranked by; "
                "recalibrate with this kvpack (`kvpack calibrate --out DIR`)"
            ]
    except (CalibrationError, ConfigError) as e:
        return [f"calibration {path}: {e}"]
    return []


@lru_cache(maxsize=4)
def _artifact(path: str) -> Artifact:
    return load_artifact(path)  # checked at start-up (calibration_reasons); loaded once per process


def worker_heads(rank: int, world: int, total: int) -> tuple[int, int]:
    """The kv heads ``[h0, h1)`` of tensor-parallel worker ``rank`` of ``world`` when the model has ``total``: a
    contiguous share each when they split evenly, else (fewer heads than workers) one head that ``world // total``
    workers hold alike, as vLLM shards ``k_proj`` / ``v_proj``."""
    if total >= world:
        share = total // world
        return rank * share, (rank + 1) * share
    head = rank // (world // total)
    return head, head + 1


def _cut(scales: LayerScales | None, h0: int, h1: int, total: int) -> LayerScales | None:
    """``scales`` of heads ``[h0, h1)`` (per-tensor scales, one row for every head, stay whole)."""
    if scales is None or scales.scale.shape[0] != total or (h0, h1) == (0, total):
        return scales
    zero = None if scales.zero is None else scales.zero[h0:h1]
    return LayerScales(scales.spec, scales.scale[h0:h1], zero)


def layer_calibration(
    path: str | None,
    fmt: KVFormat,
    layer: int | None,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
    heads: tuple[int, int] | None = None,
) -> LayerCalibration | None:
    """Layer ``layer``'s calibration for ``fmt`` from the artifact at ``path`` (None: the format takes none), for
    the kv heads ``[h0, h1)`` of the model's that this worker holds (``heads``; None: all ``kv_heads``).

    Raises:
        ConfigError: a static format without a calibration, or a layer whose number is unknown.
        CalibrationError: the artifact does not have this layer's geometry.
    """
    if path is None or not (fmt.is_static or fmt.has_outliers):
        if fmt.needs_artifact:
            what = "calibrated (static) scales" if fmt.is_static else "the queries' statistics"
            raise ConfigError(f"kvpack: format {fmt.name} needs {what}; name a calibration")
        return None
    if layer is None:
        raise ConfigError("kvpack: a calibrated format needs each layer's number, and this layer's name has none")
    from kvpack.cache.calibrated import resolve_calibration, resolve_outlier_channels, resolve_query_energy

    art = _artifact(path)
    n, total = int(art.fingerprint["num_layers"]), int(art.fingerprint["kv_heads"])
    h0, h1 = heads if heads is not None else (0, kv_heads)
    if h1 - h0 != kv_heads or not 0 <= h0 < h1 <= total:
        raise CalibrationError(
            f"this worker holds kv heads [{h0}, {h1}) of a layer with {kv_heads}, and the artifact's model has {total}"
        )
    cal = resolve_calibration(fmt, art, n, total, head_dim, device)
    channels = resolve_outlier_channels(fmt, art, n, total, head_dim, device)
    energy = resolve_query_energy(fmt, art, n, total, head_dim, device)
    key = value = None
    if cal is not None:
        key = None if cal.key is None else _cut(cal.key.layer(layer), h0, h1, total)
        value = None if cal.value is None else _cut(cal.value.layer(layer), h0, h1, total)
    return LayerCalibration(
        key,
        value,
        None if channels is None else channels[layer, h0:h1],
        layer,
        None if energy is None else energy[layer, h0:h1],
    )
