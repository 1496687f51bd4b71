"""vLLM's CPU platform with the kvpack backend selectable.

vLLM's ``CpuPlatform`` returns its own attention backend whatever was asked for (it never calls a backend's
``validate_configuration``), so on the CPU the plugin replaces the platform with this subclass. Without a kvpack
format in the engine's config it behaves exactly as ``CpuPlatform``; with one, its config step sets the page to the
format's block and runs the checks of :mod:`kvpack.integrations.vllm.config` (refusing what the backend cannot
serve, before any weight is loaded) and pays the tails from the KV space; then it returns the kvpack backend.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

from kvpack.errors import ConfigError
from kvpack.integrations.vllm import BACKEND_PATH
from kvpack.integrations.vllm.config import engine_reasons, pay_tails, serve_block, settings_from

__all__ = ["KVPackCpuPlatform"]


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
        settings = serve_block(vllm_config, settings)  # a smaller block where the tails crowd the space
        # vLLM's page is the format's block (CpuPlatform.update_block_size_for_backend leaves a model without
        # mamba layers at vLLM's default, where other platforms ask the backend)
        if not vllm_config.cache_config.user_specified_block_size:
            vllm_config.cache_config.block_size = settings.format.block_size
        reasons = engine_reasons(vllm_config, settings.plan, settings.calibration)
        if reasons:
            raise ConfigError("kvpack cannot serve this engine: " + "; ".join(reasons))
        pay_tails(vllm_config, settings.format)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if _selected():
            return BACKEND_PATH
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
