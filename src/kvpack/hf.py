"""The Hugging Face entry point: ``kvpack.hf.cache_for(model, format="int4")``.

>>> import kvpack.hf
>>> cache = kvpack.hf.cache_for(model, format="int4")   # also switches model to attn_implementation="kvpack"
>>> out = model.generate(**inputs, cache=cache, max_new_tokens=100)   # past_key_values=cache before 5.24
>>> out = model.generate(**inputs, **{kvpack.hf.cache_kwarg(model): cache})  # either transformers version
>>> cache = kvpack.hf.cache_for(model, format="fp8-o4", calibration="calib/")  # artifact: outlier channels

Importing this module imports transformers (``pip install 'kvpack[hf]'``); ``import kvpack`` alone does not.
See :mod:`kvpack.integrations.transformers` for how it plugs in.
"""

from kvpack.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    KVPackCache,
    cache_for,
    cache_kwarg,
    register,
)
from kvpack.models import load_model

__all__ = ["ATTN_IMPLEMENTATION", "KVPackCache", "cache_for", "cache_kwarg", "load_model", "register"]
