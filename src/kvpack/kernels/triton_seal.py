"""The write path on the GPU: seal a batch of full tail blocks (choose scales, quantize, pack, scatter).

:func:`seal_into` writes ``n`` blocks straight into the cache pools at given block ids; :func:`seal_blocks`
returns them as a :class:`~kvpack.quant.QuantizedTensor`. The stored bytes are identical to
:func:`kvpack.quant.quantize` of the same blocks (IEEE division, ties-to-even rounding, scales rounded up
and zero-points rounded down exactly as :func:`kvpack.quant.encode_scale`), so a block sealed on the GPU
and one sealed by the torch path are interchangeable. The jit code is ``seal_kernel`` in
:mod:`kvpack.kernels.triton_kernels`; triton is imported lazily.
"""

from __future__ import annotations

import os

import torch

from kvpack.errors import NonFiniteError, ShapeError, UnsupportedError
from kvpack.formats import QuantSpec
from kvpack.kernels.lowering import scale_kind
from kvpack.kernels.triton_decode import Launch, _kernels, _pow2, _triton_error, spec_constants
from kvpack.quant import QuantizedTensor, find_non_finite, payload_torch_dtype, scale_torch_dtype

__all__ = ["reasons_unsupported", "seal_blocks", "seal_into", "seal_launch"]

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reasons_unsupported(x: torch.Tensor, spec: QuantSpec) -> list[str]:
    """Why :func:`seal_into` cannot seal ``x`` ``[n, H, B, D]`` to ``spec`` (empty list: it can)."""
    err = _triton_error()
    if err:
        return [err]
    reasons = []
    if not x.is_cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append("x is on the CPU: the Triton seal needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
        elif not _kernels().INTERPRETED:
            reasons.append("the Triton kernels were compiled for the GPU before TRITON_INTERPRET=1 was set")
    elif spec.dtype.value == "fp8_e4m3" and torch.cuda.get_device_capability(x.device) < (8, 9):
        reasons.append("fp8 e4m3 needs compute capability 8.9 or newer (Ada, Hopper)")
    if x.dim() != 4:
        return [*reasons, f"x must be [n, kv_heads, block_size, head_dim], got shape {tuple(x.shape)}"]
    if x.dtype not in _X_DTYPES:
        reasons.append(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    _, _, b, d = x.shape
    if not (_pow2(d) and d <= 256):
        reasons.append(f"head_dim must be a power of two up to 256, got {d}")
    if not (_pow2(b) and b <= 256):
        reasons.append(f"block_size must be a power of two up to 256, got {b}")
    reasons += spec.reasons_invalid(d)
    if spec.static:
        reasons.append(
            f"{spec} takes static (calibrated) scales and the Triton seal chooses block-local ones; seal it with "
            "kvpack.quant.quantize(x, spec, scale, zero) and the artifact's scales"
        )
    return reasons


def _check_finite(x: torch.Tensor) -> None:
    if bool(torch.isfinite(x).all()):
        return
    where = find_non_finite(x)
    w = where[0]
    raise NonFiniteError(
        f"non-finite value at block {w['index'][0]} of the batch, head {w['head']}, position {w['position']} "
        f"in the block, channel {w['channel']}; the model produced NaN/inf keys or values, nothing was sealed",
        where,
    )


def _check_pools(x, spec, data, scale, zero, block_ids) -> None:
    n, h, b, d = x.shape
    want = (h, b, spec.packed_head_dim(d))
    if data.dim() != 4 or tuple(data.shape[1:]) != want or data.dtype != payload_torch_dtype(spec):
        raise ShapeError(
            f"data must be [num_blocks, {h}, {b}, {want[2]}] {payload_torch_dtype(spec)} for {spec}, "
            f"got {tuple(data.shape)} {data.dtype}"
        )
    shape = spec.scale_shape(h, b, d)
    for what, t, dt, needed in (
        ("scale", scale, spec.scale_dtype, shape is not None),
        ("zero", zero, spec.zero_dtype, spec.has_zero),
    ):
        if not needed:
            continue
        if t is None or t.dim() != 4 or tuple(t.shape[1:]) != shape or t.dtype != scale_torch_dtype(dt):
            got = "None" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ShapeError(
                f"{what} must be [num_blocks, {', '.join(map(str, shape))}] {scale_torch_dtype(dt)}, got {got}"
            )
        if t.shape[0] != data.shape[0]:
            raise ShapeError(f"{what} has {t.shape[0]} blocks but data has {data.shape[0]}")
    if block_ids.dim() != 1 or block_ids.shape[0] != n or block_ids.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"block_ids must be [{n}] int32 or int64, got {tuple(block_ids.shape)} {block_ids.dtype}")
    for t in (data, scale, zero, block_ids):
        if t is not None and t.device != x.device:
            raise ShapeError(f"pools and block_ids must be on x's device {x.device}, found one on {t.device}")
        if t is not None and t.dim() == 4 and t.stride(-1) != 1:
            raise ShapeError("pools must be contiguous in their last axis")


def seal_launch(
    x: torch.Tensor,
    spec: QuantSpec,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    block_ids: torch.Tensor,
) -> Launch:
    """The seal kernel's launch for these tensors (shapes checked; nothing runs)."""
    _check_pools(x, spec, data, scale, zero, block_ids)
    k = _kernels()
    x = x if x.stride(-1) == 1 else x.contiguous()
    n, h, b, d = x.shape
    c = spec_constants(spec, h, b, d)
    hs, _, cs = spec.scale_shape(h, b, d)
    payload = {
        torch.int8: k.tl.int8,
        torch.uint8: k.tl.uint8,
        torch.float8_e4m3fn: k.tl.float8e4nv,
        torch.float8_e5m2: k.tl.float8e5,
    }[payload_torch_dtype(spec)]
    zero_t = zero if zero is not None else scale
    args = [
        x, x.stride(0), x.stride(1), x.stride(2),
        block_ids,
        data, data.stride(0), data.stride(1), data.stride(2),
        scale, scale.stride(0), scale.stride(1), scale.stride(2), scale.stride(3),
        zero_t, zero_t.stride(0), zero_t.stride(1), zero_t.stride(2), zero_t.stride(3),
    ]  # fmt: skip
    constexprs = {
        "HEADS": h // hs,
        "BLOCK_SIZE": b,
        "HEAD_DIM": d,
        "KIND": c["KIND"],
        "BITS": c["BITS"],
        "PER": c["PER"],
        "SCALE": c["SCALE"],
        "CS": cs,
        "CGROUP": c["CGROUP"],
        "SDT": int(scale_kind(spec.scale_dtype)),
        "ZDT": int(scale_kind(spec.zero_dtype)),
        "QMIN": spec.qmin if spec.dtype.is_int else 0,
        "QMAX": spec.qmax if spec.dtype.is_int else 0,
        "TOP": spec.dtype.fp8_max if spec.dtype.is_fp8 else float(spec.qmax),
        "PAYLOAD": payload,
    }
    return Launch(k.seal_kernel, (n, hs), args, constexprs, {"num_warps": 8 if b * d >= 64 * 128 else 4})


def seal_into(
    x: torch.Tensor,
    spec: QuantSpec,
    data: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    block_ids: torch.Tensor,
    *,
    check_finite: bool = True,
) -> None:
    """Seal ``n`` full blocks and write them into the pools at ``block_ids``.

    Args:
        x: ``[n, H, B, D]`` float16/bfloat16/float32: the blocks' keys or values (full tails).
        spec: the key or value spec of the cache format.
        data: payload pool ``[num_blocks, H, B, spec.packed_head_dim(D)]``, dtype
            :func:`~kvpack.quant.payload_torch_dtype`.
        scale: scale pool ``[num_blocks, Hs, Ts, Cs]`` in the spec's scale dtype (``None`` for passthrough).
        zero: zero-point pool, same shape, in ``spec.zero_dtype`` (asymmetric specs only, else ``None``).
        block_ids: ``[n]`` int32/int64 distinct block ids, on ``x``'s device.
        check_finite: refuse NaN/inf before writing anything (one device sync); turn off only when the
            caller has checked already.

    Raises:
        NonFiniteError: ``x`` holds NaN or inf (location named); the pools are untouched.
        UnsupportedError: the kernel cannot seal this case (reasons listed); use ``quant.quantize``.
        ShapeError: a pool or the ids have the wrong shape, dtype or device.
    """
    reasons = reasons_unsupported(x, spec)
    if reasons:
        raise UnsupportedError("the triton seal cannot run this case: " + "; ".join(reasons), reasons)
    if x.shape[0] == 0:
        return
    if check_finite:
        _check_finite(x)
    if spec.is_passthrough:
        _check_pools(x, spec, data, scale, zero, block_ids)
        data.index_copy_(0, block_ids.long(), x.to(data.dtype))
        return
    seal_launch(x, spec, data, scale, zero, block_ids).run()


def seal_blocks(x: torch.Tensor, spec: QuantSpec, *, check_finite: bool = True) -> QuantizedTensor:
    """Seal ``x`` ``[n, H, B, D]`` into fresh tensors: the same bytes as ``quant.quantize(x, spec)``."""
    if x.dim() != 4:
        raise ShapeError(f"x must be [n, kv_heads, block_size, head_dim], got shape {tuple(x.shape)}")
    n, h, b, d = x.shape
    data = torch.empty(n, h, b, spec.packed_head_dim(d), dtype=payload_torch_dtype(spec), device=x.device)
    shape = spec.scale_shape(h, b, d)
    scale = zero = None
    if shape is not None:
        scale = torch.empty(n, *shape, dtype=scale_torch_dtype(spec.scale_dtype), device=x.device)
        if spec.has_zero:
            zero = torch.empty(n, *shape, dtype=scale_torch_dtype(spec.zero_dtype), device=x.device)
    ids = torch.arange(n, dtype=torch.int32, device=x.device)
    seal_into(x, spec, data, scale, zero, ids, check_finite=check_finite)
    return QuantizedTensor(data, scale, zero, spec, d)
