"""The compiled CPU kernels under numba's bounds checks: every index into an array inside them is checked.

numba compiles without bounds checks, so an index one past a scratch array (sized for the query heads of a kv
head's group where the loop ran over the group rounded up to 4, say) writes into the memory beside it and no
result shows it. Here a child process compiles the decode, chunk and seal kernels again with
``NUMBA_BOUNDSCHECK=1`` into its own numba cache folder (``.numba-boundscheck/`` in the repository, git-ignored:
the first run compiles for about 3 minutes, later runs load it) and runs them over formats and shapes that reach
their paths: groups of 1, 3, 4 and 6 query heads, one to three kv heads, head_dim 64, 128 and 256, blocks of 16,
32 and 64 tokens, tails, sink rows, outlier channels, a window, several sealed blocks in a run, draft positions
cut inside the tail, the integer and the float paths, pools strided as vLLM's pages are, seals of whole blocks
and of a vLLM step. An index out of bounds raises ``IndexError`` there; the child names each case that raised
one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

_CACHE = Path(__file__).resolve().parents[1] / ".numba-boundscheck"

_CHILD = r"""
import itertools
import sys
import numpy as np
import torch
from kvpack.formats import PRESETS, parse_format
from kvpack.kernels import chunk_attention, cpu_decode, cpu_seal, decode_attention, decode_positions
from kvpack.quant import quantize
from kvpack.testing import random_paged_kv

sys.path.insert(0, TESTS)
from test_kernel_cpu_strided import _strided  # vLLM's layout: pools strided along their blocks, tails too

torch.manual_seed(0)
torch.set_num_threads(2)
failed, cases = [], 0


def attempt(what, fn):
    global cases
    cases += 1
    try:
        fn()
    except IndexError as e:
        failed.append(f"{what}: {e}")


REFINED = "k=int4:channel:asym:o5r,v=int4:g32:asym"  # 4-bit refinement codes of five kept key channels
names = ["int8", "int4", "fp8", "k4v2", "kivi2", "int4-o4", "k8v4", REFINED]
formats = [(name, sink) for name in names for sink in (0, 1)]
for (name, sink), (h, group), lens in itertools.product(
    formats + [("fp16", 0)], [(1, 1), (1, 3), (3, 3), (3, 6), (2, 4)], [[1, 63, 100], [300, 64, 129]]
):
    fmt = parse_format(name).with_block_size(32).with_sink(sink)
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=h, head_dim=64, seed=h * group, sink=sink)
    strided, _ = _strided(kv)
    hq, b = h * group, len(lens)
    cut = torch.tensor([[min(2, n % 32, n - 1), 0] for n in lens], dtype=torch.int32)
    for int_dot in (True, False):  # the integer path where the layout allows it, and the float path
        cpu_decode.INT_DOT = int_dot
        what = f"{name} sink={sink} kv_heads={h} group={group} lens={lens} int_dot={int_dot}"
        attempt(f"decode {what}", lambda: decode_attention(torch.randn(b, hq, 64), kv, backend="cpu"))
        attempt(f"decode strided {what}", lambda: decode_attention(torch.randn(b, hq, 64), strided, backend="cpu"))
        attempt(f"decode window {what}", lambda: decode_attention(torch.randn(b, hq, 64), kv, window=40, backend="cpu"))
        attempt(f"positions {what}", lambda: decode_positions(torch.randn(b, 2, hq, 64), kv, cut))
    t = min(lens)
    attempt(f"chunk {what}", lambda: chunk_attention(torch.randn(b, t, hq, 64), kv, backend="cpu"))
    attempt(f"chunk strided {what}", lambda: chunk_attention(torch.randn(b, t, hq, 64), strided, backend="cpu"))


for name, d, block in itertools.product(["int8", "int4", "fp8", "kivi2", "int4-o4", REFINED], [128, 256], [16, 64]):
    fmt = parse_format(name).with_block_size(block).with_sink(1)
    lens = [1, block - 1, 3 * block + 5]
    kv, _, _ = random_paged_kv(fmt, lens, kv_heads=2, head_dim=d, seed=d + block, sink=1)
    what = f"{name} head_dim={d} block={block}"
    for int_dot in (True, False):
        cpu_decode.INT_DOT = int_dot
        attempt(f"decode {what} int_dot={int_dot}", lambda: decode_attention(torch.randn(3, 6, d), kv, backend="cpu"))
    attempt(f"chunk {what}", lambda: chunk_attention(torch.randn(3, 1, 6, d), kv, backend="cpu"))


def page_rows(spec):  # 8 pages' (data, scale, zero) byte rows of [3 kv heads, 64, 64] blocks (zero None: symmetric)
    parts = quantize(torch.randn(1, 3, 64, 64), spec)
    widths = [p.contiguous().view(torch.uint8).reshape(1, -1).shape[1]
              for p in [parts.data, parts.scale] + ([parts.zero] if spec.has_zero else [])]
    return tuple([torch.zeros(8, w, dtype=torch.uint8) for w in widths] + [None] * (3 - len(widths)))


for name in ["int8", "int4", "k4v2", "kivi2"]:
    fmt = PRESETS[name]
    pages = tuple(page_rows(spec) for spec in (fmt.key, fmt.value))
    for spec, rows in zip((fmt.key, fmt.value), pages):
        x = torch.randn(3, 3, 64, 64)
        attempt(f"seal {name} {spec}", lambda: cpu_seal.seal_blocks(x, spec, np.array([5, 1, 7]), *rows))
    # a vLLM step: two blocks filled from tails and the step's rows, the others' rows written to their tails
    tails = (torch.randn(4, 3, 64, 64), torch.randn(4, 3, 64, 64))
    new = (torch.randn(70, 3, 64), torch.randn(70, 3, 64))
    step = (np.array([3, -1]), np.array([60, 0]), np.array([0, 4]), np.array([2, 6]))
    attempt(f"seal step {name}", lambda: cpu_seal.seal_step(tails, new, *step, (fmt.key, fmt.value), pages))
    rows = (np.array([68, 69]), np.array([0, 1]), np.array([5, 63]))
    attempt(f"tail rows {name}", lambda: cpu_seal.write_rows(tails, new, *rows))
    writes = cpu_seal.StepWrites(tails, pages, (fmt.key, fmt.value))
    attempt(f"step writes {name}", lambda: writes(cpu_seal.row_arrays(*new), *step, *rows))
# kept key channels refined to 8 bits: their codes and indices written after the seal (by range, by the queries)
for name in ["k=int4:channel:asym:o5r,v=int4", "k=int8:channel:o4qr,v=int4"]:
    spec = parse_format(name).key
    rows = page_rows(spec)
    out = (torch.zeros(8, 3 * 64 * ((spec.outliers + 1) // 2), dtype=torch.uint8),
           torch.zeros(8, 3 * spec.outliers, dtype=torch.uint8))
    x, energy = torch.randn(3, 3, 64, 64), torch.rand(3, 64)

    def seal_refined():
        cpu_seal.seal_blocks(x, spec, np.array([5, 1, 7]), *rows)
        cpu_seal.refine_blocks(x, spec, np.array([5, 1, 7]), rows, out, energy if spec.query_ranked else None)

    attempt(f"refine {name}", seal_refined)
print(f"cases {cases}")
for line in failed:
    print(f"FAILED {line}")
"""


def test_cpu_kernels_index_inside_their_arrays() -> None:
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(_CACHE)}
    child = f"TESTS = {str(Path(__file__).parent)!r}\n" + _CHILD
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    failed = [line for line in res.stdout.splitlines() if line.startswith("FAILED")]
    assert not failed, "\n".join(failed[:20])
    cases = int(res.stdout.split("cases ")[1].split()[0])
    # (format, sink) x (kv heads, group) x lengths x calls; formats x head_dims x blocks x calls; seals; refinements
    assert cases == 17 * 5 * 2 * (2 * 4 + 2) + 6 * 2 * 2 * 3 + 4 * 5 + 2
