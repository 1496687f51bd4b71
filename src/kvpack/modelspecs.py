"""Model shapes for capacity planning: a small built-in table, or a Hugging Face ``config.json``.

Only what the cache size depends on is kept (layers, kv_heads, head_dim), plus the parameter count that
gives the weights' size. Pure Python: reading a config never imports transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpack.errors import ConfigError

__all__ = [
    "KNOWN_MODELS",
    "ModelShape",
    "config_kv_heads",
    "config_layer_types",
    "config_windows",
    "estimate_params",
    "load_model_shape",
    "shape_from_config",
]


@dataclass(frozen=True)
class ModelShape:
    """The cache-relevant shape of a decoder-only model.

    ``params`` is the parameter count (``None`` when unknown); ``params_estimated`` says it was computed
    from the config's matrix sizes rather than taken from a published figure. ``windows``: each layer's sliding
    window in tokens (``None`` entries: full attention), or ``None`` when every layer attends its whole history.
    ``layers`` counts the layers that cache keys and values; ``state_layers`` those of a hybrid model that keep a
    fixed-size state instead (linear attention, Mamba), which a KV cache format does not touch.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: int | None = None
    attention_heads: int | None = None
    params_estimated: bool = False
    windows: tuple[int | None, ...] | None = None
    state_layers: int = 0

    def __post_init__(self) -> None:
        for field_name in ("layers", "kv_heads", "head_dim"):
            v = getattr(self, field_name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model {self.name!r}: {field_name} must be a positive integer, got {v!r}")
        if self.windows is not None:
            if len(self.windows) != self.layers:
                raise ConfigError(
                    f"model {self.name!r}: {len(self.windows)} sliding windows for {self.layers} layers; "
                    "give one per layer"
                )
            bad = [
                w for w in self.windows if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0)
            ]
            if bad:
                raise ConfigError(f"model {self.name!r}: a sliding window must be a positive integer, got {bad[0]!r}")
        if self.params is not None and self.params <= 0:
            raise ConfigError(f"model {self.name!r}: parameter count must be positive, got {self.params!r}")

    @property
    def is_mqa(self) -> bool:
        """One kv head shared by every query head (multi-query attention)."""
        return self.kv_heads == 1

    @property
    def gqa_factor(self) -> int | None:
        """Query heads per kv head (``None`` when the query head count is unknown)."""
        if not self.attention_heads:
            return None
        return self.attention_heads // self.kv_heads


def _m(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, params_b: float) -> ModelShape:
    return ModelShape(name, layers, kv_heads, head_dim, round(params_b * 1e9), heads)


# Public figures from the models' config.json files and model cards (parameter counts rounded).
KNOWN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        _m("llama-3.1-8b", 32, 32, 8, 128, 8.03),
        _m("llama-3.1-70b", 80, 64, 8, 128, 70.6),
        _m("llama-3.1-405b", 126, 128, 8, 128, 405.9),
        _m("llama-3.2-1b", 16, 32, 8, 64, 1.24),
        _m("llama-3.2-3b", 28, 24, 8, 128, 3.21),
        _m("llama-2-7b", 32, 32, 32, 128, 6.74),
        _m("mistral-7b", 32, 32, 8, 128, 7.25),
        _m("mixtral-8x7b", 32, 32, 8, 128, 46.7),
        _m("qwen2.5-0.5b", 24, 14, 2, 64, 0.494),
        _m("qwen2.5-7b", 28, 28, 4, 128, 7.62),
        _m("qwen2.5-72b", 80, 64, 8, 128, 72.7),
        _m("phi-3-mini", 32, 32, 32, 96, 3.82),
        _m("falcon-7b", 32, 71, 1, 64, 7.22),
        _m("smollm2-135m", 30, 9, 3, 64, 0.1345),
        _m("smollm2-360m", 32, 15, 5, 64, 0.362),
        _m("smollm2-1.7b", 24, 32, 32, 64, 1.71),
    ]
}


# Sizes a config may give; each, when present and not null, must be a positive integer.
CONFIG_SIZE_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "hidden_size",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "n_layer",
    "n_head",
    "n_embd",
    "num_layers",
    "n_layers",
    "n_heads",
    "n_head_kv",
    "multi_query_group_num",
    "hidden_size_per_head",
    "kv_channels",
)


def check_config_sizes(cfg: Any, where: str = "config", fields: tuple[str, ...] = CONFIG_SIZE_FIELDS) -> None:
    """Refuse a config (a ``config.json`` dict or a config object) whose size fields are not positive integers
    (``"abc"``, ``0``, ``-1``, ``2.5``, ``true``), naming the field: a bad size would otherwise be replaced by a
    default or fail deep inside a model loader.

    Raises:
        ConfigError: the first bad field.
    """
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        check_config_sizes(cfg["text_config"], f"{where} (text_config)")
    for name in fields:
        v = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{where}: {name} must be a positive integer, got {v!r}; fix the model's config.json")


def _get(cfg: dict[str, Any], *names: str) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return None


def estimate_params(cfg: dict[str, Any]) -> int | None:
    """Parameter count of a Llama-style decoder from its config (embeddings, attention, gated MLP, norms).

    Mixture-of-experts configs count every expert. Returns ``None`` when a needed size is missing.
    """
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    vocab = _get(cfg, "vocab_size")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    inter = _get(cfg, "intermediate_size", "ffn_dim", "n_inner")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, vocab, layers, heads, inter)):
        return None
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or hidden // heads
    experts = _get(cfg, "num_local_experts", "num_experts") or 1
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o and k, v projections
    mlp = 3 * hidden * inter * experts  # gate, up, down
    router = hidden * experts if experts > 1 else 0
    per_layer = attn + mlp + router + 2 * hidden  # two norms
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + hidden


def shape_from_config(cfg: dict[str, Any], name: str = "config") -> ModelShape:
    """Read layers, kv_heads, head_dim (and an estimated parameter count) from a config dict."""
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the decoder here
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k == "tie_word_embeddings"}}
    check_config_sizes(cfg, name)
    if cfg.get("kv_lora_rank") is not None:
        raise ConfigError(
            f"{name}: multi-head latent attention (kv_lora_rank {cfg['kv_lora_rank']}, DeepSeek's MLA) caches one "
            "compressed latent per token and layer, not keys and values per kv head; kvpack's formats do not store "
            "it, so there is no kvpack cache to size"
        )
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _get(cfg, "num_attention_heads", "n_head", "n_heads")
    kv_heads = config_kv_heads(cfg) or heads  # null or absent: one per query head
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    head_dim = _get(cfg, "head_dim", "hidden_size_per_head", "kv_channels") or (
        hidden // heads if hidden and heads else None
    )
    missing = [
        n
        for n, v in (("num_hidden_layers", layers), ("num_key_value_heads or num_attention_heads", kv_heads))
        if v is None
    ]
    if head_dim is None:
        missing.append("head_dim or hidden_size with num_attention_heads")
    if missing:
        raise ConfigError(
            f"{name}: config lacks {', '.join(missing)}; give the shape with --layers, --kv-heads and --head-dim"
        )
    params = estimate_params(cfg)
    windows = config_windows(cfg, layers, name)
    types = config_layer_types(cfg, layers, name)
    kv_layers = [i for i, t in enumerate(types) if t in KV_LAYER_TYPES] if types else list(range(layers))
    if not kv_layers:
        raise ConfigError(f"{name}: no layer caches keys and values (layer_types: {sorted(set(types))})")
    if windows is not None:
        windows = tuple(windows[i] for i in kv_layers)
        windows = windows if any(w is not None for w in windows) else None
    return ModelShape(
        name=name,
        layers=len(kv_layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        params=params,
        attention_heads=heads,
        params_estimated=params is not None,
        windows=windows,
        state_layers=layers - len(kv_layers),
    )


# layer_types entries (transformers' names): layers that cache keys and values per token, and layers of hybrid
# models that keep a fixed-size state instead
KV_LAYER_TYPES = ("full_attention", "attention", "sliding_attention", "chunked_attention")
STATE_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "conv", "short_conv")


def config_layer_types(cfg: dict[str, Any], layers: int, name: str = "config") -> list[str] | None:
    """The config's ``layer_types`` (one entry per layer), or ``None`` when it gives none.

    Raises:
        ConfigError: a list of the wrong length, or a type that is neither in :data:`KV_LAYER_TYPES` nor in
            :data:`STATE_LAYER_TYPES` (kvpack would not know whether it caches keys and values).
    """
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"{name}: layer_types must list one type per layer ({layers}); fix the model's config.json")
    unknown = sorted({str(t) for t in types if t not in KV_LAYER_TYPES + STATE_LAYER_TYPES})
    if unknown:
        raise ConfigError(
            f"{name}: layer type {', '.join(map(repr, unknown))} is not one kvpack knows: "
            f"{', '.join(KV_LAYER_TYPES)} cache keys and values, {', '.join(STATE_LAYER_TYPES)} keep a state; "
            "give the attention layers' shape with --layers, --kv-heads and --head-dim"
        )
    return types


def config_kv_heads(cfg: dict[str, Any]) -> int | None:
    """The kv heads a config gives, by the rules vLLM's model loaders follow; ``None`` when it names none (then
    there is one per query head).

    ``multi_query: true`` is one kv head (Falcon-7B, StarCoder's GPT-BigCode), except in Falcon's new decoder
    architecture, which takes ``num_kv_heads``; MPT and DBRX keep theirs in ``attn_config.kv_n_heads``, ChatGLM
    in ``multi_query_group_num``, the first Falcon checkpoints in ``n_head_kv``.
    """
    falcon = cfg.get("model_type") in ("falcon", "RefinedWeb", "RefinedWebModel")
    if cfg.get("multi_query") is True and not (falcon and cfg.get("new_decoder_architecture")):
        return 1
    attn = cfg.get("attn_config")
    if isinstance(attn, dict) and attn.get("kv_n_heads") is not None:
        check_config_sizes({"kv_n_heads": attn["kv_n_heads"]}, "config (attn_config)", ("kv_n_heads",))
        return attn["kv_n_heads"]
    return _get(cfg, "n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")


def config_windows(cfg: dict[str, Any], layers: int, name: str = "config") -> tuple[int | None, ...] | None:
    """Each layer's attention window from a config dict; ``None`` when no layer has one.

    With ``layer_types``, ``"sliding_attention"`` layers take ``sliding_window`` and ``"chunked_attention"`` layers
    (Llama 4) ``attention_chunk_size``, which bounds what they keep (a chunk attends at most that many tokens); the
    others attend everything. Without it, every layer takes ``sliding_window`` unless ``use_sliding_window`` is false.

    Raises:
        ConfigError: ``layer_types`` of the wrong length or with unknown types, or a window that is not a positive
            integer.
    """
    window = None if cfg.get("use_sliding_window") is False else cfg.get("sliding_window")
    chunk = cfg.get("attention_chunk_size")
    for field, w in (("sliding_window", window), ("attention_chunk_size", chunk)):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ConfigError(f"{name}: {field} must be a positive integer, got {w!r}; fix the model's config.json")
    types = config_layer_types(cfg, layers, name)
    if types is None:
        return None if window is None else (window,) * layers
    by_type = {"sliding_attention": window, "chunked_attention": chunk}
    ws = tuple(by_type.get(t) for t in types)
    return ws if any(w is not None for w in ws) else None


def load_model_shape(name_or_path: str) -> ModelShape:
    """A built-in model by name (case-insensitive), or the ``config.json`` at a path or inside a folder.

    Raises:
        ConfigError: unknown name, unreadable file, invalid JSON, or a config without the needed sizes.
    """
    key = name_or_path.strip().lower()
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        looks_like_path = any(c in name_or_path for c in "/\\") or name_or_path.endswith(".json")
        what = f"no file {str(path)!r}" if looks_like_path else f"unknown model {name_or_path!r}"
        raise ConfigError(
            f"{what}; give a config.json path or folder, or one of the built-in models: {', '.join(KNOWN_MODELS)}"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read model config {str(path)!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    return shape_from_config(cfg, name=str(path.parent.name if path.name == "config.json" else path.name))
