"""Attribution: is the damage in the keys or in the values, and in which layers?

* :func:`keys_only` / :func:`values_only`: the same format applied to one side, the other kept in fp16.
  Fed to the fidelity and needle runs like any format.
* :func:`layer_sensitivity`: each layer's attention-output error when that layer alone reads a quantized
  cache. One full-precision forward records every attention module's inputs and output; each module is then
  called again on the same inputs with a cache that quantizes its keys and values (the simulate engine's
  block-exact reconstruction), and the relative error of its output is measured. No error propagates
  between layers, so the numbers say where the format hurts, not how the damage compounds (the fidelity
  run measures that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpack.errors import ConfigError
from kvpack.formats import DType, KVFormat, QuantSpec
from kvpack.plans import LayerPlan, layer_formats

__all__ = ["attention_modules", "keys_only", "layer_sensitivity", "values_only"]

_FP16 = QuantSpec(DType.FP16)


def keys_only(fmt: KVFormat | LayerPlan) -> KVFormat | LayerPlan:
    """``fmt``'s key spec with fp16 values (values untouched but for the fp16 rounding); a plan's, layer by layer."""
    if isinstance(fmt, LayerPlan):
        return _each(fmt, keys_only)
    return KVFormat(fmt.key, _FP16, fmt.block_size, name=f"{fmt.name} keys only", sink=_sink(fmt.key, fmt))


def values_only(fmt: KVFormat | LayerPlan) -> KVFormat | LayerPlan:
    """fp16 keys with ``fmt``'s value spec; a plan's, layer by layer."""
    if isinstance(fmt, LayerPlan):
        return _each(fmt, values_only)
    return KVFormat(_FP16, fmt.value, fmt.block_size, name=f"{fmt.name} values only", sink=_sink(fmt.value, fmt))


def _each(plan: LayerPlan, side: Callable[[KVFormat], Any]) -> LayerPlan:
    """``plan`` with ``side`` applied to each of its formats (the same layers)."""
    return LayerPlan(side(plan.base), tuple((side(f), layers) for f, layers in plan.overrides))


def _sink(kept: QuantSpec, fmt: KVFormat) -> int:
    """``fmt``'s sink when the kept spec is quantized (a full-precision format has no sink)."""
    return 0 if kept.is_passthrough else fmt.sink


def attention_modules(model: Any) -> list[Any]:
    """The model's attention modules in layer order (modules with a ``layer_idx`` and a ``k_proj``)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    mods.sort(key=lambda m: m.layer_idx)
    if not mods:
        raise ConfigError(
            f"no attention modules with layer_idx and k_proj in {type(model).__name__}; per-layer sensitivity "
            "needs a transformers decoder with the usual attention modules"
        )
    return mods


@torch.inference_mode()
def layer_sensitivity(
    runner: Any, ids: Sequence[int], formats: dict[str, KVFormat | LayerPlan], skip_first_block: bool = True
) -> dict[str, list[float]]:
    """Relative attention-output error of every layer alone under each format.

    Args:
        runner: a :class:`kvpack.evaluation.runner.Runner`.
        ids: the text (one chunk; a few hundred tokens is plenty).
        formats: name -> format, or per-layer plan (each layer alone in its own format of the plan).
        skip_first_block: leave out positions of the first block (they only see the full-precision tail).

    Returns:
        name -> per-layer ``||o_q - o|| / ||o||`` over the chunk's positions.
    """

    from kvpack.integrations.transformers import cache_kwarg

    lm = runner.lm
    mods = attention_modules(lm.model)
    records: dict[int, tuple[tuple, dict, torch.Tensor]] = {}

    def hook(module, args, kwargs, output):
        records[module.layer_idx] = (args, dict(kwargs), output[0].detach().clone())

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in mods]
    try:
        runner.forward(ids, runner.cache(None, len(ids)), logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    if len(records) != len(mods):
        raise ConfigError(f"recorded {len(records)} of {len(mods)} attention layers; is the model a plain decoder?")
    per_layer = {name: layer_formats(fmt, lm.num_layers) for name, fmt in formats.items()}
    widest = max(f.block_size for fmts in per_layer.values() for f in fmts)
    start = min(len(ids) - 1, widest) if skip_first_block else 0
    out: dict[str, list[float]] = {}
    runner._use_attention(lm.attn_implementation)
    for name, fmts in per_layer.items():
        errs = []
        for m in mods:
            args, kwargs, ref = records[m.layer_idx]
            alone: list[KVFormat | None] = [None] * lm.num_layers
            alone[m.layer_idx] = fmts[m.layer_idx]
            kw = dict(kwargs)
            key = cache_kwarg(m)
            if key not in kw:
                raise ConfigError(
                    f"layer {m.layer_idx}'s attention module got its cache positionally; cannot replay it"
                )
            kw[key] = runner.cache(None, len(ids), layer_formats=alone)  # simulate engine, calibrated
            got = m(*args, **kw)[0]
            r, g = ref[:, start:].double(), got[:, start:].double()
            errs.append(float((g - r).norm() / r.norm().clamp_min(1e-30)))
        out[name] = errs
    return out
