"""Formats on a stress model with biased keys (the feature of the Qwen2 family), through kvpack's own cache.

The stress model is the embedded SmolLM2-135M with a ``k_proj`` bias planted (:func:`kvpack.models.stress.add_key_bias`:
three constant channels per kv head, 60x the key std in layer 0 and 15x elsewhere, where the queries look least).
Teacher-forced KL against the same model's full-precision cache, 512 tokens of prose in chunks of 128.

Measured (2-core box, this commit's kernels): fp8 2.0e-3, fp8-plain 1.2e-2, the former fp8 preset (per-head scale,
rotated, not centred) 1.6e-2, int8 2.1e-4, int4 2.3e-2. The bounds leave ~2x room; the ordering is the point:
the fp8 preset must never be worse than plain e4m3, and rotation without centring was (and was catastrophic on a
real biased model: mean KL 0.70 against plain's 0.013).
"""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from kvpack.evaluation.fidelity import teacher_forced
from kvpack.evaluation.runner import Runner, load
from kvpack.models.stress import add_key_bias

pytestmark = pytest.mark.slow

FORMATS = ["fp8", "fp8-plain", "k=fp8:head:rot,v=fp8:head,sink=1", "int8", "int4"]


@pytest.fixture(scope="module")
def biased():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    lm = load(None)
    ids = lm.tokenizer(" ".join(pydoc_data.topics.topics.values()))["input_ids"]
    planted = add_key_bias(lm.model, ids[:256])
    yield lm, ids[5000:5512], planted
    torch.set_num_threads(n)


def test_the_planted_bias_is_what_biased_families_have(biased):
    lm, _, planted = biased
    cfg = lm.model.config
    assert len(planted.channels) == cfg.num_hidden_layers
    assert all(len(heads) == cfg.num_key_value_heads and all(len(c) == 3 for c in heads) for heads in planted.channels)
    assert planted.largest[0] > 40 * planted.key_std[0]  # layer 0 strongest, as in Qwen2
    assert all(b > 10 * s for b, s in zip(planted.largest[1:], planted.key_std[1:]))


def test_fp8_holds_on_biased_keys_and_is_never_worse_than_plain_e4m3(biased):
    lm, doc, _ = biased
    r = Runner(lm, engine="kvpack")
    res = teacher_forced(r.forward, doc, r.cache(None, 1024), {f: r.cache(f, 1024) for f in FORMATS}, chunk=128)
    kl = {f: float(x.kl.mean()) for f, x in res.items()}
    assert kl["fp8"] <= 5e-3, kl
    assert kl["fp8"] <= 0.5 * kl["fp8-plain"], kl
    assert kl["k=fp8:head:rot,v=fp8:head,sink=1"] > kl["fp8"] * 3, kl  # the cause: rotation alone spreads the offset
    assert kl["int8"] <= 1e-3, kl
    assert kl["int4"] <= 5e-2, kl
    assert float(res["fp8"].agree.mean()) >= 0.95
