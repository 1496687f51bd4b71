"""Export calibrated scales in the layout serving engines read (vLLM / llm-compressor checkpoints).

The convention (vLLM's ``BaseKVCacheMethod`` and the compressed-tensors ``kv_cache_scheme`` written by
llm-compressor): every attention layer has two float32 scalars, ``model.layers.{i}.self_attn.k_scale`` and
``model.layers.{i}.self_attn.v_scale``, for an fp8 e4m3 cache with one scale per tensor (per layer):
``stored = fp8(x / scale)``, ``x = float(stored) * scale``, ``scale = amax / 448`` where ``amax`` is the
largest magnitude the layer's keys (values) reach and 448 the largest finite e4m3 number. A missing
scale makes vLLM fall back to 1.0 (or to first-batch estimates), which is why kvpack writes every layer
and refuses to write from an artifact it cannot verify.

What engines can run, and what not, is data here (:func:`vllm_reasons_unsupported`), listed in
docs/calibration.md. This module does not import transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from kvpack.calibration.artifact import Artifact, load_artifact, value_source
from kvpack.errors import CalibrationError
from kvpack.formats import DType, KVFormat, PerChannel, PerHead, PerTensor, QuantSpec, parse_format

__all__ = [
    "E4M3_MAX",
    "SCALES_FILE",
    "SCHEME_FILE",
    "export_vllm",
    "vllm_reasons_unsupported",
    "vllm_scale_name",
    "vllm_scales",
]

E4M3_MAX = 448.0
SCALES_FILE = "kv_cache_scales.safetensors"
SCHEME_FILE = "kv_cache_scheme.json"
README_FILE = "README.md"
PROVENANCE_FILE = "kvpack_export.json"

# The quantization_config entry a compressed-tensors checkpoint carries for a static per-tensor fp8 cache.
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

# model_type values whose attention modules are named model.layers.{i}.self_attn in HF checkpoints.
SELF_ATTN_NAMING = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi3 granite olmo olmo2 "
    "smollm3 cohere starcoder2 stablelm deepseek_v2 deepseek_v3 internlm2 minicpm exaone".split()
)


def vllm_scale_name(layer: int, role: str) -> str:
    """``model.layers.{layer}.self_attn.k_scale`` (``role="k"``) or ``...v_scale`` (``role="v"``)."""
    if role not in ("k", "v"):
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    return f"model.layers.{layer}.self_attn.{role}_scale"


def _spec_reasons(spec: QuantSpec, role: str) -> list[str]:
    if spec.is_passthrough:
        return []
    gran = spec.granularity
    if spec.dtype.is_int:
        r = [
            f"{role}: {spec.dtype.value} with kvpack's scales has no vLLM checkpoint form (vLLM's int caches "
            "compute per-token-head scales on the fly)"
        ]
        if isinstance(gran, PerChannel):
            r.append(f"{role}: per-channel scales do not exist in vLLM (nor in SGLang or TensorRT-LLM)")
        if spec.has_zero:
            r.append(f"{role}: vLLM KV scales are symmetric (no zero-point)")
        return r
    if spec.dtype is DType.FP8_E5M2:
        return [f"{role}: vLLM runs fp8_e5m2 without scales; nothing to export"]
    if isinstance(gran, PerTensor):
        if spec.static:
            return []
        return [f"{role}: kvpack's block-local fp8 scale changes per block; vLLM's is fixed per layer (exported)"]
    if isinstance(gran, PerHead):
        return [f"{role}: kvpack's fp8 scales are per head (per block); the export writes vLLM's per-layer scale"]
    return [f"{role}: vLLM has one fp8 scale per layer, not per {gran.name}"]


def vllm_reasons_unsupported(format: str | KVFormat) -> list[str]:
    """Why vLLM cannot run ``format`` as is (empty when it can: fp16/bf16, or fp8 e4m3 with static
    per-tensor scales for keys and values).

    Whatever the format, :func:`export_vllm` can still write the fp8 per-tensor scales from the same
    calibration statistics; the reasons say what the engine will run instead of the kvpack format.
    """
    fmt = parse_format(format)
    reasons = _spec_reasons(fmt.key, "keys") + _spec_reasons(fmt.value, "values")
    if fmt.key.dtype is not fmt.value.dtype:
        reasons.append(
            f"keys are {fmt.key.dtype.value} and values {fmt.value.dtype.value}: vLLM's kv_cache_dtype is one "
            "dtype for both"
        )
    if fmt.sink:  # orthogonal to the scales: the export ignores it
        reasons.append(
            f"sink={fmt.sink}: vLLM has no full-precision sink positions; the first {fmt.sink} position(s) are "
            "quantized like the rest (the exported scales do not depend on the sink)"
        )
    return reasons


def vllm_scales(artifact: Artifact, source: str | None = None) -> dict[str, torch.Tensor]:
    """Per-layer fp8 e4m3 ``k_scale`` / ``v_scale`` (float32, shape ``[]``) under vLLM's tensor names.

    Args:
        artifact: a verified calibration artifact (:func:`~kvpack.calibration.load_artifact`).
        source: the range statistic: ``"absmax"``, ``"rope"`` (keys: RoPE pair bound; values: abs-max) or
            ``"p<P>"``; default: the artifact's own source.

    Raises:
        CalibrationError: a layer never saw a non-zero value (its scale would be meaningless), its range is
            NaN or inf (no finite scale exists), or the statistic is missing.
    """
    src = source or artifact.source
    k_amax = artifact.keys.magnitude(src).flatten(1).amax(1)  # [layers]
    v_amax = artifact.values.magnitude(value_source(src)).flatten(1).amax(1)
    out: dict[str, torch.Tensor] = {}
    for i in range(artifact.keys.num_layers):
        for role, amax in (("k", k_amax[i]), ("v", v_amax[i])):
            what = "key" if role == "k" else "value"
            if not math.isfinite(float(amax)):
                raise CalibrationError(
                    f"layer {i}: the calibrated {what} range ({src}) is {float(amax)}, so no finite fp8 scale "
                    "exists; recalibrate (an artifact from disk with such a value is refused when loaded)"
                )
            if not float(amax) > 0.0:
                raise CalibrationError(
                    f"layer {i}: every calibrated {'key' if role == 'k' else 'value'} was zero, so no scale can be "
                    "derived; recalibrate on more text (a default of 1.0 is never written)"
                )
            out[vllm_scale_name(i, role)] = (amax.double() / E4M3_MAX).float().reshape(())
    return out


def _readme(artifact: Artifact, n_layers: int, reasons: list[str], source: str) -> str:
    fp = artifact.fingerprint
    lines = [
        "# fp8 KV-cache scales exported by kvpack",
        "",
        f"Model: {fp.get('architecture', 'unknown')}, {fp['num_layers']} layers, {fp['kv_heads']} kv heads, head_dim "
        f"{fp['head_dim']}. Calibration: {artifact.data.get('samples')} x {artifact.data.get('seq_len')} tokens of "
        f"{artifact.data.get('name')}; range source {source}.",
        "",
        f"`{SCALES_FILE}` holds {2 * n_layers} float32 scalars, `model.layers.{{i}}.self_attn.k_scale` and "
        "`...v_scale` (scale = amax / 448, fp8 e4m3, one scale per layer).",
        "",
        "To serve with them, merge the tensors into the model's safetensors checkpoint and declare the",
        "scheme in its config.json (the compressed-tensors convention llm-compressor writes):",
        "",
        "```python",
        "from safetensors.torch import load_file, save_file",
        "weights = load_file('MODEL/model.safetensors')",
        f"weights.update(load_file('{SCALES_FILE}'))",
        "save_file(weights, 'MODEL/model.safetensors', metadata={'format': 'pt'})",
        "# sharded checkpoint: also add the names to model.safetensors.index.json",
        "# config.json: add quantization_config from kv_cache_scheme.json (if the checkpoint already has a",
        "# compressed-tensors quantization_config, e.g. fp8 weights, add only its kv_cache_scheme entry)",
        "```",
        "",
        "```bash",
        "vllm serve MODEL --kv-cache-dtype fp8   # e4m3, reads the k_scale / v_scale above",
        "```",
        "",
        "Check the startup log: a layer without a scale silently runs with 1.0.",
        "",
        "vLLM keeps no full-precision tail: every token is quantized when written, whereas kvpack seals",
        "blocks and keeps the newest partial block exact, so quality can differ slightly at the same scales.",
    ]
    if reasons:
        lines += ["", "The calibrated kvpack format does not map one-to-one:", ""] + [f"- {r}" for r in reasons]
    return "\n".join(lines) + "\n"


def export_vllm(artifact_dir: str | Path, out_dir: str | Path, source: str | None = None) -> dict[str, Any]:
    """Verify the artifact in ``artifact_dir`` and write, into ``out_dir``: ``kv_cache_scales.safetensors``
    (the per-layer scalars), ``kv_cache_scheme.json`` (the config.json entry), ``README.md`` (how to serve
    with them) and ``kvpack_export.json`` (provenance).

    Returns:
        A summary: ``{"out": str, "layers": int, "source": str, "reasons": [...], "k_scale": [...],
        "v_scale": [...]}``.

    Raises:
        CalibrationError: the artifact is missing, corrupted or unusable (see :func:`vllm_scales`).
        ConfigError: ``out_dir`` is a file, lies under one, or cannot be written (checked first).
    """
    from safetensors.torch import save

    from kvpack.fsutil import atomic_write_bytes, atomic_write_text, check_output_dir

    check_output_dir(out_dir, "--out")  # before any work
    artifact = load_artifact(artifact_dir)
    src = source or artifact.source
    scales = vllm_scales(artifact, src)
    n = artifact.keys.num_layers
    reasons = vllm_reasons_unsupported(artifact.format)
    arch = artifact.fingerprint.get("architecture")
    if arch not in SELF_ATTN_NAMING:
        reasons.append(
            f"model type {arch!r} may not name its attention modules model.layers.{{i}}.self_attn; check the "
            "checkpoint's tensor names and rename the scales to match"
        )
    out = check_output_dir(out_dir, "--out")
    out.mkdir(parents=True, exist_ok=True)
    # each file replaced in one step (the folder may hold other files, which are left alone)
    atomic_write_bytes(out / SCALES_FILE, save(scales, metadata={"format": "pt", "producer": "kvpack"}))
    scheme = {"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": KV_CACHE_SCHEME}}
    atomic_write_text(out / SCHEME_FILE, json.dumps(scheme, indent=2) + "\n")
    atomic_write_text(out / README_FILE, _readme(artifact, n, reasons, src))
    summary = {
        "out": str(out),
        "layers": n,
        "source": src,
        "reasons": reasons,
        "k_scale": [float(scales[vllm_scale_name(i, "k")]) for i in range(n)],
        "v_scale": [float(scales[vllm_scale_name(i, "v")]) for i in range(n)],
    }
    provenance = {
        "artifact": str(Path(artifact_dir)),
        "fingerprint": artifact.fingerprint,
        "data": artifact.data,
        "artifact_format": artifact.format.spec_string(),
        "kvpack_version": artifact.kvpack_version,
        **summary,
    }
    atomic_write_text(out / PROVENANCE_FILE, json.dumps(provenance, indent=2) + "\n")
    return summary
