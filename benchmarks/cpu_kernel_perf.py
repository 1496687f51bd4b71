"""Profile the CPU decode kernel with Linux ``perf``, with the compiled helpers named.

numba's JIT code lives in anonymous memory, so ``perf report`` shows it as unknown addresses. This script
runs the kernel (one format, 32k context, batch 4, 32 q / 8 kv heads, head_dim 128, one thread by
default) for a while and writes ``/tmp/perf-<pid>.map`` (the file ``perf`` reads for JIT code): the
kernel's cached ``.nbc`` file holds the compiled object code, whose symbol table gives each helper's
offset and size, and the runtime address of ``launch_one`` anchors them. It also leaves the object file at
``/tmp/kvpack_work.o`` and the anchor at ``/tmp/kvpack_work.base`` for instruction-level digging
(``objdump -d --start-address=...``)::

    perf record -F 4999 -o p.data python benchmarks/cpu_kernel_perf.py --format int8 --seconds 10
    perf report -i p.data --sort sym --stdio | head -30

Needs ``nm`` (binutils) and a kernel compiled into the on-disk cache (any earlier call compiles it).
"""

from __future__ import annotations

import argparse
import glob
import os
import pickle
import subprocess
import time

import torch

from kvpack.bench.decode import add_case_options, case_from_options
from kvpack.kernels import decode_attention


def _elf(x, depth: int = 0) -> bytes | None:
    """The first ELF object inside an unpickled numba cache entry."""
    if depth > 12:
        return None
    if isinstance(x, bytes) and x[:4] == b"\x7fELF":
        return x
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for y in items:
        found = _elf(y, depth + 1)
        if found:
            return found
    return None


def _short(name: str) -> str:
    """``_ZN6kvpack7kernels16cpu_decode_numba7_attendB3v25...`` -> ``_attend``."""
    key = "cpu_decode_numba"
    if key not in name:
        return name
    i = name.index(key) + len(key)
    j = i
    while j < len(name) and name[j].isdigit():
        j += 1
    return name[j : j + int(name[i:j])] if j > i else name


def write_perf_map() -> int:
    """Write ``/tmp/perf-<pid>.map`` for the kernel's compiled library; returns the number of symbols."""
    import kvpack.kernels.cpu_decode_numba as nbm

    (_, cres), *_ = nbm.launch_one.overloads.items()
    base = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    line = nbm.launch_one.py_func.__code__.co_firstlineno
    pattern = os.path.join(os.path.dirname(nbm.__file__), "__pycache__", f"cpu_decode_numba.launch_one-{line}.py*.nbc")
    files = sorted(glob.glob(pattern), key=os.path.getmtime)
    if not files:
        raise SystemExit(f"no cached kernel at {pattern}: run the kernel once with the disk cache enabled")
    with open(files[-1], "rb") as fh:
        obj = _elf(pickle.loads(fh.read()))
    with open("/tmp/kvpack_work.o", "wb") as fh:
        fh.write(obj)
    with open("/tmp/kvpack_work.base", "w") as fh:
        fh.write(hex(base))
    rows = []
    for entry in subprocess.run(["nm", "-S", "/tmp/kvpack_work.o"], capture_output=True, text=True).stdout.splitlines():
        parts = entry.split()
        if len(parts) == 4 and parts[2] in "tTwW":  # the entry sits at offset 0 of its section
            rows.append((base + int(parts[0], 16), int(parts[1], 16), _short(parts[3])))
    with open(f"/tmp/perf-{os.getpid()}.map", "w") as fh:
        for addr, size, name in rows:
            fh.write(f"{addr:x} {size:x} {name}\n")
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    add_case_options(ap, threads=1)  # --hot-blocks: the compute alone, a few blocks read over and over
    args = ap.parse_args()
    case, kv = case_from_options(args)
    out = torch.empty_like(case.q)

    def step() -> None:
        decode_attention(case.q, kv, backend="cpu", out=out)

    step()
    step()
    print(f"{write_perf_map()} symbols in /tmp/perf-{os.getpid()}.map")
    t, calls = time.perf_counter(), 0
    while time.perf_counter() - t < args.seconds:
        step()
        calls += 1
    print(f"{calls} calls, {(time.perf_counter() - t) / calls * 1e3:.2f} ms each")


if __name__ == "__main__":
    main()
