"""Tiny random models of other architecture families, built from a config alone (no download): what the
transformers and vLLM integrations are tested on beyond the registered test models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# model_type and what differs from the caller's common sizes (None: a common field the family's configs lack): each
# family's own attention layout
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"head_dim": 128}),  # QK-norm
    "phi3": ("phi3", {"hidden_size": 192, "pad_token_id": 0}),  # fused QKV projection, head_dim 48
    "phi": ("phi", {"hidden_size": 320, "num_key_value_heads": 4, "partial_rotary_factor": 0.5}),  # head_dim 80
    "gpt_neox": ("gpt_neox", {"num_key_value_heads": 4, "rotary_pct": 0.25}),  # partial rotary
    "gpt2": ("gpt2", {"num_key_value_heads": None, "n_positions": 1024}),  # learned positions
    "stablelm": ("stablelm", {"partial_rotary_factor": 0.25}),
    "cohere": ("cohere", {"use_qk_norm": False}),  # parallel attention and MLP
    "olmo2": ("olmo2", {"num_key_value_heads": 4}),  # QK-norm over all heads
    "starcoder2": ("starcoder2", {"sliding_window": None}),  # biases everywhere
    "granite": ("granite", {"attention_multiplier": 0.05}),  # its own attention scale
    "llama": ("llama", {"head_dim": 128, "hidden_size": 256}),  # Llama 3's head_dim
    "qwen2": ("qwen2", {}),  # q/k/v biases
    # Falcon-7B's multi-query form: one kv head, whatever num_kv_heads says (vLLM and kvpack size read it so)
    "falcon": ("falcon", {"multi_query": True, "new_decoder_architecture": False, "alibi": False}),
    "gptj": ("gptj", {"num_key_value_heads": None, "rotary_dim": 16}),  # attends in its own code in transformers
    "gemma2": ("gemma2", {"head_dim": 64}),  # logit soft-capping: refused by the vLLM backend
    "bloom": ("bloom", {"num_key_value_heads": None}),  # ALiBi: refused by the vLLM backend
}


def build_family(name: str, common: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """A random float32 model of family ``name`` with ``common`` sizes (overridden by the family's own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kw = FAMILIES[name]
    torch.manual_seed(seed)
    fields = {k: v for k, v in {**common, **kw}.items() if v is not None}  # None: a field the family has not
    cfg = AutoConfig.for_model(model_type, **fields)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def save_family(name: str, common: dict[str, Any], folder: Path) -> str:
    """:func:`build_family` saved as a model folder (safetensors and config.json) under ``folder / name``."""
    path = folder / name
    build_family(name, common).save_pretrained(path)
    return str(path)
