"""Test set-up. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here first."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# The test files that take longest (minutes of vLLM engines, the bounds-checked kernels' compile), longest first,
# as measured with the CPU kernels compiled beforehand (what `make test` does). pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, what `make test` runs; without the flag it re-sorts files by their number of tests) hands
# files to its workers in collection order, a worker getting the next file as it nears the end of its last;
# collected by name, these would all come last and leave one worker running them while the other idles. Sorted to
# the front, the short files fill in around them.
LONG_FILES = (
    "test_vllm_engine.py", "test_vllm_sliding.py", "test_vllm_parallel.py", "test_vllm_families.py",
    "test_kernel_cpu_bounds.py", "test_format_families.py", "test_vllm_engine_lifecycle.py", "test_kernel_triton.py",
    "test_hf_embedded.py", "test_vllm_serve.py", "test_kernel_cpu.py", "test_kernel_triton_chunk.py",
    "test_vllm_layer.py", "test_kernel_cpu_chunk.py",
)  # fmt: skip


def pytest_collection_modifyitems(session, config, items):
    """Long files first (:data:`LONG_FILES`), the rest in their usual order; the order inside a file is kept."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def tiny():
    """The small random model of :mod:`kvpack.evaluation.tiny` (512 positions), run on one thread (logits compared
    across engines must not depend on how a reduction splits), its attention put back to sdpa afterwards."""
    from kvpack.evaluation.tiny import tiny_model

    model, tok = tiny_model(seed=0, max_positions=512)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tok
    torch.set_num_threads(n)
    model.set_attn_implementation("sdpa")
