"""The fused CPU decode backend: checks shapes, turns a :class:`PagedKV` into numba arguments, launches.

The compiled loops live in :mod:`kvpack.kernels.cpu_decode_numba` (imported on first use, so ``import kvpack``
never pulls in numba). The kernel reads the packed payload and the stored scales straight from the pools;
nothing dequantized is ever written to memory. Every format the presets use is covered: int8 (sym and
asym), fp8 e4m3/e5m2, int4 and int2 (offset binary or unsigned + zero), passthrough fp16/bf16/fp32, any
scale dtype (fp32, fp16, bf16, E8M0) and any granularity, and outlier key channels (``kv.k_outlier``).
int8/int4/int2 codes are multiplied as integers on x86 CPUs with AVX2 or AVX-512 BW, fp8 codes too with
AVX-512 BW (:func:`int_dot_enabled`; ``KVPACK_CPU_INT_DOT=0`` or :data:`INT_DOT` turns it off), the float32
path serves everything else.

Pools may be strided along the block axis (each pool a view into one page per block, as vLLM lays out its
KV cache): every pool (``k_data``, ``k_scale``, ``k_zero`` and the same for values) must be contiguous within
a block, and its ``stride(0)``, at least the block's own element count, becomes the spec's block stride
(``cpu_decode_numba.P_BST``, ``P_SBST``, ``P_ZBST``, and for the outlier pools ``k_outlier``, ``k_outlier_idx``
``P_OBST``, ``P_IBST``); the kernel reads such pools in place, without copying. The tails may be strided along the
batch axis the same way.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from kvpack.errors import ShapeError
from kvpack.formats import DType, QuantSpec
from kvpack.kernels import cpu_decode_ir as _ir
from kvpack.kernels.lowering import FloatKind, PayloadKind, lower
from kvpack.kernels.views import ROLES, PagedKV, Role, refuse_rotated

__all__ = [
    "MIN_CHUNK_TOKENS",
    "blocks_per_run",
    "decode_attention",
    "int_dot_enabled",
    "int_dot_isa",
    "reasons_unsupported",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
# Shortest stretch of history one work item handles: below this, splitting costs more than it saves.
MIN_CHUNK_TOKENS = 512
# Work items per thread (long sequences are cut into chunks to reach it): each thread walks its own run of
# them in order and idle threads take from the others (see run_items), so the threads finish within
# about one item of each other.
_ITEMS_PER_THREAD = 32
# Below this many blocks of work a call stays on the calling thread (a hand-off costs ~20 us).
_SERIAL_BLOCKS = 64
# How many blocks ahead the loops prefetch rows and scales into L2 (a spec's P_FAR; the next block also goes
# to L1). Measured in one process, alternating settings call by call (int8, 32k, batch 4, 2 threads):
# 0 took 1.19-1.23x as long as 2, 1 took 1.05-1.09x, 3 and 4 0.99-1.05x.
FAR_BLOCKS = 2
# Tokens attended per softmax step on the integer path: runs of this many tokens' blocks (a key spec's P_MULTI,
# at least 1) share one max, one pass of exponentials and one rescale (cpu_decode_numba._attend_multi); 0 turns it
# off. int8, 32k, batch 4, 2 threads, quiet memory (benchmarks/cpu_spec_ab.py): one block at a time took
# 1.09-1.14x as long as 512 tokens, 512 tokens 1.03x as long as 1024, 2048 0.98x (not taken: twice the scratch).
MULTI_TOKENS = 1024
# Integer dot products (see cpu_decode_ir._kdot_ir): None = where int_dot_isa() names an instruction set, unless the
# environment variable KVPACK_CPU_INT_DOT is "0" when a view is first used (reading os.environ costs ~10 us with
# the caches cold, as in a serving engine); True / False force it, for views old and new (tests cover both paths).
INT_DOT: bool | None = None
_I32_MAX = 2**31 - 1
# The integer path only where its int16 operands keep at least 11 bits (see _int_dot_limit).
_MIN_INT_LIMIT = 2047
# Per block, the integer path only where its operands keep the format's accuracy (see _int_dot_guards): the int16
# query (keys) or weights (values) of the typical element within SPREAD_SLACK binary orders more than what the
# codes' own precision asks of the block's largest, and fp8 blocks whose largest code is at least FP8_MIN_WORD
# words of the table (out of 2047). Else the block takes the float path. Measured (tests/test_kernel_cpu_ranges.py):
# keys keep the reference's accuracy with one order of slack; values not (k8v4 with one value of 1e4: 1.6x the
# reference's error at slack 1, as accurate at 0).
SPREAD_SLACK = {"key": 1, "value": 0}
FP8_MIN_WORD = 64


@lru_cache(maxsize=1)
def _nb() -> Any:
    passive_pool()
    from kvpack.kernels import cpu_decode_numba

    return cpu_decode_numba


_POOL: list[bool] = []


def passive_pool() -> None:
    """Start numba's thread pool with OpenMP's passive wait policy, unless ``OMP_WAIT_POLICY`` is set: its
    workers then sleep when a kernel returns instead of spinning, which took the cores from torch's own OpenMP
    pool between kernel calls (a 2k-token prefill of the embedded model through the chunk kernel, 2-core VM
    loaded by other work: 1.1-1.6x DynamicCache's time spinning, 1.07-1.18x passive; on the quiet VM the two
    are within noise, 1.08-1.14x). Only numba's pool reads the
    setting here: torch's OpenMP runtime read its environment when torch was loaded. Runs once.

    The launch would also change two settings of torch's OpenMP runtime, which numba's ``omp`` layer shares (it
    resolves its OpenMP calls in the process's global symbols, where torch put its own runtime): both are put back.

    - The thread count: numba sets it to ``NUMBA_NUM_THREADS`` (all cores), which torch then reads once it has run
      a parallel region (``torch.set_num_threads(1)``, a model forward, the first kernel call: 2 threads on the
      2-core VM, so ``kvpack bench generate --threads 1`` ran every row after the first kvpack one on two). Put
      back with torch's own setter (vLLM's CPU worker disables ``torch.set_num_threads``).
    - Nested parallelism: numba turns it on (``omp_set_nested(1)``), and torch's parallel loops then open a team in
      each thread wherever they call another parallel operation, more threads than cores: a causal SDPA over 2k
      tokens took 6x as long on 2 threads (0.19 s against 0.03 s), so ``kvpack eval``'s full-precision prefills
      of 4k-token documents took 22 s instead of 7 s once any kvpack kernel had run. Our kernels' launches
      are not nested, so they run the same without it."""
    if _POOL:
        return
    _POOL.append(True)
    try:
        from numba.np.ufunc import parallel
    except ImportError:
        return
    threads = torch.get_num_threads()
    runtime = _omp_runtime()
    nesting = None if runtime is None else runtime.omp_get_nested()
    passive = "OMP_WAIT_POLICY" not in os.environ
    if passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        parallel._launch_threads()  # numba's lazy pool start, now, while the setting is in the environment
    except Exception:
        pass
    finally:
        if passive:
            del os.environ["OMP_WAIT_POLICY"]
        if runtime is not None:
            runtime.omp_set_nested(nesting)
        # torch's own setter: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once it has bound
        # its threads, and through it the count stayed at numba's (a tensor-parallel engine of 3 workers on 2 cores,
        # each at 2 threads after its first kvpack kernel: 5x slower than with numba's pool at 1)
        torch._C.set_num_threads(threads)


def _omp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime the process's global symbols name (torch's, which numba's ``omp`` layer binds to), or
    None when there is none to reach this way."""
    try:
        lib = ctypes.CDLL(None)
        lib.omp_get_nested, lib.omp_set_nested  # noqa: B018 - present or AttributeError
    except (OSError, AttributeError, TypeError):  # TypeError: no handle for the process itself (Windows)
        return None
    return lib


def _numba_missing() -> str | None:
    try:
        import numba  # noqa: F401
    except ImportError as e:  # pragma: no cover - numba is part of the cpu extra
        return f"numba is not installed ({e}); pip install 'kvpack[cpu]'"
    return None


def _spec_reasons(spec: QuantSpec, head_dim: int, role: Role) -> list[str]:
    """Why the kernel cannot read ``role``'s spec at ``head_dim``: packed int4/int2 rows whose scales would split
    a byte (the kernel's own limit; what any backend needs of a spec is :meth:`PagedKV.reasons_invalid`'s)."""
    reasons: list[str] = []
    per = 8 // spec.bits if spec.dtype in (DType.INT4, DType.INT2) else 1
    if per == 1:
        return reasons
    if head_dim % per:
        reasons.append(f"{role}: {spec.dtype.value} needs head_dim divisible by {per} here, got {head_dim}")
    _, ts, cs = spec.scale_shape(1, 2, head_dim)
    # scales that vary along a row (value groups or channels, key groups) must cover whole packed bytes
    along_row = cs > 1 and (role == "value" or ts > 1)
    if along_row and (head_dim // cs) % per:
        reasons.append(
            f"{role}: {spec.dtype.value} with {spec.granularity.name} scales needs groups of a multiple of {per} "
            f"channels (got {head_dim // cs}); use g{per * 8} or a coarser granularity"
        )
    return reasons


def reasons_unsupported(q: torch.Tensor, kv: PagedKV, window: int | None = None) -> list[str]:
    """Why the CPU kernel cannot run this case (empty list: it can)."""
    entry = _entry(kv)
    if entry.reasons is None:
        entry.reasons = _view_reasons(kv)
    reasons = list(entry.reasons)
    if q.device.type != "cpu":
        reasons.append(f"tensors must be on the CPU (q on {q.device}); use the triton backend")
    if q.dtype not in _FLOATS:
        reasons.append(f"q dtype {q.dtype} is not float32/float16/bfloat16")
    return reasons


def _view_reasons(kv: PagedKV) -> list[str]:
    """The reasons that depend on the view alone (computed once per view)."""
    reasons = []
    missing = _numba_missing()
    if missing:
        reasons.append(missing)
    if kv.device.type != "cpu" or kv.k_data.device.type != "cpu":
        reasons.append(f"tensors must be on the CPU (cache on {kv.device}); use the triton backend")
    for role in ROLES:
        reasons += _spec_reasons(kv.spec(role), kv.head_dim, role)
    return reasons


# ----------------------------------------------------------------------------------------------------
# Per-view state


class _ViewState:
    """What the kernel needs of one :class:`PagedKV` that holds while the view lives.

    A view is frozen, and the cache hands out the same view object step after step until its layout changes
    (:meth:`kvpack.cache.PagedKVCache.view`), so its tensors are the same objects, with the same shapes, on
    every call; only their contents change, and numpy views of contiguous tensors share their memory. So the
    structural checks, the spec vectors and the numpy views are made once per view (on the CPU, with the
    caches cold after a long kernel pass, they cost ~0.2 ms a call). Contents (lengths, block ids, outlier
    channels) and the query are still checked on every call. Pools and tails that are contiguous within a block
    (sequence) but strided along it (:func:`_flat`) share memory too and are kept like contiguous ones. A tail,
    table, length or sink tensor laid out otherwise gets None: its views are made (copied) on every call
    (such pools are refused, see :func:`_block_stride`).
    """

    def __init__(self) -> None:
        self.reasons: list[str] | None = None  # reasons_unsupported's view part
        self.ready = False  # the fields below are filled (the view passed its checks)
        self.switch: bool | None = None  # INT_DOT when they were made (a change makes them again)
        self.kp = self.vp = self.tpk = self.tpv = np.empty(0, np.int64)
        self.k_data: tuple | None = None
        self.v_data: tuple | None = None
        self.views: tuple = ()  # k_scale, k_zero, v_scale, v_zero, k_outlier, k_outlier_idx
        self.tails: tuple | None = None
        self.tables: np.ndarray | None = None
        self.seq_lens: np.ndarray | None = None
        self.sinks: tuple | None = None
        self.pools: _PoolState | None = None  # shared with the other views of the same pools
        self.fast: _FastArgs | None = None  # the fixed launch arguments, where they all are (_fast_args)
        self.chunk_rows: tuple | None = None  # the chunk kernel's tails and sink rows (cpu_chunk._live_f32)


_states: dict[int, tuple[weakref.ref, _ViewState]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    hit = _states.get(key)
    if hit is not None and hit[0] is ref:
        del _states[key]


def _entry(kv: PagedKV) -> _ViewState:
    """The state kept for ``kv`` (a fresh one the first time; dropped when ``kv`` is garbage)."""
    key = id(kv)
    hit = _states.get(key)
    if hit is not None and hit[0]() is kv:
        return hit[1]
    state = _ViewState()
    _states[key] = (weakref.ref(kv, functools.partial(_forget, key)), state)
    return state


def _live(t: torch.Tensor | None) -> tuple | None:
    """:func:`_views` of ``t`` if they share its memory (None: ``t`` must be converted on every call)."""
    return _views(t) if t is None or _inner_contiguous(t) else None


def _live_array(t: torch.Tensor) -> np.ndarray | None:
    return t.numpy() if t.is_contiguous() else None


def _prepare(kv: PagedKV) -> _ViewState:
    """``kv``'s checked structure, spec vectors and numpy views (see :class:`_ViewState`)."""
    state = _entry(kv)
    if state.ready and state.switch is INT_DOT:  # the environment is read when a view is prepared (below)
        return state
    dot = int_dot_enabled()
    kv.check()
    pools = _pool_state(kv, dot)
    state.pools = pools  # kept alive by the views that read these pools
    state.kp, state.vp, state.tpk, state.tpv = pools.kp, pools.vp, pools.tpk, pools.tpv
    state.k_data, state.v_data, state.views = pools.k_data, pools.v_data, pools.views
    tails = (_live(kv.tail_k), _live(kv.tail_v))
    state.tails = tails if all(x is not None for x in tails) else None
    state.tables, state.seq_lens = _live_array(kv.block_tables), _live_array(kv.seq_lens)
    state.sinks = None
    if kv.sink_k is not None and kv.sink_k.is_contiguous() and kv.sink_v.is_contiguous():
        state.sinks = _sink_arrays(kv.sink_k, kv.sink_v)
    state.switch, state.ready = INT_DOT, True
    state.fast = _fast_args(kv, state)
    return state


def _fast_args(kv: PagedKV, st: _ViewState) -> _FastArgs | None:
    """The launch arguments that hold for the view's life, where every array is read in place and nothing is
    checked per call but the lengths and block ids (no outlier channels, no start positions); else None."""
    parts = (st.tables, st.seq_lens, st.tails, st.k_data, st.v_data, *st.views)
    if any(p is None for p in parts) or kv.k_outlier is not None or kv.start_pos is not None:
        return None
    if kv.sink and st.sinks is None:
        return None
    ks, kz, vs, vz, ko, ki = st.views
    f = _FastArgs()
    f.batch, f.kv_heads, f.head_dim, f.block_size = kv.batch, kv.kv_heads, kv.head_dim, kv.block_size
    f.rows = (st.seq_lens, st.tables, _NO_START, -1, f.block_size, f.kv_heads, kv.k_data.shape[0], kv.sink)
    f.pools = (st.k_data, ks, kz, st.kp, st.v_data, vs, vz, st.vp, *st.tails, st.tpk, st.tpv, _NO_CUT)
    f.rest = (ko, ki, *(st.sinks if kv.sink else _NO_SINKS))
    f.sm_scale, f.qscale = None, None  # the last call's softmax scale and its qscale argument
    f.entry = [None, None]  # launch_one's and launch's compiled wrappers for these arguments (compiled_entry)
    return f


class _FastArgs:
    """:func:`_fast_args`: a view's fixed launch arguments, in :func:`cpu_decode_numba.launch`'s order."""

    __slots__ = ("batch", "block_size", "entry", "head_dim", "kv_heads", "pools", "qscale", "rest", "rows", "sm_scale")


class _PoolState:
    """What every view over the same pools and tail layout shares: the spec vectors and the pools' numpy views.
    A serving engine makes a view for each number of running requests, all over one layer's pools: the first
    makes these (~0.3 ms), the others find them (:func:`_pool_state`)."""

    __slots__ = ("__weakref__", "k_data", "kp", "tpk", "tpv", "v_data", "views", "vp")


# by _pool_key; an entry lives while a view's state holds it (its numpy views hold the pools' memory, so no other
# tensor can cover the addresses in its key meanwhile)
_pool_states: weakref.WeakValueDictionary[tuple, _PoolState] = weakref.WeakValueDictionary()


def _memory_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())


def _pool_key(kv: PagedKV, dot: bool) -> tuple:
    """What the spec vectors and the pools' views of a checked view depend on: its format, the pools' memory and
    layout, and the tails' layout along a sequence (not their batch)."""
    tails = tuple((t.dtype, t.shape[1:], t.stride()) for t in (kv.tail_k, kv.tail_v))
    pools = (kv.k_data, kv.k_scale, kv.k_zero, kv.v_data, kv.v_scale, kv.v_zero, kv.k_outlier, kv.k_outlier_idx)
    return (kv.format, kv.head_dim, dot, tails, *map(_memory_key, pools))


def _pool_state(kv: PagedKV, dot: bool) -> _PoolState:
    """The :class:`_PoolState` of a checked view (made the first time its pools and tail layout are seen)."""
    key = _pool_key(kv, dot)
    hit = _pool_states.get(key)
    if hit is not None:
        return hit
    nbm = _nb()
    st = _PoolState()
    st.kp = _params(kv.format.key, kv, kv.k_data, "key")
    st.vp = _params(kv.format.value, kv, kv.v_data, "value")
    st.tpk, st.tpv = np.zeros_like(st.kp), np.zeros_like(st.vp)
    # the tails: passthrough rows in natural channel order (cpu_decode_numba.work gives them a query and an accumulator
    # in that order), so float32 rows are read in place
    for tp, tail in ((st.tpk, kv.tail_k), (st.tpv, kv.tail_v)):
        tp[nbm.P_KIND] = PayloadKind.FLT
        tp[nbm.P_FK] = _FLOAT_KIND[kv.tail_k.dtype]
        tp[nbm.P_PER] = 1
        tp[nbm.P_HS] = tp[nbm.P_TS] = tp[nbm.P_CS] = 1
        tp[nbm.P_ROW] = kv.head_dim
        # sequences of a tail read in place are stride(0) apart; one copied per call (_views) is contiguous
        tp[nbm.P_BST] = _block_stride(tail, "tail") if _inner_contiguous(tail) else tail[0].numel()
    st.k_data, st.v_data = _live(kv.k_data), _live(kv.v_data)
    st.views = tuple(_live(t) for t in (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, kv.k_outlier,
                                        kv.k_outlier_idx))  # fmt: skip
    _pool_states[key] = st
    return st


# ----------------------------------------------------------------------------------------------------
# Arguments


# the float kind of a tail's rows, by its torch dtype
_FLOAT_KIND = {torch.float16: FloatKind.F16, torch.bfloat16: FloatKind.BF16, torch.float32: FloatKind.F32}
_DUMMY = (np.zeros(1, np.uint8), np.zeros(1, np.uint16), np.zeros(1, np.float32))


def _views(t: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat (uint8, uint16, float32) numpy views of a tensor's elements; the slots that do not apply are dummies.
    They share ``t``'s memory when it is contiguous within its first axis (:func:`_flat`), else hold a contiguous
    copy."""
    if t is None:
        return _DUMMY
    t = _flat(t) if _inner_contiguous(t) else t.contiguous().reshape(-1)
    if t.element_size() == 1:
        return (t.view(torch.uint8).numpy(), _DUMMY[1], _DUMMY[2])
    if t.element_size() == 2:
        return (_DUMMY[0], t.view(torch.int16).numpy().view(np.uint16), _DUMMY[2])
    return (_DUMMY[0], _DUMMY[1], t.float().numpy())


def _block_layout(t: torch.Tensor) -> str | None:
    """Why the kernel cannot read ``t`` in place as blocks ``stride(0)`` elements apart (None: it can): each
    block (``t[n]``) must be contiguous (axes of size 1 may have any stride, as in
    :meth:`torch.Tensor.is_contiguous`), blocks must not overlap, and the address must be a multiple of the
    element size (numba's typed views)."""
    if t.dim() == 0:
        return "a 0-d tensor has no block axis"
    want = 1
    for n, st in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if n != 1 and st != want:
            return f"not contiguous within a block (shape {tuple(t.shape)}, strides {t.stride()})"
        want *= n
    if t.shape[0] > 1 and t.stride(0) < want:
        return f"its blocks overlap: stride(0)={t.stride(0)} is smaller than a block ({want} elements)"
    if t.data_ptr() % t.element_size():
        return f"its address {t.data_ptr():#x} is not a multiple of its element size ({t.element_size()} bytes)"
    return None


def _inner_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` can be read in place as blocks ``stride(0)`` elements apart (see :func:`_block_layout`)."""
    return _block_layout(t) is None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The 1-D tensor of ``t``'s elements from its first to its last, sharing its memory (``t`` as
    :func:`_block_layout` requires): element ``i`` of block ``n`` is at ``n * stride(0) + i``. Elements between
    blocks (other pools of the same pages, padding) are in it but never read."""
    if t.is_contiguous():
        return t.reshape(-1)
    n = (t.shape[0] - 1) * t.stride(0) + t[0].numel() if t.shape[0] else 0
    return t.as_strided((n,), (1,), t.storage_offset())


def _block_stride(t: torch.Tensor, name: str) -> int:
    """Elements between consecutive blocks of ``t`` (its ``stride(0)``; a block's size when there is one block, or
    ``t`` is contiguous); :class:`ShapeError` unless the kernel can read it in place (:func:`_block_layout`)."""
    why = _block_layout(t)
    if why is not None:
        raise ShapeError(
            f"{name} cannot be read by the CPU kernel: {why}; pools may be strided along the block axis only "
            "(each block contiguous)"
        )
    return t.stride(0) if t.shape[0] > 1 else t[0].numel()


@lru_cache(maxsize=1)
def int_dot_isa() -> str | None:
    """The vector instructions the compiled integer loops get on this CPU (as numba targets it):
    ``"avx512bw"`` (``vpdpwssd`` with VNNI, ``vpmaddwd`` without; fp8 codes through a ``vpermt2w`` table),
    ``"avx2"`` (the portable loops, which LLVM lowers to 256-bit ``vpmaddwd``: about 2x faster than the
    float path for int8/int4/int2 codes, measured with numba targeting Haswell; fp8 stays on the float path
    there, as its table lookup becomes a gather), or None (the float path: other CPUs, not measured)."""
    from llvmlite import binding as llvm
    from numba.core import config

    feats = set((config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()).split(","))
    if "+avx512bw" in feats:
        return "avx512bw"
    if "+avx2" in feats:
        return "avx2"
    return None


def int_dot_enabled() -> bool:
    """Whether integer codes (and, with AVX-512 BW, fp8 codes) are multiplied as integers (int16 query and
    weights, exact int32 sums) rather than converted to float32 one by one: where :func:`int_dot_isa`
    names an instruction set, unless ``KVPACK_CPU_INT_DOT=0`` or :data:`INT_DOT` says otherwise (the kernels
    read it when a view is first used)."""
    if INT_DOT is not None:
        return INT_DOT
    return os.environ.get("KVPACK_CPU_INT_DOT", "1") != "0" and int_dot_isa() is not None


def _int_dot_limit(spec: QuantSpec, kind: int, kv: PagedKV, role: Role) -> int:
    """The largest int16 operand the integer path may use for this spec (0: it does not apply).

    Keys: the scale must be constant over a block's tokens (it is folded into the query), rows in whole
    32-byte pieces, block_size a multiple of 4; the ``head_dim`` products of one score must not overflow
    int32. Values: rows in pairs of 32-byte pieces (or one 16-byte piece of 2-bit codes: head_dim 64), block_size
    even, scale groups of whole 16-byte runs (8-byte runs for 2-bit codes);
    the ``block_size`` products of one channel must not overflow int32. Where that bound leaves the
    operand fewer than 11 bits (:data:`_MIN_INT_LIMIT`: fp8's 12-bit codes past head_dim 512, block 512+),
    the float path is more accurate and serves instead."""
    nbm = _nb()
    if kind not in _ir._CODE_MAX or not int_dot_enabled():
        return 0
    if kind in (nbm.E4M3, nbm.E5M2) and int_dot_isa() != "avx512bw":
        return 0  # fp8's table lookup needs vpermt2w; elsewhere it is a gather, slower than the float path
    d, b = kv.head_dim, kv.block_size
    per = 8 // spec.bits
    dp = d // per
    _, ts, cs = spec.scale_shape(kv.kv_heads, b, d)
    cmax = _ir._CODE_MAX[kind]
    if role == "key":
        if ts != 1 or b % 4 or dp % 32:
            return 0
        lim = min(32767, _I32_MAX // (d * cmax))
    else:
        run = _ir.value_run(per)  # the value loop's weight groups: 16-byte runs, 8 for 2-bit codes
        narrow = per == 4 and dp == 16  # 2-bit rows at head_dim 64: the loop's 16-byte variant
        if b % 2 or (dp % 32 and not narrow) or (d // 32) % 2 or (cs > 1 and (dp % cs or (dp // cs) % run)):
            return 0
        lim = min(32767, _I32_MAX // ((b + 1) * cmax))
    return lim if lim >= _MIN_INT_LIMIT else 0


def _int_dot_guards(kind: int, lim: int, role: Role) -> tuple[int, int]:
    """``(P_SPREAD, P_CMIN)`` of an integer-path spec (``role``: key or value) whose int16 operands go up to ``lim``.

    Rounding an operand scaled to ``lim`` at its largest moves the typical element ``x`` by ``max / (2 lim)``; the
    format's own rounding moves its term by half a code unit (integer codes: ``x / 2``, against ``max / (2 lim)``
    times a code of up to ``c`` units, centred) or by ``2**-(m+1)`` of it (fp8, ``m`` mantissa bits). The integer
    path loses no more than the format while ``max / x <= lim / c`` (``lim * 2**-(m+1)`` for fp8): that many
    binary orders, plus :data:`SPREAD_SLACK`, is the block's allowed spread (geometric, so one outlier counts fully).
    fp8 codes must also reach ``FP8_MIN_WORD`` table words (``P_CMIN``: the smallest magnitude byte that does)."""
    nbm = _nb()
    if kind in (nbm.E4M3, nbm.E5M2):
        mbits = 3 if kind == nbm.E4M3 else 2
        spread = int(math.log2(lim)) - (mbits + 1)
        table = _ir._lut_table(kind)
        cmin = next(c for c in range(128) if table[c] >= FP8_MIN_WORD)
        return spread + SPREAD_SLACK[role], cmin
    centred = {nbm.S8: 128, nbm.U8: 128, nbm.U4: 8, nbm.U2: 2}[kind]
    return int(math.log2(lim / centred)) + SPREAD_SLACK[role], 0


def _params(spec: QuantSpec, kv: PagedKV, payload: torch.Tensor, role: Role) -> np.ndarray:
    """The int64 parameter vector of one spec (see ``cpu_decode_numba.P_*``) of a checked view (:meth:`PagedKV.check`);
    checks that the payload, scale and zero-point pools can be read in place (:func:`_block_stride`: their block
    strides)."""
    nbm = _nb()
    h, b, d = kv.kv_heads, kv.block_size, kv.head_dim
    low = lower(spec, h, b, d)
    p = np.zeros(nbm.N_PARAMS, np.int64)
    p[nbm.P_BST] = _block_stride(payload, f"{role} payload")
    p[nbm.P_KIND], p[nbm.P_FK], p[nbm.P_PER], p[nbm.P_OFF] = low.kind, low.float_kind, low.per, low.offset
    p[nbm.P_HS], p[nbm.P_TS], p[nbm.P_CS] = low.scale_shape
    p[nbm.P_ROW] = low.row
    p[nbm.P_FAR] = FAR_BLOCKS
    p[nbm.P_MULTI] = max(MULTI_TOKENS // b, 1)
    if spec.is_passthrough:
        return p
    p[nbm.P_SKIND], p[nbm.P_ZKIND] = low.scale_kind, low.zero_kind
    scale, zero = (kv.k_scale, kv.k_zero) if role == "key" else (kv.v_scale, kv.v_zero)
    if scale is not None:  # a checked view has the scales its spec stores
        p[nbm.P_SBST] = _block_stride(scale, f"{role} scale")
    if spec.has_zero and zero is not None:
        p[nbm.P_ZBST] = _block_stride(zero, f"{role} zero")
    p[nbm.P_DOT] = _int_dot_limit(spec, int(p[nbm.P_KIND]), kv, role)
    if p[nbm.P_DOT]:
        p[nbm.P_SPREAD], p[nbm.P_CMIN] = _int_dot_guards(int(p[nbm.P_KIND]), int(p[nbm.P_DOT]), role)
    if role == "key" and kv.k_outlier is not None:
        p[nbm.P_NOUT] = spec.outliers
        p[nbm.P_REF] = int(spec.refined)
        p[nbm.P_IDX16] = int(kv.k_outlier_idx.element_size() == 2)
        p[nbm.P_OBST] = _block_stride(kv.k_outlier, "k_outlier")
        p[nbm.P_IBST] = _block_stride(kv.k_outlier_idx, "k_outlier_idx")
    return p


def _check_call(q: torch.Tensor, kv: PagedKV, out: torch.Tensor | None) -> None:
    """What must be checked on every call: the query and the output buffer."""
    h, d = kv.kv_heads, kv.head_dim
    if q.dim() != 3 or q.shape[0] != kv.batch or q.shape[2] != d or q.shape[1] % h:
        raise ShapeError(f"q must be [batch={kv.batch}, Hq (a multiple of {h}), D={d}], got {tuple(q.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ShapeError(f"out must be {tuple(q.shape)} {q.dtype} like q, got {tuple(out.shape)} {out.dtype}")


def _check_outlier_channels(kv: PagedKV) -> None:
    """The kept channels of the sealed blocks the tables use lie in ``[0, head_dim)`` (contents: every call). A
    table's entries past a row's sealed blocks are never read (vLLM lists the open block, whose page is not
    written until it seals)."""
    nb = kv.k_data.shape[0]
    t = kv.block_tables
    sealed = torch.arange(t.shape[1], device=t.device) < (kv.seq_lens.to(t.device) // kv.block_size)[:, None]
    used = kv.k_outlier_idx[t[sealed & (t > 0) & (t < nb)].long()]  # the null block is never read
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= kv.head_dim):
        raise ShapeError(
            f"k_outlier_idx holds channels outside [0, {kv.head_dim}) in blocks the block_tables use: "
            "the outlier pools do not match this cache"
        )


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    tail_cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused decode attention on the CPU, one query per sequence (or, with ``tail_cut``, several positions of a
    sequence as query heads of one call).

    Args:
        q: ``[batch, Hq, D]``, float32/float16/bfloat16; ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's paged cache (the query's own token already appended).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: attend only the last ``window`` positions (the query's included); ``None`` for all.
        out: optional ``[batch, Hq, D]`` buffer, dtype of ``q``.
        tail_cut: optional ``[batch, Hq // H]`` int32: query head ``h * G + g`` of row ``b`` attends the history up to
            ``tail_cut[b, g]`` positions before the row's last, inside the tail only (``0 <= tail_cut[b, g] <=
            min(seq_len % block_size, seq_len - 1)``: the sealed blocks are every head's). So the queries of a token
            and its drafts (positions ``seq_len - 1 - k``) go as heads of one call, the sealed blocks read once for
            all of them. No window with it.

    Returns:
        ``[batch, Hq, D]`` in ``q.dtype`` (``out`` when given).

    Raises:
        ShapeError: inconsistent shapes or dtypes, a block id outside the pools, an empty sequence, a ``tail_cut``
            of the wrong shape or reaching past the tail, or with a window.
        UnsupportedError: a view of rotated keys (``kv.key_rotation``): go through
            :func:`kvpack.kernels.decode_attention`, which rotates the query.
    """
    refuse_rotated(kv)
    prep = _prepare(kv)
    if prep.fast is not None and tail_cut is None and window is None and out is not None:
        res = _launch_fast(prep.fast, q, sm_scale, out)
        if res is not None:
            return res
    _check_call(q, kv, out)
    nbm = _nb()
    d = kv.head_dim
    b = kv.block_size
    num_blocks = kv.k_data.shape[0]
    tables = prep.tables if prep.tables is not None else kv.block_tables.contiguous().numpy()
    seq_lens = prep.seq_lens if prep.seq_lens is not None else kv.seq_lens.contiguous().numpy()
    if kv.k_outlier is not None:
        _check_outlier_channels(kv)
    start = _NO_START if kv.start_pos is None else kv.start_pos.contiguous().numpy()
    win = -1 if window is None else int(window)
    cuts = _NO_CUT if tail_cut is None else _tail_cuts(tail_cut, seq_lens, q.shape[1] // kv.kv_heads, b, window)
    threads = max(1, torch.get_num_threads())
    qf = query_f32(q)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    ks, kz, vs, vz, ko, ki = (
        v if v is not None else _views(t)
        for v, t in zip(prep.views, (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero, kv.k_outlier, kv.k_outlier_idx))
    )
    tk, tv = prep.tails if prep.tails is not None else (_views(kv.tail_k), _views(kv.tail_v))
    if kv.sink:
        sinks = prep.sinks if prep.sinks is not None else _sink_arrays(kv.sink_k.contiguous(), kv.sink_v.contiguous())
    else:
        sinks = _NO_SINKS
    # the output written in q's dtype and the sink rows read in theirs by the compiled call (no conversions in torch)
    direct = out is not None and out.is_contiguous()
    res = out if direct else torch.empty(q.shape, dtype=q.dtype)
    okind = _FLOAT_KIND[res.dtype]
    o16, o32 = (_NO_OUT16, res.numpy()) if okind == FloatKind.F32 else (res.view(torch.int16).numpy().view(np.uint16),
                                                                       _NO_OUT32)  # fmt: skip
    # plan, threads and merge in one compiled call (on numba's threads, torch's OpenMP workers with the omp layer):
    # see cpu_decode_numba.launch
    err = (nbm.launch if threads > 1 else nbm.launch_one)(
        threads, _SERIAL_BLOCKS, *_chunking(b, threads), seq_lens, tables, start, win, b, kv.kv_heads, num_blocks,
        kv.sink, qf, prep.k_data or _views(kv.k_data), ks, kz, prep.kp, prep.v_data or _views(kv.v_data), vs, vz,
        prep.vp, tk, tv, prep.tpk, prep.tpv, cuts, np.float32(sm * _LOG2E), ko, ki, *sinks, o16, o32, int(okind),
    )  # fmt: skip
    if err:
        _raise_contents(err, seq_lens, tables, num_blocks)
    if out is not None and not direct:
        return out.copy_(res)
    return res


def _launch_fast(f: _FastArgs, q: torch.Tensor, sm_scale: float | None, out: torch.Tensor) -> torch.Tensor | None:
    """:func:`decode_attention` of a float32 query into a contiguous float32 ``out`` over a view with
    :class:`_FastArgs` (no window, no tail cuts): the same checks and launch with the view's arguments kept, and
    fewer torch calls (with the caches cold, as in a serving engine between two calls of a layer, each costs
    microseconds). None, with nothing done, for any other query or output."""
    shape = q.shape
    if q.dtype is not torch.float32 or out.dtype is not torch.float32 or not out.is_contiguous():
        return None
    if len(shape) != 3 or shape[0] != f.batch or shape[2] != f.head_dim or shape[1] % f.kv_heads or out.shape != shape:
        return None  # decode_attention's checks raise
    qf = q.detach().numpy()
    if not qf.flags.c_contiguous:
        qf = np.ascontiguousarray(qf)
    threads = max(1, torch.get_num_threads())
    if sm_scale != f.sm_scale or f.qscale is None:  # np.float32() costs ~10 us with the caches cold: kept
        sm = 1.0 / math.sqrt(f.head_dim) if sm_scale is None else float(sm_scale)
        f.sm_scale, f.qscale = sm_scale, np.float32(sm * _LOG2E)
    args = (threads, _SERIAL_BLOCKS, *_chunking(f.block_size, threads), *f.rows, qf, *f.pools, f.qscale, *f.rest,
            _NO_OUT16, out.numpy(), _F32_KIND)  # fmt: skip
    many = threads > 1
    fn = f.entry[many]
    if fn is not None:  # every argument's numba type is the first call's (the checks above keep them)
        err = fn(*args)
    else:
        nbm = _nb()
        disp = nbm.launch if many else nbm.launch_one
        err = disp(*args)
        f.entry[many] = compiled_entry(disp, args) or disp  # none found: the dispatcher, not a search every call
    if err:
        _raise_contents(err, f.rows[0], f.rows[1], f.rows[6])
    return out


def compiled_entry(disp: Any, args: tuple) -> Callable[..., Any] | None:
    """The compiled wrapper numba's dispatcher ``disp`` runs for ``args`` (None where it has compiled none for
    their types, or ``disp`` is no dispatcher). Called directly, it unboxes the arguments as a call through the
    dispatcher does, without first typing each one to find it: ~15 us of a decode launch with the caches cold, as in
    a serving engine (tuples of arrays are typed in Python). A caller must pass arguments of the same numba types as
    ``args`` every time."""
    overloads = getattr(disp, "overloads", None)  # anything else callable (a test's spy) has none
    if overloads is None:
        return None
    from numba.core.typing.typeof import Purpose, typeof

    cres = overloads.get(tuple(typeof(a, Purpose.argument) for a in args))
    return None if cres is None else cres.entry_point


def query_f32(q: torch.Tensor) -> np.ndarray:
    """``q`` (any shape and float dtype, strided views allowed) as a C-contiguous float32 numpy array
    (``q``'s own memory when it is a contiguous float32 tensor). Converted in numpy, not torch: right after a kernel
    pass has streamed the history through the caches, a torch call costs tens of microseconds (a strided query's
    ``.float().contiguous()`` took ~50 us there), a numpy one a few."""
    if q.dtype is torch.float32:
        a = q.detach().numpy()
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)
    if q.dtype not in (torch.float16, torch.bfloat16):
        return q.detach().float().contiguous().numpy()
    bits = q.detach().view(torch.int16).numpy().view(np.uint16)
    if q.dtype is torch.bfloat16:  # bfloat16 is the top half of a float32
        return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


_NO_START = np.zeros(0, np.int32)  # prepare_launch's start_pos when there is none (0 for every row)
_NO_CUT = np.zeros((0, 0), np.int32)  # the kernel's tail cuts when there are none


def _tail_cuts(
    tail_cut: torch.Tensor, seq_lens: np.ndarray, group: int, block_size: int, window: int | None
) -> np.ndarray:
    """``tail_cut`` checked (see :func:`decode_attention`) as the kernel's ``[batch, G]`` int32 array."""
    if window is not None:
        raise ShapeError(
            "tail_cut with a window: each position would need its own window start; call once per position"
        )
    want = (seq_lens.shape[0], group)
    if tuple(tail_cut.shape) != want or tail_cut.dtype != torch.int32:
        raise ShapeError(f"tail_cut must be {list(want)} int32 (one cut per row and query head of a group), got "
                         f"{list(tail_cut.shape)} {tail_cut.dtype}")  # fmt: skip
    cuts = np.ascontiguousarray(tail_cut.numpy())
    most = np.minimum(seq_lens % block_size, seq_lens.astype(np.int64) - 1)[:, None]
    if cuts.size and (cuts.min() < 0 or (cuts > most).any()):
        raise ShapeError(
            "tail_cut must lie in [0, min(seq_len % block_size, seq_len - 1)] (a cut query's history ends inside its "
            f"tail, or at its last sealed block, and holds a position); got {cuts.tolist()} for seq_lens "
            f"{seq_lens.tolist()}"
        )
    return cuts


def _raise_contents(err: int, seq_lens: np.ndarray, tables: np.ndarray, num_blocks: int) -> None:
    """The :class:`ShapeError` for :func:`cpu_decode_numba.prepare_launch`'s error code."""
    if err == 1:
        raise ShapeError(f"every sequence needs at least one token (its query's own), got seq_lens {seq_lens.tolist()}")
    if err == 2:
        raise ShapeError(f"block_tables has {tables.shape[1]} columns, too few for seq_len {int(seq_lens.max())}")
    raise ShapeError(f"block_tables hold ids outside [0, {num_blocks}); the pools have {num_blocks} blocks")


# merge's placeholders: the sink rows' and the output's arrays of the dtype not in use (and sink rows when there are
# none), so that every call has the same argument types and one compiled merge serves all dtypes
_NO_ROWS16 = np.empty((0, 1, 1, 1), np.uint16)
_NO_ROWS32 = np.empty((0, 1, 1, 1), np.float32)
_NO_SINKS = (_NO_ROWS16, _NO_ROWS32, _NO_ROWS16, _NO_ROWS32, int(FloatKind.F32))
_NO_OUT16 = np.empty((0, 1, 1), np.uint16)
_NO_OUT32 = np.empty((0, 1, 1), np.float32)
_F32_KIND = int(FloatKind.F32)


def _sink_arrays(sink_k: torch.Tensor, sink_v: torch.Tensor) -> tuple:
    """``(k16, k32, v16, v32, kind)`` for :func:`cpu_decode_numba.merge`: contiguous ``[batch, H, S, D]`` sink rows
    as numpy views sharing their memory, float32 ones as they are, 16-bit ones as their bits (``kind``: a
    :class:`FloatKind`), the unused slots placeholders."""
    kind = _FLOAT_KIND[sink_k.dtype]
    if kind == FloatKind.F32:
        return (_NO_ROWS16, sink_k.detach().numpy(), _NO_ROWS16, sink_v.detach().numpy(), int(kind))
    k16, v16 = (t.detach().view(torch.int16).numpy().view(np.uint16) for t in (sink_k, sink_v))
    return (k16, _NO_ROWS32, v16, _NO_ROWS32, int(kind))


def work_items(
    seq_lens: np.ndarray, start: np.ndarray, window: int, block_size: int, kv_heads: int, threads: int
) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's work items for ``threads`` threads (:func:`cpu_decode_numba.work_items`: long histories cut into
    chunks of at least :data:`MIN_CHUNK_TOKENS` to reach :data:`_ITEMS_PER_THREAD` items per thread).

    seq_lens, start: ``[batch]`` int32; window: -1 for none. Returns ``(items [n, 5], first [batch * kv_heads + 1])``.
    """
    return _nb().work_items(seq_lens, start, window, block_size, kv_heads, *_chunking(block_size, threads))


def blocks_per_run(kv: PagedKV) -> int:
    """How many blocks the kernel attends with one softmax step over ``kv``'s sealed blocks (1: one at a time;
    runs need integer dot products on keys and values and key scales constant over a block's tokens: see
    :func:`cpu_decode_numba._attend_runs`)."""
    nbm = _nb()
    state = _prepare(kv)
    if nbm._multi_eligible(state.kp, state.vp):
        return int(state.kp[nbm.P_MULTI])
    return 1


def _chunking(block_size: int, threads: int) -> tuple[int, int]:
    """:func:`cpu_decode_numba.work_items`'s target item count and shortest chunk (in blocks) for ``threads`` threads."""
    return _ITEMS_PER_THREAD * threads, max(1, MIN_CHUNK_TOKENS // block_size)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def thread_runs(items: np.ndarray, threads: int) -> np.ndarray:
    """Each thread's run of work items for :func:`cpu_decode_numba.take_item`: ``threads`` contiguous runs of about
    equal cost, ``[threads]`` int64 words (:func:`cpu_decode_numba.split_runs`)."""
    return _nb().split_runs(items, threads)


def run_items(fn: Any, items: np.ndarray, threads: int, args: tuple) -> None:
    """Run ``fn(t, runs, items, *args)`` on ``threads`` threads (the caller's is thread 0), once each.

    ``fn`` is compiled, releases the GIL and takes its items with :func:`cpu_decode_numba.take_item` from ``runs``
    (:func:`thread_runs`): each thread walks its own contiguous run in order (items come sequence by
    sequence, kv head by kv head, and a kv head's blocks sit right after the previous head's in every
    block, so part of the next item is already in the last-level cache when a thread gets to it; measured:
    int8 at 32k, one thread, heads in order 14.5 ms, in reverse 17.0, every other head 18.5), then takes
    the last items of the run with the most left, so a core that is busy with something else ends up doing
    less, and the threads finish within about one item of each other. One call per thread, not per slice:
    a numba call with this many arguments costs ~5-20 us under the GIL. Small calls run on the calling
    thread alone.

    The decode kernel does not come through here: it runs on numba's own thread pool (:func:`cpu_decode_numba.launch`,
    one compiled call; :func:`cpu_decode_numba.launch_one` on one thread), whose threads take items the same way;
    this pool is for the other compiled loops (the block-read probe). Measured in vLLM on the 2-core development VM
    (`kvpack bench vllm --quick`, int4): 137 tok/s on the Python pool, 169 on numba's; a Python pool thread
    woken between torch's operators waits for a core that torch's own OpenMP workers still hold.
    """
    global _pool
    nbm = _nb()
    runs = nbm.split_runs(items, nbm.run_count(items, threads, _SERIAL_BLOCKS))
    threads = runs.shape[0]
    if threads == 1:
        fn(0, runs, items, *args)
        return
    with _pool_lock:
        if _pool is None or _pool._max_workers < threads - 1:
            _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="kvpack-cpu")
        pool = _pool
    futures = [pool.submit(fn, t, runs, items, *args) for t in range(1, threads)]
    fn(0, runs, items, *args)
    for f in futures:
        f.result()
