"""kvpack formats inside vLLM: an out-of-tree attention backend (entry points, no fork).

Two entry points (``pyproject.toml``):

* ``vllm.general_plugins`` -> :func:`register`: registers the backend as ``CUSTOM`` and installs the hook that
  releases tails of finished requests (runs in every vLLM process; idempotent).
* ``vllm.platform_plugins`` -> :func:`platform_plugin`: on a CPU build of vLLM, a ``CpuPlatform`` that can return
  the kvpack backend (vLLM's own returns its CPU backend whatever is selected).

A user picks a format with ``additional_config={"kvpack": {"format": "int4"}}``. Nothing in this package is
imported by ``import kvpack``.
"""

from __future__ import annotations

__all__ = ["BACKEND_PATH", "platform_plugin", "register"]

BACKEND_PATH = "kvpack.integrations.vllm.backend.KVPackAttentionBackend"
PLATFORM_PATH = "kvpack.integrations.vllm.platform.KVPackCpuPlatform"


def register() -> None:
    """General plugin: register the backend under ``AttentionBackendEnum.CUSTOM`` and install the tail hook."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvpack.integrations.vllm import hooks

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    hooks.install()


def platform_plugin() -> str | None:
    """Platform plugin: the kvpack CPU platform on a CPU build of vLLM, else None (vLLM picks its own)."""
    from vllm.platforms import cpu_platform_plugin

    return PLATFORM_PATH if cpu_platform_plugin() is not None else None
