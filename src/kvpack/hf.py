"""The Hugging Face entry point: ``kvpack.hf.cache_for(model, format="int4")``.

>>> import kvpack.hf
>>> cache = kvpack.hf.cache_for(model, format="int4")   # also switches model to attn_implementation="kvpack"
>>> out = model.generate(**inputs, cache=cache, max_new_tokens=100)
>>> cache = kvpack.hf.cache_for(model, format="fp8-o4", calibration="calib/")  # artifact: outlier channels

Importing this module imports transformers (``pip install 'kvpack[hf]'``); ``import kvpack`` alone does not.
See :mod:`kvpack.integrations.transformers` for how it plugs in.
"""

from kvpack.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    KVPackCache,
    cache_for,
    register,
)
from kvpack.models import load_model

__all__ = ["ATTN_IMPLEMENTATION", "KVPackCache", "cache_for", "load_model", "register"]
