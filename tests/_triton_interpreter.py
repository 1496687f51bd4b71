"""Test set-up for the Triton interpreter: correct two known emulation defects (upstream triton issue 8322).

The interpreter (TRITON_INTERPRET=1) emulates casts and dots in numpy, and two of them differ from the GPU:

* float32/float16 -> bfloat16 and -> fp8 down-casts: bf16 is truncated instead of rounded to nearest even,
  and the fp8 rounding carry is OR-ed into the exponent (errors up to 50%);
* ``tl.dot`` on bfloat16 operands multiplies their raw uint16 bit patterns.

A GPU rounds to nearest even (``cvt.rn``) and multiplies bf16 values, so the kernels are right and the
emulation is wrong. :func:`fixed_interpreter` swaps in conversions done by torch (round to nearest even,
as the GPU) for the duration of a test; the kernels themselves are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def fixed_interpreter() -> Iterator[None]:
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as interp

    convert, dot = interp._convert_float, interp.InterpreterBuilder.create_dot
    targets = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.bfloat16: torch.bfloat16}
    sources = {tl.float32: np.float32, tl.float16: np.float16}

    def fixed_convert(data, src, dst, rounding_mode):
        if dst in targets and src in sources and rounding_mode != ir.ROUNDING_MODE.RTZ:
            x = torch.from_numpy(np.ascontiguousarray(data).view(sources[src]).copy())
            out = x.to(targets[dst])
            if out.element_size() == 1:
                return out.view(torch.uint8).numpy().reshape(data.shape)
            return out.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return convert(data, src, dst, rounding_mode)

    def bf16_values(h):
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data

    def fixed_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            res = np.matmul(bf16_values(a), bf16_values(b), dtype=d.data.dtype) + d.data
            return interp.TensorHandle(res, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interp._convert_float = fixed_convert
    interp.InterpreterBuilder.create_dot = fixed_dot
    try:
        yield
    finally:
        interp._convert_float = convert
        interp.InterpreterBuilder.create_dot = dot


@contextlib.contextmanager
def stock_interpreter() -> Iterator[None]:
    """Undo :func:`fixed_interpreter` inside a test that wants the interpreter as shipped."""
    from triton.runtime import interpreter as interp

    convert, dot = interp._convert_float, interp.InterpreterBuilder.create_dot
    interp._convert_float, interp.InterpreterBuilder.create_dot = _STOCK[0], _STOCK[1]
    try:
        yield
    finally:
        interp._convert_float, interp.InterpreterBuilder.create_dot = convert, dot


def _stock():
    from triton.runtime import interpreter as interp

    return interp._convert_float, interp.InterpreterBuilder.create_dot


_STOCK = _stock()  # captured at import, before any patch
