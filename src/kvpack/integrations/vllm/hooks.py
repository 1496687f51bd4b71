"""The model-runner hook that releases tails of finished and preempted requests.

vLLM tells an attention backend nothing when a request ends; the model runner learns it from the scheduler's
output (``finished_req_ids``, ``preempted_req_ids``) in ``_update_states``, while it still holds each request's
block ids. This wraps that method (once per process, idempotent) so every live :class:`TailTable` releases the
tails of those blocks before the step is planned. Installed by the general plugin, in every vLLM process.
"""

from __future__ import annotations

import itertools
import weakref

from kvpack.integrations.vllm.tails import TailTable

__all__ = ["install", "live_tables", "register_table"]

_tables: weakref.WeakSet[TailTable] = weakref.WeakSet()


def register_table(table: TailTable) -> None:
    """Have the hook release tails in ``table`` too."""
    _tables.add(table)


def live_tables() -> list[TailTable]:
    """The tail tables of this process's engines (for tests and reports)."""
    return list(_tables)


def _release_finished(runner, scheduler_output) -> None:
    tables = live_tables()
    if not tables:
        return
    ended = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    for req_id in ended:
        state = runner.requests.get(req_id)
        if state is None:
            continue
        blocks = list(itertools.chain.from_iterable(state.block_ids))
        for table in tables:
            table.release_blocks(blocks)


def install() -> bool:
    """Wrap ``GPUModelRunner._update_states`` (the CPU runner inherits it). Returns False when this vLLM has no
    such method (the backend then refuses to start: tails would leak)."""
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    orig = getattr(cls, "_update_states", None)
    if orig is None:
        return False
    if getattr(orig, "_kvpack_hook", False):
        return True

    def _update_states(self, scheduler_output):
        _release_finished(self, scheduler_output)
        return orig(self, scheduler_output)

    _update_states._kvpack_hook = True  # type: ignore[attr-defined]
    _update_states.__wrapped__ = orig  # type: ignore[attr-defined]
    cls._update_states = _update_states
    return True
