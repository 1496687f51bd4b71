"""The model-runner hooks: tails of finished and preempted requests released, and per-layer pages for a plan.

vLLM tells an attention backend nothing when a request ends; the model runner learns it from the scheduler's
output (``finished_req_ids``, ``preempted_req_ids``) in ``_update_states``, while it still holds each request's
block ids. This wraps that method (once per process, idempotent) so every live :class:`TailTable` releases the
tails of those blocks before the step is planned.

vLLM asks a backend for its page (``customize_spec``) without saying which layer it is for, so a per-layer plan
(:mod:`kvpack.plans`) cannot size its pages there. The second hook wraps the runner's ``get_kv_cache_spec``: each
kvpack layer's page is then the one its own format needs (:func:`layer_specs`). Layers with different pages
but the same block size form one vLLM group (``UniformTypeKVCacheSpecs``): one block table, one block id naming
a page in every layer, and vLLM's block count is the space over the sum of the layers' pages, so its capacity
is the plan's real one. Both hooks are installed by the general plugin, in every vLLM process.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from kvpack.integrations.vllm.tails import TailTable

__all__ = [
    "install",
    "layer_specs",
    "live_tables",
    "register_table",
    "release_request",
    "request_last_blocks",
    "worker_reopened",
    "worker_tails",
]

_tables: weakref.WeakSet[TailTable] = weakref.WeakSet()


def register_table(table: TailTable) -> None:
    """Have the hook release tails in ``table`` too."""
    _tables.add(table)


def live_tables() -> list[TailTable]:
    """The tail tables of this process's engines (for tests and reports)."""
    return list(_tables)


def worker_tails(worker: Any) -> int | None:
    """Tails allocated in this process's tail tables, None when it has none (no kvpack layer was built here).
    For ``LLM.collective_rpc``, which runs it in every worker (``worker``: vLLM's worker object, unused)."""
    tables = live_tables()
    return sum(t.num_allocated for t in tables) if tables else None


def worker_reopened(worker: Any) -> int | None:
    """Reserves written into again in this process's tail tables (speculative decoding: drafts rejected inside a
    block they sealed), None when it has no table. For ``LLM.collective_rpc``, as :func:`worker_tails`."""
    tables = live_tables()
    return sum(t.reopened for t in tables) if tables else None


def _release_finished(runner, scheduler_output) -> None:
    tables = live_tables()
    if not tables:
        return
    ended = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    for req_id in ended:
        state = runner.requests.get(req_id)
        if state is None:
            continue
        for table in tables:
            release_request(table, state.block_ids)


def release_request(table: TailTable, block_ids: tuple[list[int], ...]) -> int:
    """Release what a request that ended holds in ``table``: the tail of its last block in each KV cache group's
    list ``block_ids`` (:func:`request_last_blocks`) and a reserve of the block before it (speculative decoding,
    :class:`~kvpack.integrations.vllm.tails.TailTable`). Returns how many were released."""
    before = [int(ids[-2]) for ids in block_ids if len(ids) >= 2]
    return table.release_blocks(request_last_blocks(block_ids)) + table.release_blocks(before, reserves_only=True)


def request_last_blocks(block_ids: tuple[list[int], ...]) -> list[int]:
    """The last block id of each KV cache group's list ``block_ids`` (the runner's, for a request that ended): the
    only block that can hold the request's tail.

    Every earlier block is full, so sealed, and need not be this request's any more: a sliding-window group's blocks
    that left the window go back to vLLM's free pool while the runner's list still names them, and may by now be
    another request's open block, whose tail must stay. The last block holds the request's latest token, inside
    any window, so vLLM has not handed it on. With speculative decoding the block before it may hold a reserve
    (:class:`~kvpack.integrations.vllm.tails.TailTable`), which the hook releases too, and only a reserve: a reserve
    is the request's own, where a tail there could be another request's.
    """
    return [int(ids[-1]) for ids in block_ids if len(ids)]


def layer_specs(specs: dict[str, Any], settings: Any, is_kvpack: Callable[[str], bool]) -> dict[str, Any]:
    """vLLM's per-layer KV cache specs with each kvpack layer's page sized for its own format
    (:meth:`~kvpack.integrations.vllm.config.Settings.format_of`).

    Args:
        specs: layer name -> vLLM ``AttentionSpec`` (as ``customize_spec`` left it: the base format's page).
        settings: the engine's :class:`~kvpack.integrations.vllm.config.Settings`.
        is_kvpack: whether a layer runs the kvpack backend (others are left as they are).

    Returns ``specs`` itself when the plan has no overrides.

    Raises:
        ConfigError: a kvpack layer's name holds no single layer number.
    """
    from kvpack.integrations.vllm.layout import PageLayout

    if not settings.plan.overrides:
        return specs
    out = dict(specs)
    for name, spec in specs.items():
        if is_kvpack(name):
            layout = PageLayout.build(settings.format_of(name), spec.num_kv_heads, spec.head_size, spec.dtype)
            out[name] = dataclasses.replace(spec, num_head_slots=1, state_content_bytes=layout.cell_bytes)
    return out


def _kvpack_layers(runner) -> Callable[[str], bool]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    from kvpack.integrations.vllm.backend import KVPackAttentionBackend

    layers = get_layers_from_vllm_config(runner.vllm_config, AttentionLayerBase)

    def is_kvpack(name: str) -> bool:
        layer = layers.get(name)
        return layer is not None and issubclass(layer.get_attn_backend(), KVPackAttentionBackend)

    return is_kvpack


def install() -> bool:
    """Wrap ``GPUModelRunner._update_states`` and ``get_kv_cache_spec`` (the CPU runner inherits both). Returns
    False when this vLLM lacks either (the backend then refuses to start: tails would leak, or a plan's pages
    would be the base format's)."""
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    orig = getattr(cls, "_update_states", None)
    orig_spec = getattr(cls, "get_kv_cache_spec", None)
    if orig is None or orig_spec is None:
        return False
    if not getattr(orig, "_kvpack_hook", False):

        def _update_states(self, scheduler_output):
            _release_finished(self, scheduler_output)
            return orig(self, scheduler_output)

        _update_states._kvpack_hook = True  # type: ignore[attr-defined]
        _update_states.__wrapped__ = orig  # type: ignore[attr-defined]
        cls._update_states = _update_states
    if not getattr(orig_spec, "_kvpack_hook", False):

        def get_kv_cache_spec(self):
            from kvpack.integrations.vllm.config import settings_from

            specs = orig_spec(self)
            settings = settings_from(self.vllm_config)
            return specs if settings is None else layer_specs(specs, settings, _kvpack_layers(self))

        get_kv_cache_spec._kvpack_hook = True  # type: ignore[attr-defined]
        get_kv_cache_spec.__wrapped__ = orig_spec  # type: ignore[attr-defined]
        cls.get_kv_cache_spec = get_kv_cache_spec
    return True
