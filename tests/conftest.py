"""Test set-up. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here first."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# The test files that take longest (minutes of vLLM engines), longest first. pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, what `make test` runs; without the flag it re-sorts files by their number of tests) hands
# files to its workers in collection order, each a file when it is nearly done with the last; collected by name,
# these would all come last and leave one worker running them while the other idles. Sorted to the front, the short
# files fill in around them.
LONG_FILES = (
    "test_vllm_sliding.py", "test_kernel_cpu.py", "test_vllm_serve.py", "test_vllm_engine.py", "test_vllm_parallel.py",
    "test_kernel_cpu_strided.py", "test_vllm_families.py", "test_kernel_cpu_core.py", "test_format_families.py",
    "test_vllm_engine_lifecycle.py", "test_hf_embedded.py", "test_kernel_triton.py", "test_kernel_cpu_chunk.py",
)  # fmt: skip


def pytest_collection_modifyitems(session, config, items):
    """Long files first (:data:`LONG_FILES`), the rest in their usual order; the order inside a file is kept."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
