"""The kvpack settings of a vLLM engine: ``additional_config={"kvpack": {"format": ...}}``, checked at start-up.

Everything vLLM cannot serve with a kvpack format is refused here, before any weight is loaded, with one line that
says what to change: never a silent fallback to another backend. Nothing here is specific to a device; two hooks
call it (see docs/vllm.md):

* the CPU platform's config step (:meth:`KVPackCpuPlatform.check_and_update_config`), in the process that builds
  the engine's config, which then travels to the engine core and the workers;
* the backend's :meth:`KVPackAttentionBackend.validate_configuration`, which vLLM's CUDA platform calls for a
  selected backend (``--attention-backend CUSTOM``) in each worker as the model's attention layers are built:
  before the weights load and before the KV space is measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvpack.errors import ConfigError, FormatError
from kvpack.formats import KVFormat
from kvpack.integrations.vllm.calibration import calibration_reasons
from kvpack.modelspecs import config_windows
from kvpack.plans import LayerPlan, parse_plan
from kvpack.sizing import VllmSpace, vllm_float16_tails, vllm_smaller_block, vllm_tail_bytes

__all__ = [
    "DRAFT_FREE_METHODS",
    "KERNELS",
    "Settings",
    "engine_reasons",
    "layer_index",
    "names_block",
    "pay_tails",
    "serve_block",
    "settings_from",
    "spec_tokens",
    "startup_reasons",
    "tail_advice",
    "tail_pool_bytes",
    "tail_slots",
]

logger = logging.getLogger(__name__)

KERNELS = ("auto", "cpu", "triton", "reference")
_KEY = "kvpack"
_PAID = "_kvpack_tail_bytes"  # set on the cache config once the tails are paid; pickled with it to other processes
_HINT = 'additional_config={"kvpack": {"format": "int4"}} (CLI: --additional-config \'{"kvpack": {"format": "int4"}}\')'


@dataclass(frozen=True)
class Settings:
    """What the user chose: the format, or a per-layer plan (:mod:`kvpack.plans`), the decode kernel
    (``auto``: the fused kernel of the device), and the calibration artifact's folder for static formats
    (:mod:`kvpack.integrations.vllm.calibration`).

    Every format of a plan seals blocks of the same size and keeps the same sink rows (:func:`settings_from`
    checks): vLLM gives all layers one block table, and the tails are planned once for every layer.
    """

    plan: LayerPlan
    kernel: str = "auto"
    calibration: str | None = None

    @property
    def format(self) -> KVFormat:
        """The base format: its block size and sink are every layer's."""
        return self.plan.base

    @property
    def formats(self) -> list[KVFormat]:
        """The plan's distinct formats, the base first."""
        return self.plan.distinct_formats

    def layer_format(self, layer: int) -> KVFormat:
        """The format of layer ``layer`` (0-based, the model's numbering)."""
        for fmt, layers in self.plan.overrides:
            if layer in layers:
                return fmt
        return self.plan.base

    def format_of(self, layer_name: str | None) -> KVFormat:
        """The format of the vLLM layer named ``layer_name`` (:func:`layer_index`); any name without a plan.

        Raises:
            ConfigError: a plan, and the name holds no single layer number.
        """
        if not self.plan.overrides:
            return self.plan.base
        index = layer_index(layer_name)
        if index is None:
            raise ConfigError(f"kvpack: cannot tell which layer {layer_name!r} is, so a per-layer plan cannot serve it")
        return self.layer_format(index)

    @property
    def name(self) -> str:
        return self.plan.name if self.plan.overrides else (self.format.name or self.format.spec_string())


def layer_index(layer_name: str | None) -> int | None:
    """The layer number in a vLLM layer's name, the one number in it (``model.layers.7.self_attn.attn`` -> 7), as
    vLLM numbers layers; None when the name holds no single number."""
    nums = [int(p) for p in (layer_name or "").split(".") if p.isdigit()]
    return nums[0] if len(nums) == 1 else None


def _raw(vllm_config: Any) -> dict | None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(_KEY) if isinstance(extra, dict) else None
    return raw


def settings_from(vllm_config: Any) -> Settings | None:
    """The kvpack settings of this engine, or None when it does not use kvpack.

    Raises:
        ConfigError: a malformed ``kvpack`` entry or an unknown format (the message lists the presets).
    """
    raw = _raw(vllm_config)
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"format": raw}
    if not isinstance(raw, dict) or not isinstance(raw.get("format"), str):
        raise ConfigError(f"kvpack: additional_config['kvpack'] must name a format, e.g. {_HINT}; got {raw!r}")
    unknown = set(raw) - {"format", "kernel", "calibration"}
    if unknown:
        raise ConfigError(
            f"kvpack: unknown key(s) {sorted(unknown)} in additional_config['kvpack']; keys: format, kernel, "
            "calibration"
        )
    calibration = raw.get("calibration")
    if calibration is not None and not isinstance(calibration, str):
        raise ConfigError(
            "kvpack: additional_config['kvpack']['calibration'] must be the folder of a `kvpack calibrate` "
            f"artifact, got {calibration!r}"
        )
    kernel = raw.get("kernel", "auto")
    if kernel not in KERNELS:
        raise ConfigError(f"kvpack: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    try:
        plan = parse_plan(raw["format"])
    except FormatError as e:
        raise ConfigError(f"kvpack: {e}") from None
    uneven = [
        f.name or f.spec_string()
        for f, _ in plan.overrides
        if (f.block_size, f.sink, f.tail) != (plan.base.block_size, plan.base.sink, plan.base.tail)
    ]
    if uneven:
        tail = "the model's" if plan.base.tail is None else plan.base.tail.value
        raise ConfigError(
            f"kvpack: in plan {plan.name!r}, {', '.join(uneven)} differ(s) from the base format "
            f"{plan.base.name!r} in block size, sink rows or tail dtype (block={plan.base.block_size}, "
            f"sink={plan.base.sink}, tail {tail}); vLLM gives every layer one block table and the tails are planned "
            "once for all layers: give every format of the plan the same block=, sink= and tail="
        )
    return Settings(plan, kernel, calibration)


# Speculative methods whose drafts come from no model of their own (no attention layer, no KV cache): the target
# model verifies them through the kvpack layers, which keep a sealed block's rows until no draft can roll back into it
DRAFT_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


def spec_tokens(vllm_config: Any) -> int:
    """Draft tokens per step (``num_speculative_tokens``; 0 without speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0


def tail_slots(vllm_config: Any) -> int:
    """Tail slots per layer: one per running request (``max_num_seqs``), twice that with speculative decoding (a
    reserve per request, :class:`~kvpack.integrations.vllm.tails.TailTable`)."""
    seqs = vllm_config.scheduler_config.max_num_seqs
    return seqs * (2 if spec_tokens(vllm_config) else 1)


def tail_pool_bytes(fmt: KVFormat, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seqs: int) -> int:
    """Bytes of the full-precision tails (:func:`kvpack.sizing.vllm_tail_bytes` for ``dtype``)."""
    return vllm_tail_bytes(fmt, num_layers, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size(), seqs)


def startup_reasons(vllm_config: Any, fmt: KVFormat | LayerPlan, calibration: str | None = None) -> list[str]:
    """Why this engine cannot run ``fmt``, a format or a per-layer plan, with the calibration artifact in folder
    ``calibration`` (empty: it can). Each reason says what to change."""
    reasons = []
    plan = parse_plan(fmt)
    base = plan.base
    cache = vllm_config.cache_config
    if str(getattr(cache, "cache_dtype", "auto")) != "auto":
        reasons.append(
            f"kv_cache_dtype={cache.cache_dtype!r}: a kvpack format sets the cache's bytes itself; "
            "leave kv_cache_dtype at 'auto'"
        )
    if getattr(cache, "user_specified_block_size", False) and cache.block_size != base.block_size:
        reasons.append(
            f"block_size={cache.block_size} but format {base.name or base.spec_string()} seals blocks of "
            f"{base.block_size}: pass block_size={base.block_size} or a format with block={cache.block_size}"
        )
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        method = getattr(spec, "method", None)
        drafts = spec_tokens(vllm_config)
        if method not in DRAFT_FREE_METHODS:
            reasons.append(
                f"speculative decoding with method {method!r}: its drafter has attention layers of its own, which "
                f"the kvpack backend does not serve; use one of {', '.join(sorted(DRAFT_FREE_METHODS))} "
                "(e.g. speculative_config={'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_max': 4}) "
                "or drop speculative_config"
            )
        if drafts >= base.block_size:
            reasons.append(
                f"num_speculative_tokens={drafts}: the kvpack backend keeps drafts inside one block of "
                f"{base.block_size}; use fewer than {base.block_size} draft tokens"
            )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        reasons.append(
            "KV transfer/offload connectors move pages the kvpack backend lays out itself; drop kv_transfer_config"
        )
    model = getattr(vllm_config, "model_config", None)
    hf = None if model is None else (getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None))
    reasons += calibration_reasons(hf, plan, calibration)
    if model is not None:
        if getattr(model, "use_mla", False):
            reasons.append("MLA models (latent KV) are not served by the kvpack backend")
        if plan.overrides and _has_windows(hf):
            reasons.append(
                f"per-layer plan {plan.name!r} on a model with sliding-window layers: not served (vLLM groups such "
                "a model's layers by attention type, and a group needs pages of one size); give one format for "
                "every layer"
            )
        if model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"model dtype {model.dtype}: the kvpack tails take float16, bfloat16 or float32")
        layers = getattr(hf, "num_hidden_layers", None) if hf is not None else None
        if plan.overrides and isinstance(layers, int):
            try:
                plan.formats(layers)
            except FormatError as e:
                reasons.append(str(e))
    return reasons


def _config_windows(hf: Any) -> tuple[int | None, ...] | None:
    """Each layer's sliding window of the model whose (text) config is ``hf`` (None: none)
    (:func:`kvpack.modelspecs.config_windows`, which reads the same fields from a ``config.json``).

    Raises:
        ConfigError: a malformed window field.
    """
    layers = getattr(hf, "num_hidden_layers", None)
    if hf is None or not isinstance(layers, int) or layers < 1:
        return None
    fields = {k: getattr(hf, k, None) for k in ("sliding_window", "use_sliding_window", "layer_types")}
    if isinstance(fields["layer_types"], tuple):
        fields["layer_types"] = list(fields["layer_types"])
    return config_windows(fields, layers)


def _windows(hf: Any) -> tuple[int | None, ...] | None:
    """:func:`_config_windows`, None for a malformed field (vLLM's own config step judges it)."""
    try:
        return _config_windows(hf)
    except ConfigError:
        return None


def _has_windows(hf: Any) -> bool:
    """Whether some layer of the model whose (text) config is ``hf`` attends a sliding window."""
    try:
        return _config_windows(hf) is not None
    except ConfigError:  # a malformed window field: vLLM's own config step judges it; a plan is not served then
        return True


def engine_reasons(vllm_config: Any, fmt: KVFormat | LayerPlan, calibration: str | None = None) -> list[str]:
    """:func:`startup_reasons`, and whether the hook that releases finished requests' tails is in place: vLLM's V1
    model runner (``GPUModelRunner._update_states``, which the CPU runner inherits)."""
    from kvpack.integrations.vllm import hooks

    reasons = startup_reasons(vllm_config, fmt, calibration)
    if not hooks.install():
        reasons.append(
            "this vLLM's GPUModelRunner has no _update_states (finished requests) or get_kv_cache_spec (per-layer "
            "pages), which the kvpack backend hooks"
        )
    if getattr(vllm_config, "use_v2_model_runner", False):  # the CUDA default of vLLM 0.32 wherever Triton runs
        reasons.append(
            "vLLM's V2 model runner does not go through the hook that releases finished requests' tails; "
            "set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    return reasons


# The tails' share of the KV space from which start-up names a smaller block that holds more tokens
TAIL_SHARE_ADVICE = 0.25


def tail_advice(fmt: KVFormat, space: VllmSpace) -> str | None:
    """A line for the start-up log when the full-precision tails take at least :data:`TAIL_SHARE_ADVICE` of one
    worker's KV space and ``fmt`` with a smaller block (:func:`kvpack.sizing.vllm_smaller_block`), or a float32
    model's tails in float16 (``tail=fp16``), holds more tokens there; None otherwise."""
    tails = space.tail_bytes(fmt)
    if tails < TAIL_SHARE_ADVICE * space.space_bytes:
        return None
    options = []
    found = vllm_smaller_block(fmt, space)
    if found is not None:
        options.append(f"'{found[0].name}' {found[1]:,} (shorter tails, a little more scale bytes per token)")
    halved = vllm_float16_tails(fmt, space)
    if halved is not None:
        options.append(f"'{halved[0].name}' {halved[1]:,} (tails and sink rows in float16: half the bytes)")
    if not options:
        return None
    mib = 2**20
    return (
        f"kvpack: the full-precision tails of {space.seqs} requests take {tails / mib:.1f} MiB of the "
        f"{space.space_bytes / mib:.1f} MiB KV space ({tails / space.space_bytes:.0%}), where "
        f"{fmt.name or fmt.spec_string()!r} holds {space.tokens(fmt):,} tokens; these formats hold more: "
        f"{'; '.join(options)}; or give more space, or lower max_num_seqs"
    )


def _space(vllm_config: Any, fmt: KVFormat) -> VllmSpace | None:
    """One worker's KV space as :mod:`kvpack.sizing` counts it (the space ``kv_cache_memory_bytes`` gives, before
    the tails are taken out), or None when no space was given (vLLM then measures free memory)."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if model is None or not cache.kv_cache_memory_bytes:
        return None
    parallel = vllm_config.parallel_config
    act = torch.empty((), dtype=model.dtype).element_size()
    windows = _windows(getattr(model, "hf_text_config", None))
    layers, heads = model.get_num_layers(parallel), model.get_num_kv_heads(parallel)
    return VllmSpace(layers, heads, model.get_head_size(), act, cache.kv_cache_memory_bytes, tail_slots(vllm_config),
                     windows, spec_tokens(vllm_config))  # fmt: skip


def names_block(text: str) -> bool:
    """Whether a format string fixes its block size (``block=`` in any of its formats)."""
    return "block=" in text.replace(" ", "").lower()


def serve_block(vllm_config: Any, settings: Settings) -> Settings:
    """The settings to serve: ``settings`` with a smaller block where the full-precision tails crowd the KV space.

    Each running request keeps its open block in a full-precision tail paid from the space, so where the tails take
    much of it a smaller block (:func:`kvpack.sizing.vllm_smaller_block`: 32 or 16 tokens, taken when it holds at
    least 5% more tokens) serves more, its per-channel key scales covering fewer tokens. It is taken where the user
    left the block open: a format string with no ``block=``, no ``block_size`` given to vLLM, no
    per-layer plan and no static scales from a calibration artifact (checked against the format as named; query
    statistics and outlier channels hold for any block), and a space
    given (``kv_cache_memory_bytes``; vLLM's own measure of free memory comes after the block size is set). The
    served format is written back into ``additional_config``, so every vLLM process that parses it serves the same
    one, and logged as a warning with both capacities."""
    raw = _raw(vllm_config)
    text = raw if isinstance(raw, str) else raw["format"]
    fmt = settings.format
    cache = vllm_config.cache_config
    if (
        settings.plan.overrides
        or (settings.calibration is not None and fmt.is_static)
        or names_block(text)
        or getattr(cache, "user_specified_block_size", False)
    ):
        return settings
    space = _space(vllm_config, fmt)
    if space is None:
        return settings
    found = vllm_smaller_block(fmt, space)
    if found is None or found[1] <= 0:  # none holds more, or none holds a block (pay_tails names the space's shortfall)
        return settings
    served, tokens = found
    name = served.name or served.spec_string()
    entry = {"format": raw} if isinstance(raw, str) else dict(raw)
    vllm_config.additional_config[_KEY] = {**entry, "format": name}
    mib = 2**20
    tails = space.tail_bytes(fmt)
    logger.warning(
        "kvpack: the full-precision tails of %d requests take %.1f MiB of the %.1f MiB KV space (%.0f%%); serving "
        "%r with %d-token blocks as %r: %s tokens, where %d-token blocks hold %s (name block= in the format, or give "
        "vLLM a block_size, to keep a block size)",
        space.seqs, tails / mib, space.space_bytes / mib, 100 * tails / space.space_bytes, text, served.block_size,
        name, f"{tokens:,}", fmt.block_size, f"{space.tokens(fmt):,}",
    )  # fmt: skip
    return Settings(parse_plan(name), settings.kernel, settings.calibration)


def pay_tails(vllm_config: Any, fmt: KVFormat | LayerPlan) -> int:
    """Take the full-precision tails out of ``kv_cache_memory_bytes``, once per engine config (a mark on the cache
    config, which vLLM pickles to its other processes with the config, keeps a second call from paying again),
    so the space a user gives is the memory used. Returns the bytes taken by this call: 0 when no space was given
    (vLLM then measures free memory; the layers allocate their tails during vLLM's profiling run, which counts
    them) or when they were paid already.

    Raises:
        ConfigError: the tails of ``max_num_seqs`` requests do not fit in the space.
    """
    plan = parse_plan(fmt)
    fmt = plan.base  # every format of a plan has the base's block size, so its tails cost the same
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if model is None or not cache.kv_cache_memory_bytes or getattr(cache, _PAID, None) is not None:
        return 0
    parallel = vllm_config.parallel_config
    layers, heads = model.get_num_layers(parallel), model.get_num_kv_heads(parallel)
    seqs = tail_slots(vllm_config)
    tails = tail_pool_bytes(fmt, layers, heads, model.get_head_size(), model.dtype, seqs)
    if tails >= cache.kv_cache_memory_bytes:
        raise ConfigError(
            f"kvpack: {seqs} tail slots ({vllm_config.scheduler_config.max_num_seqs} running requests, twice that "
            f"with speculative decoding) need {tails / 2**20:.0f} MiB, more than the KV cache space of "
            f"{cache.kv_cache_memory_bytes / 2**20:.0f} MiB; lower max_num_seqs or raise the space"
        )
    space = None if plan.overrides else _space(vllm_config, fmt)
    if space is not None:
        advice = tail_advice(fmt, space)
        if advice:
            logger.warning(advice)
    cache.kv_cache_memory_bytes -= tails
    setattr(cache, _PAID, tails)
    logger.info(
        "kvpack: format %s; %.1f MiB of the KV space hold %d full-precision tail slots",
        plan.name if plan.overrides else (fmt.name or fmt.spec_string()),
        tails / 2**20,
        seqs,
    )
    return tails
