"""Static calibration: observe keys and values, save an artifact, seal blocks with calibrated scales.

Block-local scales need no calibration and stay the default. This package is the other answer: collect
per-channel key and value ranges offline (:class:`KVObserver`), save them with a model fingerprint
(:class:`Artifact`), and seal blocks with static scales (:func:`seal_with_static`), counting what clips
(:class:`ClipMonitor`). An artifact that does not fit the model, the format or its own checksum is refused
with a :class:`~kvpack.errors.CalibrationError`; no scale is ever defaulted.

Importing this package does not import transformers (only :mod:`kvpack.calibration.run` needs it, inside
its functions).
"""

from kvpack.calibration.artifact import Artifact, CalibratedScales, load_artifact
from kvpack.calibration.fingerprint import diff_fingerprints, fingerprint_from_config
from kvpack.calibration.observer import KVObserver, RoleStats, observing_cache
from kvpack.calibration.static import (
    CalibrationDriftWarning,
    ClipMonitor,
    LayerScales,
    StaticKeyScales,
    StaticScales,
    count_clipped,
    require_static_scales,
    seal_with_static,
    static_scales,
)
from kvpack.outliers import artifact_outlier_channels, seal_time_channels, select_outlier_channels

__all__ = [
    "Artifact",
    "CalibratedScales",
    "CalibrationDriftWarning",
    "ClipMonitor",
    "KVObserver",
    "LayerScales",
    "RoleStats",
    "StaticKeyScales",
    "StaticScales",
    "artifact_outlier_channels",
    "count_clipped",
    "diff_fingerprints",
    "fingerprint_from_config",
    "load_artifact",
    "observing_cache",
    "require_static_scales",
    "seal_time_channels",
    "seal_with_static",
    "select_outlier_channels",
    "static_scales",
]
