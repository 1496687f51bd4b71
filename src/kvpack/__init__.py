"""kvpack: a quantized, paged KV cache read inside fused attention kernels.

Importing kvpack is light: torch is imported, but never triton, transformers, numba or matplotlib, and
CUDA is never initialized. Heavy parts load when first used.
"""

from kvpack.errors import KVPackError
from kvpack.formats import PRESETS, KVFormat, QuantSpec, parse_format

__version__ = "0.1.0"

__all__ = ["PRESETS", "KVFormat", "KVPackError", "QuantSpec", "__version__", "parse_format"]
