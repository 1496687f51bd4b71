"""Formats on a stress model with biased keys (the feature of the Qwen2 family) and on Gemma 3 270M (one kv head of
head_dim 256), through kvpack's own cache.

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

from _models import installed_model
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


# --- Gemma 3 270M: one kv head of head_dim 256, QK-norm, sliding windows (the registered test model that
# `make install` installs), where every preset was weakest: its own full-precision cache against each format over
# two 512-token windows of prose, pooled.

# Measured (one thread, commit 8546df3, an AMD EPYC VM): fp8 1.6e-2, fp8-plain 3.0e-2, int8 6.7e-4 (values without
# zero-points 1.07e-3), int4 8.1e-2, k8v4 2.3e-2. fp8 and int4 miss their targets here (5e-3, 2e-2; docs/quality.md says why);
# the bounds pin where they stand with ~2x room, so that a change making them worse fails.
FP8_GEMMA_BOUND, INT4_GEMMA_BOUND = 3e-2, 0.16
GEMMA_FORMATS = ["fp8", "fp8-plain", "int8", "k=int8:channel:asym,v=int8:token,sink=1", "int4", "k8v4"]


@pytest.fixture(scope="module")
def gemma_kl():
    installed_model("gemma3-270m")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm = load("gemma3-270m")
        ids = lm.tokenizer(" ".join(pydoc_data.topics.topics.values()))["input_ids"]
        r = Runner(lm, engine="kvpack")
        kl: dict[str, list[torch.Tensor]] = {f: [] for f in GEMMA_FORMATS}
        for off in (5000, 21000):
            doc = ids[off : off + 512]
            caches = {f: r.cache(f, 576) for f in GEMMA_FORMATS}
            for f, x in teacher_forced(r.forward, doc, r.cache(None, 576), caches, chunk=128).items():
                kl[f].append(x.kl.flatten())
    finally:
        torch.set_num_threads(n)
    return {f: float(torch.cat(v).mean()) for f, v in kl.items()}


def test_int8_holds_on_gemma3_where_its_values_carry_offsets(gemma_kl):
    kl = gemma_kl
    assert kl["int8"] <= 1e-3, kl  # the target
    # The values' zero-points: on these two windows 6.7e-4 against 1.07e-3 without them on an AMD EPYC VM, but
    # 7.2e-4 against 7.3e-4 on an Intel Xeon one (AVX-512 FP16, AMX). Why the machines differ is not known (the
    # per-token KL is heavy-tailed: its five largest tokens carry a tenth of the mean). What holds on both: they
    # never cost.
    assert kl["int8"] <= 1.1 * kl["k=int8:channel:asym,v=int8:token,sink=1"], kl


def test_fp8_and_int4_on_gemma3_are_pinned_where_they_stand(gemma_kl):
    kl = gemma_kl
    assert kl["fp8"] <= kl["fp8-plain"], kl  # never worse than plain e4m3
    assert kl["fp8"] <= FP8_GEMMA_BOUND, kl  # misses the 5e-3 target: e4m3's relative error (docs/quality.md)
    assert kl["int4"] <= INT4_GEMMA_BOUND, kl  # misses the 2e-2 target at 4.75 bits
    assert kl["k8v4"] < 0.5 * kl["int4"], kl  # the keys carry int4's error here
