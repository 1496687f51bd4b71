"""The kvpack attention backend for vLLM: the backend class, its metadata builder, and the per-layer impl.

Each step the builder plans, once for all layers, which tokens go to tails, which blocks seal and where the sink
rows go (:meth:`TailTable.plan`); each layer's impl hands that plan and its K/V to a
:class:`~kvpack.integrations.vllm.layer.PagedLayer`, which writes and attends (see there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpack.errors import ConfigError, UnsupportedError
from kvpack.integrations.vllm.calibration import layer_calibration, worker_heads
from kvpack.integrations.vllm.config import (
    Settings,
    engine_reasons,
    layer_index,
    pay_tails,
    settings_from,
    spec_tokens,
    tail_slots,
)
from kvpack.integrations.vllm.hooks import register_table
from kvpack.integrations.vllm.layer import PagedLayer, StepTensors
from kvpack.integrations.vllm.layout import PageLayout
from kvpack.integrations.vllm.tails import StepPlan, TailTable

__all__ = ["KVPackAttentionBackend", "KVPackAttentionImpl", "KVPackMetadata", "KVPackMetadataBuilder"]

_settings: Settings | None = None


def current_settings() -> Settings:
    """The engine's kvpack settings (read from the vLLM config in force, then kept for this process)."""
    global _settings
    cfg = get_current_vllm_config_or_none()
    found = settings_from(cfg) if cfg is not None else None
    if found is not None:
        _settings = found
    if _settings is None:
        raise ConfigError(
            'kvpack: the kvpack attention backend was selected but no format was given; pass additional_config={"kvpack": '
            '{"format": "int4"}}'
        )
    return _settings


class KVPackAttentionBackend(AttentionBackend):
    """kvpack blocks in vLLM pages (see :mod:`kvpack.integrations.vllm.layout`)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[KVPackAttentionImpl]:
        return KVPackAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVPackMetadataBuilder]:
        return KVPackMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [current_settings().format.block_size]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # the kernels take the window and never read a block out of it (stale ids, the null block)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # connectors move pages whose layout kvpack owns

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        """vLLM's reasons this backend cannot serve the layer, then the engine's kvpack checks
        (:func:`~kvpack.integrations.vllm.config.engine_reasons`) and, when none applies, the tails paid from
        ``kv_cache_memory_bytes`` (:func:`~kvpack.integrations.vllm.config.pay_tails`, once per config).

        vLLM's CUDA platform calls this for the selected backend (``--attention-backend CUSTOM``) in each worker
        while the model's attention layers are built, with the engine's config current: before the weights load
        and before the worker measures the KV space, the last point the tails can still be paid from it. On the
        CPU the kvpack platform has run the same checks in the config step (vLLM's CPU platform calls no
        backend's ``validate_configuration``).
        """
        reasons = list(super().validate_configuration(*args, **kwargs))
        cfg = get_current_vllm_config_or_none()
        try:
            settings = settings_from(cfg) if cfg is not None else None
        except ConfigError as e:
            return [*reasons, str(e)]
        if settings is None:
            return [*reasons, 'kvpack: no format given; pass additional_config={"kvpack": {"format": "int4"}}']
        reasons += engine_reasons(cfg, settings.plan, settings.calibration)
        if not reasons:
            try:
                pay_tails(cfg, settings.format)
            except ConfigError as e:
                reasons.append(str(e))
        return reasons

    @classmethod
    def customize_spec(cls, spec):
        """One head slot of ``block_size`` cells of ``C`` bytes: the page holds one packed kvpack block (of the base
        format; with a per-layer plan, :func:`~kvpack.integrations.vllm.hooks.layer_specs` resizes each layer's)."""
        layout = PageLayout.build(current_settings().format, spec.num_kv_heads, spec.head_size, spec.dtype)
        # block_size 1: vLLM asks a token's bytes (a sliding-window layer picks its block size from them); a
        # page is block_size cells of C bytes, so that is one cell
        if spec.block_size not in (1, layout.block_size):
            raise ConfigError(
                f"kvpack: vLLM's block_size is {spec.block_size} but the format seals blocks of {layout.block_size}; "
                f"pass block_size={layout.block_size}"
            )
        return dataclasses.replace(spec, num_head_slots=1, state_content_bytes=layout.cell_bytes)


@dataclass
class KVPackMetadata(AttentionMetadata):
    """One step's attention metadata, shared by every layer: the plan (:class:`StepPlan`), its tensors
    (:class:`StepTensors`), ``num_actual_tokens`` (the query tensors may be padded past it) and the tail table."""

    plan: StepPlan
    tensors: StepTensors
    num_actual_tokens: int
    table: TailTable


class KVPackMetadataBuilder(AttentionMetadataBuilder[KVPackMetadata]):
    """Plans each step's tail writes and seals once, for every layer of the group."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        fmt = current_settings().format
        blocks = vllm_config.cache_config.num_gpu_blocks or 1
        seqs = vllm_config.scheduler_config.max_num_seqs
        self.table = TailTable(blocks, seqs, fmt.block_size, fmt.sink, spec_tokens=spec_tokens(vllm_config))
        register_table(self.table)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        cam = common_attn_metadata
        r = cam.num_reqs
        qs = cam.query_start_loc_cpu[: r + 1].numpy().astype(np.int64)
        sl = cam.seq_lens[:r].cpu().numpy().astype(np.int64)
        table = cam.block_table_tensor[:r]
        tbl = table.cpu().numpy()
        self.table.ensure_blocks(int(tbl.max()) + 1 if tbl.size else 0)
        plan = self.table.plan(qs, sl, tbl)
        return KVPackMetadata(plan, StepTensors.from_plan(plan, table, self.table.block_size), int(qs[-1]), self.table)


def _worker_heads(kv_heads: int) -> tuple[int, int] | None:
    """The model's kv heads ``[h0, h1)`` this tensor-parallel worker holds (None: one worker holds them all)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except AssertionError:  # no parallel group (a layer built outside an engine)
        return None
    if world == 1:
        return None
    cfg = get_current_vllm_config_or_none()
    model = None if cfg is None else cfg.model_config
    total = kv_heads * world if model is None else model.get_total_num_kv_heads()
    return worker_heads(rank, world, total)


# vLLM's extra attention arguments (beyond the impl's named ones), as a refusal names them
_EXTRA_NAMES = {"sinks": "learned attention sinks (gpt-oss)"}


class KVPackAttentionImpl(AttentionImpl[KVPackMetadata]):
    """One layer: hands its K/V and queries to a :class:`PagedLayer`."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        # whatever else a model asks of the attention (gpt-oss's learned sinks: ``sinks``) changes the scores: refused,
        # never ignored
        asked = sorted(k for k, v in extra.items() if v is not None and v is not False)
        refused = {
            **{_EXTRA_NAMES.get(k, f"the attention option {k!r}"): True for k in asked},
            "ALiBi slopes": alibi_slopes is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise UnsupportedError(f"kvpack: the vLLM backend does not serve layers with {', '.join(bad)}", bad)
        self.settings = current_settings()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = sliding_window  # passed to the kernels, which read only the blocks inside it
        self._layer: PagedLayer | None = None

    def _ensure_layer(self, capacity: int, slots: int, query: torch.Tensor, name: str | None) -> None:
        """This layer's :class:`PagedLayer` (its ``slots`` tails) for ``capacity`` requests, in the query's dtype
        and device; ``name``: the vLLM layer's name, whose number picks the layer's format in a per-layer plan."""
        lay = self._layer
        # checked without building a torch.device per call on the CPU (a few us each there, the caches cold)
        same = (
            lay is not None
            and lay.capacity == capacity
            and lay.slots == slots
            and lay.dtype is query.dtype
            and (query.is_cpu if lay.device.type == "cpu" else lay.device == query.device)
        )
        if not same:
            fmt = self.settings.format_of(name)
            h, d = self.num_kv_heads, self.head_size
            cal = layer_calibration(
                self.settings.calibration, fmt, layer_index(name), h, d, query.device, heads=_worker_heads(h)
            )
            self._layer = PagedLayer(
                fmt, h, d, capacity, query.dtype, query.device, calibration=cal, window=self.sliding_window, slots=slots
            )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVPackMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, H, D]`` (the first ``num_actual_tokens`` real), output
        ``[T, Hq, D]``; kv_cache: this layer's pages ``[num_blocks, 1, B, C]``."""
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("kvpack: fused output quantization is not supported", ["output quantization"])
        md = attn_metadata
        if md is None:  # the profiling run: nothing to attend
            cfg = get_current_vllm_config_or_none()
            if cfg is not None:  # the tails now, so that a profiler of free memory counts them (CUDA)
                seqs = cfg.scheduler_config.max_num_seqs
                self._ensure_layer(seqs, tail_slots(cfg), query, getattr(layer, "layer_name", None))
            return output
        self._ensure_layer(md.table.capacity, md.table.slots, query, getattr(layer, "layer_name", None))
        n = md.num_actual_tokens
        assert self._layer is not None
        out = output.view(-1, self.num_heads, self.head_size)
        if query.shape[0] != n:  # padding rows past the real tokens (the CPU runner adds none: no slices, each a
            query, key, value, out = query[:n], key[:n], value[:n], out[:n]  # torch call of ~10 us, the caches cold)
        self._layer.write(kv_cache, md.plan, key, value)
        self._layer.attend(kv_cache, md.plan, md.tensors, query, out, self.scale, self.settings.kernel)
        return output
