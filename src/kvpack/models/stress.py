"""Stress models built from a real one: the features of other model families, planted where they hurt.

Every preset was first chosen on the embedded model, whose keys have no bias. Families whose ``k_proj`` has a
bias (Qwen2 and its descendants) store keys with large constant per-channel offsets, strongest in the first
layer; an e4m3 cache with rotated keys lost a third of its top-1 agreement on such a model. :func:`add_key_bias`
plants that feature in any transformers model whose attention modules have ``q_proj`` / ``k_proj`` linears, so
tests pin every format's fidelity on it without a second model on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpack.errors import ConfigError

__all__ = ["KeyBias", "add_key_bias"]


@dataclass(frozen=True)
class KeyBias:
    """What :func:`add_key_bias` planted.

    Attributes:
        channels: per layer, per kv head, the biased channels (pre-RoPE ``k_proj`` output channels of that head).
        largest: the largest ``|bias|``, per layer.
        key_std: the mean per-channel standard deviation of the unbiased keys, per layer.
    """

    channels: list[list[list[int]]]
    largest: list[float]
    key_std: list[float]


def _attention_modules(model: Any) -> list[Any]:
    layers = getattr(getattr(model, "model", model), "layers", None)
    mods = [getattr(layer, "self_attn", None) for layer in layers or ()]
    if not mods or any(m is None or not hasattr(m, "k_proj") or not hasattr(m, "q_proj") for m in mods):
        raise ConfigError(
            "add_key_bias needs a decoder whose layers have self_attn.q_proj and self_attn.k_proj linears "
            f"(Llama, Qwen2, Mistral families); {type(model).__name__} has none"
        )
    return mods


@torch.inference_mode()
def add_key_bias(
    model: Any,
    ids: Sequence[int],
    strength_first: float = 60.0,
    strength: float = 15.0,
    channels: int = 3,
    seed: int = 1,
) -> KeyBias:
    """Give every layer's ``k_proj`` a bias as biased-key families have: a few large constant channels per head.

    Per kv head, ``channels`` channels get a bias of ``strength`` (``strength_first`` in layer 0) times the
    layer's mean key standard deviation, with a random sign. They are chosen among the low-frequency RoPE pairs
    (the second quarter of each half of the head, where a constant stays nearly constant over a block) and,
    among those, where the head's queries carry the least energy: a trained model learns to point its queries
    away from a constant it cannot use, so plain e4m3 is hurt less than a rotation that mixes the offset into
    every channel. The model is modified in place; its outputs change (that is the point: the stress model is
    a model of its own, compared against its own full-precision cache).

    Args:
        model: a transformers causal LM (Llama-like attention, RoPE with ``rotate_half`` pairing ``c`` and
            ``c + head_dim / 2``).
        ids: token ids the key statistics are measured on (a few hundred are plenty).
        strength_first, strength: bias in units of the layer's mean key standard deviation.
        channels: biased channels per kv head (``1 <= channels <= head_dim / 4``).
        seed: chooses the signs and which half of each RoPE pair carries the bias.

    Returns:
        A :class:`KeyBias` describing what was planted.

    Raises:
        ConfigError: the model's attention has no ``q_proj`` / ``k_proj`` linears, or ``channels`` is out of range.
    """
    mods = _attention_modules(model)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    if not 1 <= channels <= d // 4:
        raise ConfigError(f"channels must be in 1..{d // 4} (a quarter of head_dim {d}), got {channels}")
    k_std: list[torch.Tensor] = []
    q_energy: list[torch.Tensor] = []
    hooks = [m.k_proj.register_forward_hook(lambda _m, _i, o: k_std.append(o[0].float().std(0))) for m in mods]
    hooks += [
        m.q_proj.register_forward_hook(lambda _m, _i, o: q_energy.append(o[0].float().pow(2).mean(0))) for m in mods
    ]
    try:
        model(torch.as_tensor(list(ids), dtype=torch.long).view(1, -1))
    finally:
        for h in hooks:
            h.remove()
    g = torch.Generator().manual_seed(seed)
    group = hq // hkv
    planted, largest, stds = [], [], []
    for layer, mod in enumerate(mods):
        std = float(k_std[layer].mean())
        amp = (strength_first if layer == 0 else strength) * std
        lin = mod.k_proj
        bias = torch.zeros(lin.out_features, dtype=torch.float32)
        per_head = []
        for h in range(hkv):
            qe = q_energy[layer].view(hq, d)[h * group : (h + 1) * group].sum(0)  # [d]
            pair = qe[: d // 2] + qe[d // 2 :]  # RoPE mixes channel c with c + d/2
            low = pair[d // 4 :].argsort()[:channels] + d // 4  # the quietest low-frequency pairs
            half = torch.randint(0, 2, (channels,), generator=g) * (d // 2)
            sign = torch.randint(0, 2, (channels,), generator=g).float() * 2 - 1
            chans = (low + half).tolist()
            bias[[h * d + c for c in chans]] = sign * amp
            per_head.append(sorted(chans))
        if lin.bias is not None:
            bias = bias + lin.bias.detach().float().cpu()
        lin.bias = torch.nn.Parameter(bias.to(lin.weight.dtype).to(lin.weight.device), requires_grad=False)
        planted.append(per_head)
        largest.append(float(bias.abs().max()))
        stds.append(std)
    return KeyBias(planted, largest, stds)
