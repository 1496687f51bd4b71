"""Bad values refused at their cause with a typed error that says how to fix them (not replaced, not rounded)."""

from __future__ import annotations

import pytest
import torch

from kvpack.calibration import Artifact, KVObserver, fingerprint_from_config
from kvpack.errors import CalibrationError, ConfigError, KVPackError
from kvpack.integrations.export import vllm_scales
from kvpack.modelspecs import shape_from_config
from kvpack.sizing import parse_count

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 64, "head_dim": 16, "vocab_size": 50}  # fmt: skip


def _artifact() -> Artifact:
    obs = KVObserver(())
    for layer in range(2):
        obs.observe(layer, torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    return Artifact.build(*obs.stats(), "k=int8:channel:static,v=int8:token", fingerprint_from_config(CONFIG), {})


@pytest.mark.parametrize("bad, reason", [(float("inf"), "no finite fp8 scale"), (float("nan"), "no finite fp8 scale")])
def test_export_refuses_a_non_finite_range_for_what_it_is(bad, reason):
    art = _artifact()
    art.keys.absmax[1, 0, 3] = bad
    with pytest.raises(CalibrationError, match=reason) as e:
        vllm_scales(art)
    assert "layer 1" in str(e.value) and "was zero" not in str(e.value)


@pytest.mark.parametrize("field, value", [("num_key_value_heads", 0), ("num_hidden_layers", "abc"),
                                          ("head_dim", -1), ("hidden_size", 2.5), ("num_attention_heads", True)])  # fmt: skip
def test_config_sizes_that_are_not_positive_integers_are_refused_naming_the_field(field, value):
    cfg = {**CONFIG, field: value}
    for read in (fingerprint_from_config, shape_from_config):
        with pytest.raises(ConfigError, match=field):
            read(cfg)
    cfg[field] = None  # null is "not given": kv heads default to the attention heads
    if field == "num_key_value_heads":
        assert fingerprint_from_config(cfg)["kv_heads"] == 4 and shape_from_config(cfg).kv_heads == 4


def test_counts_are_exact_and_bounded():
    assert parse_count("1099511627776") == 2**40
    assert parse_count("1.5k") == 1536
    for bad in ("99999999999999999999999", "1099511627777", "inf", "1e400", "nan", "0.3"):
        with pytest.raises(KVPackError):
            parse_count(bad)


@pytest.mark.parametrize("bad", ["abc", 0, -3, 2.5, True])
def test_cache_for_refuses_a_max_tokens_that_is_not_a_positive_integer(bad):
    transformers = pytest.importorskip("transformers")
    from kvpack.integrations.transformers import KVPackCache

    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=64, head_dim=16, vocab_size=50)  # fmt: skip
    with pytest.raises(ConfigError, match="max_tokens must be a positive integer"):
        KVPackCache(cfg, "int8", max_tokens=bad)
    assert KVPackCache(cfg, "int8", max_tokens=64).max_tokens == 64
