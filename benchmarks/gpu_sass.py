"""What one thread of the Triton decode kernel issues per cache block on Hopper (sm_90), without a GPU.

    python benchmarks/gpu_sass.py                      # presets x codes, fp16 queries
    python benchmarks/gpu_sass.py --formats int8 fp8-plain --codes ptx convert --q-dtype bfloat16

Compiles the decode kernel ahead of time with Triton's own ``ptxas`` (``triton_decode.compile_launch``) for a
Llama-3-8B layer (32 query / 8 kv heads, head_dim 128, block 64) and counts the SASS instructions of its block
loop. On an H200 the quantized kernels were issue-bound (docs/performance.md, "GPU (Triton)"): the loop's
length tracked the measured time across formats, so this count is the cheap first check of a kernel change.
Columns: registers per thread, shared memory, loop instructions, byte-wise shared loads (``LDS.U8`` /
``LDS.S8``: 8-bit tiles gathered into the dot operand layout), converter instructions (``I2F``, ``F2F``,
``F2FP``), tensor-core ``HMMA``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU, never interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from kvpack.formats import parse_format
from kvpack.kernels import triton_decode as td
from kvpack.testing import random_paged_kv


def loop_row(name: str, codes: str, q_dtype: torch.dtype, head_dim: int = 128) -> dict:
    """Compile the decode kernel for one preset and codes; summarize its block loop."""
    fmt = parse_format(name)
    kv, _, _ = random_paged_kv(fmt, [300, 70], kv_heads=8, head_dim=head_dim, tail_dtype=q_dtype)
    if fmt.key.rotate:  # a fused backend gets the rotated query and an unrotated view (kernels.run_backend)
        kv = replace(kv, key_rotation=None)
    q = torch.randn(2, 32, head_dim, dtype=q_dtype)
    usage = td.compile_launch(td.build_launches(q, kv, num_splits=2, codes=codes)[0][0])
    ops = usage.pop("loop_ops")

    def count(*prefixes: str) -> int:
        return sum(n for op, n in ops.items() if op.split(".")[0] in prefixes)

    return {
        "format": name,
        "codes": codes,
        **usage,
        "loop": sum(ops.values()),
        "byte_lds": sum(n for op, n in ops.items() if op.startswith(("LDS.U8", "LDS.S8"))),
        "converts": count("I2F", "I2FP", "F2F", "F2FP"),
        "hmma": count("HMMA"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", nargs="+", default=["fp16", "int8", "fp8-plain", "fp8-o4", "int4", "k8v4", "kivi2"])
    p.add_argument("--codes", nargs="+", default=["ptx", "bits", "convert"], choices=sorted(td.CODES))
    p.add_argument("--q-dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--head-dim", type=int, default=128, help="head_dim (default 128; 80 or 96 pad the tiles)")
    args = p.parse_args(argv)
    q_dtype = getattr(torch, args.q_dtype)
    head = f"{'format':<10} {'codes':<8} {'regs':>5} {'shared':>7} {'loop':>5} {'LDS.U8':>7} {'cvt':>5} {'HMMA':>5}"
    print(head)
    print("-" * len(head))
    for name in args.formats:
        for codes in args.codes:
            r = loop_row(name, codes, q_dtype, args.head_dim)
            print(f"{name:<10} {codes:<8} {r['registers']:>5} {r['shared']:>7} {r['loop']:>5} {r['byte_lds']:>7} "
                  f"{r['converts']:>5} {r['hmma']:>5}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
