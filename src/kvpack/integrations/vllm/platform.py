"""vLLM's CPU platform with the kvpack backend selectable.

vLLM's ``CpuPlatform`` returns its own attention backend whatever was asked for, so on the CPU the plugin
replaces the platform with this subclass. Without a kvpack format in the engine's config it behaves exactly as
``CpuPlatform``; with one it checks the configuration (refusing what the backend cannot serve, before any weight
is loaded), counts the tails in the KV budget and returns the kvpack backend.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from kvpack.errors import ConfigError
from kvpack.integrations.vllm import BACKEND_PATH
from kvpack.integrations.vllm.config import settings_from, startup_reasons, tail_pool_bytes

__all__ = ["KVPackCpuPlatform"]

logger = init_logger(__name__)


def _selected() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and settings_from(cfg) is not None


class KVPackCpuPlatform(CpuPlatform):
    """``CpuPlatform``, plus the kvpack backend when ``additional_config["kvpack"]`` names a format."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        settings = settings_from(vllm_config)  # a bad format stops here, with the list of presets
        super().check_and_update_config(vllm_config)
        if settings is None:
            return
        if not vllm_config.cache_config.user_specified_block_size:  # vLLM's page is the format's block
            vllm_config.cache_config.block_size = settings.format.block_size
        from kvpack.integrations.vllm import hooks

        reasons = startup_reasons(vllm_config, settings.format)
        if not hooks.install():
            reasons.append("this vLLM has no GPUModelRunner._update_states to learn about finished requests from")
        if reasons:
            raise ConfigError("kvpack cannot serve this engine: " + "; ".join(reasons))
        cache, model = vllm_config.cache_config, vllm_config.model_config
        parallel = vllm_config.parallel_config
        if model is not None and cache.kv_cache_memory_bytes:
            layers = model.get_num_layers(parallel)
            heads = model.get_num_kv_heads(parallel)
            seqs = vllm_config.scheduler_config.max_num_seqs
            tails = tail_pool_bytes(settings.format, layers, heads, model.get_head_size(), model.dtype, seqs)
            if tails >= cache.kv_cache_memory_bytes:
                raise ConfigError(
                    f"kvpack: the tails of {seqs} running requests need {tails / 2**20:.0f} MiB, more than the KV "
                    f"cache space of {cache.kv_cache_memory_bytes / 2**20:.0f} MiB; lower max_num_seqs or raise the space"
                )
            cache.kv_cache_memory_bytes -= tails
            logger.info(
                "kvpack: format %s; %.1f MiB of the KV space hold the full-precision tails of %d requests",
                settings.format.name or settings.format.spec_string(),
                tails / 2**20,
                seqs,
            )

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if _selected():
            return BACKEND_PATH
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
