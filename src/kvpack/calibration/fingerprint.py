"""Model fingerprint: the config facts a calibration artifact depends on, and how two fingerprints differ.

Calibrated key ranges are tied to one model: its layer count, kv_heads and head_dim give the shape of
every scale, and its RoPE settings decide what a key looks like after rotation. The fingerprint keeps
exactly those facts (plus a few cheap shape detectors), read from a transformers config object or a
``config.json`` dict, so an artifact made for another model is refused with the differing fields named.
"""

from __future__ import annotations

from typing import Any

from kvpack.errors import ConfigError

__all__ = ["FINGERPRINT_FIELDS", "diff_fingerprints", "fingerprint_from_config"]

# Fields compared when an artifact is loaded for a model; every one must match.
FINGERPRINT_FIELDS = (
    "architecture",
    "num_layers",
    "kv_heads",
    "attention_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "rope",
)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _plain(x: Any) -> Any:
    """JSON-stable copy of a config value (floats stay floats, tuples become lists, keys sorted)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x)
    return str(x)


def _rope(cfg: Any) -> dict[str, Any]:
    """RoPE settings: theta, type and any scaling parameters, whichever config convention holds them."""
    params = _get(cfg, "rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type parameters (hybrid models): keep them all, sorted by layer type
        return {k: _plain(v) for k, v in sorted(params.items())}
    rope: dict[str, Any] = {}
    if isinstance(params, dict):
        rope.update(_plain(params))
    theta = _get(cfg, "rope_theta")
    if theta is not None and "rope_theta" not in rope:
        rope["rope_theta"] = float(theta)
    scaling = _get(cfg, "rope_scaling")
    if isinstance(scaling, dict):
        for k, v in _plain(scaling).items():
            rope.setdefault(k, v)
    partial = _get(cfg, "partial_rotary_factor")
    if partial is not None:
        rope.setdefault("partial_rotary_factor", float(partial))
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope.pop("type")
    if rope:
        rope.setdefault("rope_type", "default")
    return dict(sorted(rope.items()))


def fingerprint_from_config(config: Any) -> dict[str, Any]:
    """The fingerprint of a model config (a transformers ``PretrainedConfig`` or a ``config.json`` dict).

    Returns a JSON-serializable dict with the keys of :data:`FINGERPRINT_FIELDS`.

    Raises:
        ConfigError: the config lacks the layer count, head counts or hidden size.
    """
    if not isinstance(config, dict) and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    elif isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "architectures": config.get("architectures")}
    from kvpack.modelspecs import check_config_sizes

    check_config_sizes(config, "the model config")
    layers = _get(config, "num_hidden_layers")
    heads = _get(config, "num_attention_heads")
    hidden = _get(config, "hidden_size")
    if layers is None or heads is None or hidden is None:
        raise ConfigError(
            "the model config lacks num_hidden_layers, num_attention_heads or hidden_size; "
            "pass the config of a decoder-only transformer (its config.json)"
        )
    kv_heads = _get(config, "num_key_value_heads") or heads  # null or absent (checked above: never 0)
    head_dim = _get(config, "head_dim") or hidden // heads
    # model_type, not architectures[0]: it names the attention code and survives every loader (a GGUF
    # load has no architectures list); fall back to the class name when a config has no model_type
    archs = _get(config, "architectures") or []
    arch = _get(config, "model_type") or (archs[0] if archs else "unknown")
    return {
        "architecture": str(arch),
        "num_layers": int(layers),
        "kv_heads": int(kv_heads),
        "attention_heads": int(heads),
        "head_dim": int(head_dim),
        "hidden_size": int(hidden),
        "vocab_size": int(_get(config, "vocab_size") or 0),
        "rope": _rope(config),
    }


def diff_fingerprints(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences, one per field: ``"kv_heads: artifact 3, model 8"`` (empty when equal)."""
    out = []
    for name in FINGERPRINT_FIELDS:
        a, b = expected.get(name), actual.get(name)
        if a != b:
            out.append(f"{name}: artifact {a!r}, model {b!r}")
    return out
