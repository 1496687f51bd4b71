"""`import kvpack` stays light: no triton, transformers, numba, matplotlib, quanto or hqq, and CUDA untouched."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["triton", "transformers", "numba", "matplotlib", "vllm", "optimum", "hqq"]

PROBE = """
import json, sys
import kvpack, kvpack.formats, kvpack.quant, kvpack.kernels, kvpack.cli.main
import kvpack.sizing, kvpack.modelspecs, kvpack.cli.size_cmd, kvpack.bench.peers
import kvpack.cli.main as cli
cli.build_parser()  # every subcommand's add_parser runs: it must stay light too
import torch
print(json.dumps({
    "heavy": [m for m in %r if m in sys.modules],
    "cuda_initialized": torch.cuda.is_initialized(),
}))
"""


def _probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_kvpack_is_lean() -> None:
    result = _probe(PROBE % (HEAVY,))
    assert result["heavy"] == [], f"imported at module level: {result['heavy']}"
    assert result["cuda_initialized"] is False


def test_kvpack_size_does_not_import_torch() -> None:
    # the CLI's sizing path is pure Python, so `kvpack size` starts fast
    code = """
import json, sys
from kvpack.cli.main import main
import io, contextlib
with contextlib.redirect_stdout(io.StringIO()):
    main(["size", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--context", "8k"])
print(json.dumps({"torch": "torch" in sys.modules}))
"""
    assert _probe(code) == {"torch": False}


def test_heavy_packages_are_installed() -> None:
    # otherwise the lean-import check would pass vacuously
    import importlib.util

    assert [m for m in HEAVY if importlib.util.find_spec(m) is None] == []
