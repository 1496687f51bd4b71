"""The ``triton`` backend: fused decode attention over the packed paged cache (GPU, or the interpreter).

One program handles one sequence, one kv head (all of its query heads: one read of K/V per block for the
whole group) and one split of the sequence's sealed blocks (flash-decoding). It dequantizes each block in
registers (key scales folded into the query where the granularity allows), keeps an online softmax in
float32, and the last split attends the full-precision tail. With a sink (``kv.sink_k``) the first split
attends the sink rows first and the blocks mask those positions out. Splits are merged with a log-sum-exp
in a second small kernel. Dequantized K/V never reach memory.

The jit code is in :mod:`kvpack.kernels.triton_kernels`; this module checks shapes, chooses the number
of splits and launches. Triton is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch

from kvpack.errors import ConfigError, ShapeError, UnsupportedError
from kvpack.formats import DType, PerChannel, PerGroup, PerHead, PerTensor, PerToken, QuantSpec, ScaleDType
from kvpack.kernels.lowering import lower
from kvpack.kernels.views import ROLES, PagedKV, Role, refuse_rotated

__all__ = [
    "Launch",
    "build_launches",
    "cache_args",
    "cache_constexprs",
    "check_cache",
    "check_out",
    "choose_codes",
    "compile_launch",
    "decode_attention",
    "default_num_splits",
    "launch_config",
    "reasons_unsupported",
    "spec_constants",
]

_LOG2E = 1.4426950408889634
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_BLOCKS_PER_SPLIT = 4  # a split shorter than this costs more in merging than it gains in parallelism
PROGRAMS_PER_SM = 16  # measured on an H200 (benchmarks/gpu_tune.py): 16 beat 4 by 1.06-1.6x at batch 16-64
MAX_SPLITS = 64


@lru_cache(maxsize=1)
def _triton_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({e}); pip install 'kvpack[triton]'"
    return None


def _kernels() -> ModuleType:
    from kvpack.kernels import triton_kernels

    return triton_kernels


def _interpreter_bf16_dot_ok() -> bool:
    """Whether the Triton interpreter multiplies bfloat16 dot operands correctly (a 16 x 16 probe)."""
    a = torch.eye(16, dtype=torch.bfloat16) * 2
    b = torch.full((16, 16), 1.5, dtype=torch.bfloat16)
    o = torch.zeros(16, 16)
    _kernels().bf16_dot_probe[(1,)](a, b, o)
    return bool(torch.equal(o, torch.full((16, 16), 3.0)))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _per(spec: QuantSpec) -> int:
    """Elements per payload byte: 2 for int4, 4 for int2, else 1."""
    return 8 // spec.bits if spec.bits < 8 else 1


def part_columns(spec: QuantSpec, head_dim: int) -> int:
    """Columns of one part's tiles in the kernels: ``head_dim // PER`` rounded up to a power of two of at least 16
    (``tl.arange`` needs a power of two, a dot operand 16); the kernels mask the columns past ``head_dim // PER``."""
    return max(16, _next_pow2(head_dim // _per(spec)))


def spec_constants(spec: QuantSpec, kv_heads: int, block_size: int, head_dim: int) -> dict[str, int | bool]:
    """The kernel's compile-time description of one spec: ``KIND``, ``BITS``, ``PER``, ``SCALE``, ``CGROUP``,
    ``E8M0`` (codes of :mod:`kvpack.kernels.lowering`: :class:`TritonKind`, :class:`TritonScale`)."""
    low = lower(spec, kv_heads, block_size, head_dim)
    return {
        "KIND": int(low.triton_kind),
        "BITS": spec.bits,
        "PER": low.per,
        "SCALE": int(low.triton_scale),
        "CGROUP": low.cgroup,
        "E8M0": low.e8m0,
    }


def _spec_reasons(spec: QuantSpec, head_dim: int, role: Role) -> list[str]:
    """Why the kernel cannot read ``role``'s spec at ``head_dim`` (its own limits; what any backend needs of a
    spec is :meth:`PagedKV.reasons_invalid`'s)."""
    reasons: list[str] = []
    if spec.granularity is not None and not isinstance(
        spec.granularity, (PerTensor, PerHead, PerChannel, PerToken, PerGroup)
    ):
        reasons.append(f"{role}: granularity {spec.granularity!r} is not one the kernel knows")
    return reasons


def reasons_unsupported(q: torch.Tensor, kv: PagedKV, window: int | None = None) -> list[str]:
    """Why the Triton kernel cannot run this case (empty list: it can)."""
    err = _triton_error()
    if err:
        return [err]
    reasons: list[str] = []
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < 8:
            reasons.append(
                f"the Triton kernel needs an Ampere or newer GPU (compute capability 8.0), got {major}.{minor}"
            )
        fp8 = DType.FP8_E4M3 in (kv.format.key.dtype, kv.format.value.dtype)
        if fp8 and (major, minor) < (8, 9):
            reasons.append(f"fp8 e4m3 needs compute capability 8.9 or newer (Ada, Hopper), got {major}.{minor}")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        reasons.append(
            "tensors are on the CPU: the Triton kernel needs a CUDA device (or TRITON_INTERPRET=1 for tests)"
        )
    elif not _kernels().INTERPRETED:
        reasons.append("the Triton kernels were compiled for the GPU before TRITON_INTERPRET=1 was set; set it first")
    elif q.dtype == torch.bfloat16 and not _interpreter_bf16_dot_ok():
        reasons.append(
            "bfloat16 queries under the Triton interpreter: its bf16 dot multiplies raw bit patterns (upstream "
            "triton issue 8322); use float16 or float32 queries there (a GPU is not affected)"
        )
    if q.dtype not in _Q_DTYPES:
        reasons.append(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    d, b = kv.head_dim, kv.block_size
    if not 16 <= d <= 256:
        reasons.append(f"head_dim must be in [16, 256], got {d}")
    if not (_pow2(b) and 16 <= b <= 256):
        reasons.append(f"block_size must be a power of two in [16, 256], got {b}; use block=16, 32, 64 or 128")
    for role in ROLES:
        reasons += _spec_reasons(kv.spec(role), d, role)
    if window is not None and window < 1:
        reasons.append(f"window must be a positive number of positions, got {window}")
    return reasons


# ----------------------------------------------------------------------------------------------------
# Shape checks


def check_cache(kv: PagedKV, device: torch.device) -> None:
    """Raise :class:`ShapeError` unless the view is valid (:meth:`PagedKV.check`), every tensor of it lies on
    ``device``, and its tensors are laid out as the Triton kernels read them: the last axis (head_dim, packed
    bytes, outlier channels) contiguous; any stride elsewhere. Shared by the decode and the chunk launchers; the
    query and the output are theirs to check."""
    refuse_rotated(kv)
    kv.check()
    if kv.device != device:
        raise ShapeError(f"every cache tensor must be on q's device {device}, found them on {kv.device}")
    rows = (("k_data", kv.k_data), ("v_data", kv.v_data), ("tail_k", kv.tail_k), ("tail_v", kv.tail_v),
            ("k_outlier", kv.k_outlier), ("k_outlier_idx", kv.k_outlier_idx), ("sink_k", kv.sink_k),
            ("sink_v", kv.sink_v))  # fmt: skip
    for name, t in rows:
        if t is not None and t.stride(-1) != 1:
            raise ShapeError(
                f"{name} must be contiguous in its last axis (stride 1), got strides {t.stride()}; pass .contiguous()"
            )


def check_out(q: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise :class:`ShapeError` unless ``out`` is ``None`` or q's shape, dtype and device, last axis contiguous."""
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ShapeError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}")
    if out is not None and out.stride(-1) != 1:
        raise ShapeError("out must be contiguous in its last axis")


def _check(q: torch.Tensor, kv: PagedKV, out: torch.Tensor | None) -> None:
    refuse_rotated(kv)
    batch, h, d = kv.batch, kv.kv_heads, kv.head_dim
    if q.dim() != 3 or q.shape[0] != batch or q.shape[2] != d or q.shape[1] % h:
        raise ShapeError(
            f"q must be [batch={batch}, Hq (a multiple of kv_heads={h}), head_dim={d}], got {tuple(q.shape)}"
        )
    check_cache(kv, q.device)
    check_out(q, out)


# ----------------------------------------------------------------------------------------------------
# Launch


def default_num_splits(kv: PagedKV, window: int | None = None, device: torch.device | None = None) -> int:
    """Splits per (sequence, kv head): enough programs to keep the GPU's memory busy (``PROGRAMS_PER_SM``),
    never fewer than ``MIN_BLOCKS_PER_SPLIT`` blocks per split. Uses only shapes (no device sync)."""
    device = device or kv.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    blocks = kv.block_tables.shape[1]
    if window is not None:
        blocks = min(blocks, math.ceil(window / kv.block_size) + 1)
    want = math.ceil(PROGRAMS_PER_SM * sms / max(1, kv.batch * kv.kv_heads))
    cap = max(1, blocks // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


def _scale_args(t: torch.Tensor | None, fallback: torch.Tensor) -> tuple:
    """Pointer and (block, head, token, channel) strides, 0 on axes of size 1 (shared by the granularity)."""
    if t is None:
        return (fallback, 0, 0, 0, 0)
    return (t, t.stride(0), *(t.stride(i) if t.shape[i] > 1 else 0 for i in (1, 2, 3)))


def _outlier_args(kv: PagedKV) -> tuple:
    """Residual and index pointers and strides of the outlier key channels (the payload, unread, without)."""
    if kv.k_outlier is None:
        return (kv.k_data, 0, 0, 0, kv.k_data, 0, 0)
    r, i = kv.k_outlier, kv.k_outlier_idx
    return (r, r.stride(0), r.stride(1), r.stride(2), i, i.stride(0), i.stride(1))


def _sink_args(kv: PagedKV) -> tuple:
    """Sink row pointers and (batch, head, slot) strides, and ``S`` (the tail, unread, without a sink)."""
    k, v = (kv.sink_k, kv.sink_v) if kv.sink else (kv.tail_k, kv.tail_v)
    return (k, k.stride(0), k.stride(1), k.stride(2), v, v.stride(0), v.stride(1), v.stride(2), kv.sink)


# How integer codes (and fp8 values) become numbers in the kernel (``CVT``): the float converter, or float16
# built from the bits in Triton or in inline PTX (see ``triton_kernels._codes``). PTX runs on NVIDIA GPUs only,
# never interpreted; fp8 goes through PTX only with ``"ptx"``.
CODES = {"convert": 0, "bits": 1, "ptx": 2}


def _ptx_ok() -> bool:
    """Whether kernels are built for an NVIDIA GPU (inline PTX): not interpreted, not a ROCm torch."""
    return not _kernels().INTERPRETED and torch.version.hip is None


def default_codes() -> int:
    """``CVT`` for a launch: PTX where kernels are built for an NVIDIA GPU, else the bit arithmetic."""
    return CODES["ptx"] if _ptx_ok() else CODES["bits"]


def code_dot_dtype(spec: QuantSpec, dot: Any, cvt: int) -> Any:
    """The dtype a role's sealed tiles multiply in: float16 for integer codes built as float16 and for fp8
    converted by PTX, with a 16-bit query (float16 holds every code and every fp8 value exactly and has more
    mantissa than bfloat16), else the query's dtype."""
    k = _kernels()
    integer = not spec.is_passthrough and not spec.dtype.is_fp8
    as_f16 = (integer and cvt > 0) or (spec.dtype.is_fp8 and cvt == CODES["ptx"])  # fp8 -> float16 is exact too
    return k.tl.float16 if as_f16 and dot != k.tl.float32 else dot


def group_in_f16(spec: QuantSpec, code_dot: Any, cvt: int) -> bool:
    """Whether a role's per-group dequantization runs in float16: its codes arrive as float16 (``code_dot``,
    from :func:`code_dot_dtype`, is float16) and its scales (and zeros) are stored as float16."""
    return cvt > 0 and code_dot == _kernels().tl.float16 and spec.scale_dtype is ScaleDType.FP16


def launch_config(head_dim: int, block_size: int, group: int, quantized: bool = True) -> dict[str, int]:
    """``num_warps`` and ``num_stages`` for a tile of ``block_size x head_dim``.

    Quantized tiles: 4 warps and 3 stages, within 3% of the fastest variant on an H200 for int8, fp8, int4 and
    kivi2 at batch 16 and 64, 32k (benchmarks/gpu_tune.py; 8 warps took a median 1.22x as long as 4).
    Full-precision tiles keep 8 warps for big tiles (not re-tuned).
    """
    if quantized and group <= 16:
        return {"num_warps": 4, "num_stages": 3}
    big = block_size * head_dim >= 64 * 128 or group > 16
    return {"num_warps": 8 if big else 4, "num_stages": 2}


def choose_codes(kv: PagedKV, q: torch.Tensor, codes: str | None) -> int:
    """``CVT`` for a launch over ``kv`` with query ``q``: ``codes`` (a key of :data:`CODES`), else
    :func:`default_codes`; fp8 PTX falls back to the bit arithmetic below sm_89."""
    if codes is not None and codes not in CODES:
        raise ConfigError(f"codes must be one of {sorted(CODES)}, got {codes!r}")
    if codes == "ptx" and not _ptx_ok():
        raise ConfigError("codes='ptx' runs on an NVIDIA GPU only (not interpreted, not ROCm); use 'bits'")
    cvt = default_codes() if codes is None else CODES[codes]
    fp8 = kv.format.key.dtype.is_fp8 or kv.format.value.dtype.is_fp8
    if cvt == CODES["ptx"] and fp8 and q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        cvt = CODES["bits"]  # the fp8 PTX (cvt.rn.f16x2.e4m3x2 / e5m2x2) needs sm_89: Triton's conversion instead
    return cvt


def cache_args(kv: PagedKV) -> list:
    """The kernels' arguments for the cache, in their order: pools with strides (``k_data`` .. ``v_zero``),
    outliers, block tables, ``seq_lens``, ``start_pos``, tails, sink rows and ``S``. Shared by the decode and
    the chunk kernels, whose signatures hold this run between the query and the output."""
    start = kv.start_pos if kv.start_pos is not None else kv.seq_lens  # not read without start_pos
    return [
        kv.k_data, kv.k_data.stride(0), kv.k_data.stride(1), kv.k_data.stride(2),
        *_scale_args(kv.k_scale, kv.k_data),
        *_scale_args(kv.k_zero, kv.k_data),
        kv.v_data, kv.v_data.stride(0), kv.v_data.stride(1), kv.v_data.stride(2),
        *_scale_args(kv.v_scale, kv.v_data),
        *_scale_args(kv.v_zero, kv.v_data),
        *_outlier_args(kv),
        kv.block_tables, kv.block_tables.stride(0),
        kv.seq_lens, start,
        kv.tail_k, kv.tail_k.stride(0), kv.tail_k.stride(1), kv.tail_k.stride(2),
        kv.tail_v, kv.tail_v.stride(0), kv.tail_v.stride(1), kv.tail_v.stride(2),
        *_sink_args(kv),
    ]  # fmt: skip


def cache_constexprs(kv: PagedKV, q: torch.Tensor, codes: str | None = None) -> dict[str, Any]:
    """The compile-time constants of the cache's format and features, shared by the decode and chunk kernels:
    ``K_*`` / ``V_*`` (:func:`spec_constants`), outliers, start_pos, sink, and the dot and code dtypes for
    queries of ``q.dtype`` (``codes`` as :func:`choose_codes`)."""
    k = _kernels()
    dot = {torch.float16: k.tl.float16, torch.bfloat16: k.tl.bfloat16, torch.float32: k.tl.float32}[q.dtype]
    cvt = choose_codes(kv, q, codes)
    k_cd, v_cd = code_dot_dtype(kv.format.key, dot, cvt), code_dot_dtype(kv.format.value, dot, cvt)
    h, b, d = kv.kv_heads, kv.block_size, kv.head_dim
    n_out = 0 if kv.k_outlier is None else kv.format.key.outliers
    return {
        "HAS_START": kv.start_pos is not None,
        "HAS_SINK": kv.sink > 0,
        "BLOCK_SINK": max(16, _next_pow2(kv.sink)),  # a dot operand needs 16 rows; slots past S are masked
        **{f"K_{n}": v for n, v in spec_constants(kv.format.key, h, b, d).items()},
        **{f"V_{n}": v for n, v in spec_constants(kv.format.value, h, b, d).items()},
        "N_OUT": n_out,
        "BLOCK_O": max(2, _next_pow2(n_out)),
        "REFINED": kv.format.key.refined,  # packed 4-bit refinement codes in place of fp16 residuals
        # columns of a part's tiles: a power of two (tl.arange), at least 16 (a dot operand); past d // PER they pad
        "K_DP": part_columns(kv.format.key, d),
        "V_DP": part_columns(kv.format.value, d),
        # The dot runs in q's dtype: 16-bit tensor-core operands, fp32 accumulate; integer codes built as float16
        # (exact) multiply in float16 for 16-bit queries (code_dot_dtype).
        "DOT": dot,
        "CVT": cvt,
        "K_CD": k_cd,
        "V_CD": v_cd,
        # per-group scales dequantize float16 codes in float16 when they are stored as float16
        "K_GF16": group_in_f16(kv.format.key, k_cd, cvt),
        "V_GF16": group_in_f16(kv.format.value, v_cd, cvt),
    }


@dataclass
class Launch:
    """One kernel launch, spelled out: used to run it, and to compile it ahead of time for a GPU target."""

    kernel: Any
    grid: tuple[int, ...]
    args: list
    constexprs: dict[str, Any]
    options: dict[str, int]

    def run(self) -> Any:
        """Launch; returns what Triton's launch returns (the compiled kernel: ``n_regs``, ``n_spills``)."""
        return self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def build_launches(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    codes: str | None = None,
    max_registers: int | None = None,
) -> tuple[list[Launch], torch.Tensor]:
    """Check the case and build the launches (decode, then the merge when split) and the output tensor.

    Arguments as :func:`decode_attention`. Nothing runs; :func:`compile_for_gpu` builds the same launches.
    """
    _check(q, kv, out)
    k = _kernels()
    batch, hq, d = q.shape
    h, b = kv.kv_heads, kv.block_size
    group = hq // h
    q = q if q.stride(-1) == 1 else q.contiguous()
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    splits = default_num_splits(kv, window, q.device) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ShapeError(f"num_splits must be at least 1, got {splits}")
    result = torch.empty_like(q) if out is None else out
    if splits > 1:
        acc = torch.empty(batch, hq, splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(batch, hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = result  # not read
    args = [
        q, q.stride(0), q.stride(1),
        *cache_args(kv),
        result, result.stride(0), result.stride(1),
        acc, acc.stride(0), acc.stride(1), acc.stride(2) if splits > 1 else 0,
        ml, ml.stride(0), ml.stride(1), ml.stride(2) if splits > 1 else 0,
        sm_scale * _LOG2E, 0 if window is None else int(window), splits,
    ]  # fmt: skip
    constexprs = {
        "GROUP": group,
        "BLOCK_G": max(16, _next_pow2(group)),
        "HEAD_DIM": d,
        "BLOCK_SIZE": b,
        "SPLIT": splits > 1,  # the split count itself is a runtime argument: no recompiles
        "HAS_WINDOW": window is not None,
        **cache_constexprs(kv, q, codes),
    }
    cfg = launch_config(d, b, group, not (kv.format.key.is_passthrough and kv.format.value.is_passthrough))
    opts = (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", max_registers))
    cfg.update({n: v for n, v in opts if v is not None})
    launches = [Launch(k.paged_decode_kernel, (batch, h, splits), args, constexprs, cfg)]
    if splits > 1:
        margs = [
            acc, acc.stride(0), acc.stride(1), acc.stride(2),
            ml, ml.stride(0), ml.stride(1), ml.stride(2),
            result, result.stride(0), result.stride(1),
            splits,
        ]  # fmt: skip
        mconst = {"BLOCK_S": max(2, _next_pow2(splits)), "HEAD_DIM": d, "BLOCK_D": _next_pow2(d)}
        launches.append(Launch(k.merge_splits_kernel, (batch, hq), margs, mconst, {"num_warps": 4 if d >= 128 else 2}))
    return launches, result


def compile_launch(launch: Launch, arch: int = 90) -> dict[str, Any]:
    """Compile ``launch`` ahead of time for an NVIDIA GPU of compute capability ``arch`` (90: H100/H200),
    specializing its arguments the way a real launch does; no GPU needed (Triton ships ``ptxas``).

    Returns ``{"name", "num_warps", "shared", "registers", "local", "loop_ops"}``: ``local`` (bytes of local
    memory per thread) above zero means register spills; ``loop_ops`` counts the SASS instructions of the
    longest loop (the decode kernel's block loop) by opcode with modifiers (``"LDS.U8"``, ``"HMMA.16816..."``),
    what one thread issues per block. Used by the tests to prove the kernels build for Hopper, and by
    ``benchmarks/gpu_sass.py``.
    """
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    fn = launch.kernel
    if _kernels().INTERPRETED:
        raise UnsupportedError(
            "compile_launch needs kernels built for the GPU: run it in a process without TRITON_INTERPRET=1"
        )
    names = fn.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, launch.args)):
        ty, key = native_specialize_impl(CUDABackend, value, False, True, True)
        if ty == "constexpr":  # an int equal to 1 is specialized away, as at a real launch
            constexprs[name] = value
            signature[name] = "constexpr"
        else:
            signature[name] = ty
            if key:
                attrs[(i,)] = CUDABackend.parse_attr(key)
    for name, value in launch.constexprs.items():
        constexprs[name] = value
        signature[name] = "constexpr"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    usage = {
        "name": compiled.metadata.name,
        "num_warps": compiled.metadata.num_warps,
        "shared": compiled.metadata.shared,
    }
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    for field, key in (("REG", "registers"), ("LOCAL", "local")):
        hit = [w for w in text.replace(",", " ").split() if w.startswith(field + ":")]
        usage[key] = int(hit[0].split(":")[1]) if hit else -1
    usage["loop_ops"] = _longest_loop_ops(sass)
    return usage


def _longest_loop_ops(sass: str) -> dict[str, int]:
    """Opcode counts of the instructions between the target and the source of the longest backward branch."""
    import re
    from collections import Counter

    code = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$")
    insts = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(code.match, sass.splitlines()) if m]
    best = (0, 0, -1)
    for addr, op, rest in insts:
        target = re.search(r"\b(0x[0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[0]:
            best = (addr - int(target.group(1), 16), int(target.group(1), 16), addr)
    return dict(Counter(op for addr, op, _ in insts if best[1] <= addr <= best[2]))


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    sm_scale: float | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    codes: str | None = None,
    max_registers: int | None = None,
) -> torch.Tensor:
    """Decode attention, one query per sequence, over its paged history (see ``kvpack.kernels``).

    Args:
        q: ``[batch, Hq, D]``, float16/bfloat16/float32; ``Hq`` a multiple of ``kv.kv_heads``.
        kv: the layer's :class:`PagedKV` (the query's own token already in the cache).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        window: attend only the last ``window`` positions (the query's included).
        out: optional ``[batch, Hq, D]`` buffer in ``q.dtype``.
        num_splits: splits of each sequence's blocks (default :func:`default_num_splits`).
        num_warps, num_stages: launch options (default :func:`launch_config`).
        max_registers: a cap on registers per thread (Triton's ``maxnreg``; default: the compiler's choice).
            fp8 takes 161-175 registers with 4 warps, three programs per SM; 128 allows four, without spills
            on sm_90 (``benchmarks/gpu_tune.py`` measures whether that is faster).
        codes: how integer codes and fp8 values become float16, one of :data:`CODES` (default
            :func:`default_codes`; ``"convert"`` is the plain converter, useful as a reference).

    Returns:
        ``[batch, Hq, D]`` in ``q.dtype``. A sequence with nothing to attend gets zeros.

    Raises:
        UnsupportedError: the case is outside what the kernel runs (the reasons are listed).
        ShapeError: a tensor has the wrong shape, dtype or device.
    """
    reasons = reasons_unsupported(q, kv, window)
    if reasons:
        raise UnsupportedError("the triton backend cannot run this case: " + "; ".join(reasons), reasons)
    launches, result = build_launches(
        q,
        kv,
        sm_scale,
        window,
        out,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        codes=codes,
        max_registers=max_registers,
    )
    for launch in launches:
        launch.run()
    return result


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
