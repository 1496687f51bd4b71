"""Typed errors. Every error kvpack raises derives from :class:`KVPackError` and says how to fix it."""

from __future__ import annotations


class KVPackError(Exception):
    """Base class of every error kvpack raises on purpose."""


class FormatError(KVPackError, ValueError):
    """A format string or spec is invalid (unknown preset, bad field, impossible combination)."""


class ShapeError(KVPackError, ValueError):
    """A tensor has the wrong shape, dtype or device."""


class NonFiniteError(KVPackError, ValueError):
    """NaN or inf met while choosing scales; nothing was written.

    ``where`` lists the offending locations as dicts (for example ``{"layer": 3, "head": 1,
    "position": 130}``), most specific first.
    """

    def __init__(self, message: str, where: list[dict[str, int]] | None = None) -> None:
        super().__init__(message)
        self.where = where or []


class PoolExhaustedError(KVPackError, RuntimeError):
    """The block pool has too few free blocks; raised before any state changed."""


class SequenceError(KVPackError, KeyError):
    """Unknown sequence id, double free, or a crop beyond the sequence length."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnsupportedError(KVPackError, NotImplementedError):
    """A backend cannot run a case; ``reasons`` lists why."""

    def __init__(self, message: str, reasons: list[str] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons or []


class CalibrationError(KVPackError, ValueError):
    """A calibration artifact is missing, corrupted or made for another model or format."""


class ConfigError(KVPackError, ValueError):
    """A model config or command-line argument is missing or unreadable."""
