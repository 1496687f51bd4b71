"""The transformers integration on tiny random models built locally (no download).

Architectures: Llama (GQA 4:2, head_dim 64), Qwen2 (MQA 4:1, head_dim 64), Mistral (sliding window on every
layer, head_dim 128), Gemma 3 (5 of 6 layers sliding, head_dim 256), and more families through ``AutoConfig``
(``tests/_families.py``: QK-norm, fused QKV, partial rotary, learned positions, parallel attention, Phi-2's head_dim
80, ...). Random models are chaotic (near-flat logits), so exact token agreement is checked with the
full-precision passthrough format, and int8 with a bound on the logit difference under teacher forcing.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import kvpack.hf
import kvpack.kernels
from _families import build_family
from kvpack import kernels
from kvpack.errors import ConfigError, PoolExhaustedError, UnsupportedError
from kvpack.formats import parse_format
from kvpack.integrations import transformers as kt
from kvpack.kernels.reference import paged_attention_reference
from kvpack.testing import CPU_CHUNK_TOL, assert_close, random_paged_kv

VOCAB = 256
NEW = 64
EXACT = "kv=fp32"  # passthrough at the model's precision: must reproduce DynamicCache exactly
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**_COMMON, head_dim=64)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**{**_COMMON, "num_key_value_heads": 1}, head_dim=64)).eval()
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**_COMMON, head_dim=128, sliding_window=48)).eval()
    if arch == "gemma3":
        cfg = Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1},
            head_dim=256,
            sliding_window=40,
            query_pre_attn_scalar=256,
        )
        assert cfg.layer_types.count("sliding_attention") == 5
        return Gemma3ForCausalLM(cfg).eval()
    if arch in HF_FAMILIES:
        return build_family(arch, _COMMON)
    raise ValueError(arch)


# families through AutoConfig (tests/_families.py); the ones attending in their own code are refused below
HF_FAMILIES = [
    "qwen3", "phi3", "phi", "gpt_neox", "gpt2", "stablelm", "cohere", "olmo2", "starcoder2", "granite",
]  # fmt: skip


ARCHS = ["llama", "qwen2", "mistral", "gemma3", *HF_FAMILIES]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core box two threads per op
    stall on each other: run this module on one, then restore."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {a: _build(a) for a in ARCHS}


@pytest.fixture(autouse=True)
def _restore_attention(models):
    yield
    for m in models.values():
        m.set_attn_implementation("sdpa")


def _batch(prompt_len: int = 70, pad: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by ``pad`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _layers(model) -> int:
    return model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_dynamic_cache(models, arch):
    model = models[arch]
    ids, mask = _batch()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    cache = kvpack.hf.cache_for(model, EXACT, batch_size=2)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **{kt.cache_kwarg(model): cache}
    )
    assert torch.equal(out, ref)
    # every decode step of every layer ran the fused kernel, none the reference
    assert cache.fused_decode_calls == (NEW - 1) * _layers(model)
    assert set(cache.decode_backends) == {"cpu"}
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1


def _teacher_forced_logits(model, cache, seq: torch.Tensor, mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits predicting tokens ``prompt_len..`` of ``seq``: prefill the prompt, then one token per step."""
    kw = {kt.cache_kwarg(model): cache}
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row (learned positions see it)
    out = model(
        input_ids=seq[:, :prompt_len], attention_mask=mask[:, :prompt_len], position_ids=pos[:, :prompt_len], **kw
    )
    logits = [out.logits[:, -1]]
    for i in range(prompt_len, seq.shape[1] - 1):
        out = model(input_ids=seq[:, i : i + 1], attention_mask=mask[:, : i + 1], position_ids=pos[:, i : i + 1], **kw)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_int8_logits_track_full_precision(models, arch):
    model = models[arch]
    ids, mask = _batch()
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    full_mask = torch.cat([mask, torch.ones(2, NEW, dtype=mask.dtype)], 1)
    ref_logits = torch.stack(ref.logits, 1)  # [2, NEW, vocab]
    cache = kvpack.hf.cache_for(model, "int8", batch_size=2)
    logits = _teacher_forced_logits(model, cache, ref.sequences, full_mask, ids.shape[1])
    diff = (logits - ref_logits).abs().max().item()
    spread = ref_logits.std().item()
    assert 0 < diff < 0.1 * spread, (diff, spread)  # quantized (not bit-identical), yet close
    assert cache.fused_decode_calls == (NEW - 1) * _layers(model)


@torch.inference_mode()
def test_fused_and_reference_decode_agree(models, monkeypatch):
    # both prefill through the same dequantize-then-SDPA chunk path, so only the decode kernels differ
    import kvpack.integrations.hf_attention as hfa

    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)
    model = models["gemma3"]
    ids, mask = _batch(prompt_len=100)
    seq = torch.cat([ids, torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))], 1)
    full = torch.cat([mask, torch.ones(2, 20, dtype=mask.dtype)], 1)
    fused = kvpack.hf.cache_for(model, "int8", batch_size=2)
    a = _teacher_forced_logits(model, fused, seq, full, ids.shape[1])
    ref = kvpack.hf.cache_for(model, "int8", batch_size=2, backend="reference")
    b = _teacher_forced_logits(model, ref, seq, full, ids.shape[1])
    assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert fused.fused_decode_calls == 19 * 6 and ref.fused_decode_calls == 0
    assert ref.decode_backends == {"reference": 19 * 6}


@pytest.mark.parametrize("fmt", ["int8", "int4", "k8v4", "fp16"])
@pytest.mark.parametrize("window", [None, 50])
def test_chunk_attention_matches_reference(fmt, window):
    kv, _, _ = random_paged_kv(parse_format(fmt), [150, 97, 64], kv_heads=2, head_dim=64)
    kv = dataclasses.replace(kv, start_pos=torch.tensor([0, 7, 3], dtype=torch.int32))
    q = torch.randn(3, 40, 6, 64)  # the last 40 positions, GQA 3:1
    expected = paged_attention_reference(q, kv, 0.125, window)
    # the dequantize-then-SDPA fallback: summation order only
    assert_close(kt.chunk_attention(q, kv, 0.125, window, "reference"), expected, atol=1e-5, rtol=1e-5)
    # the default: the fused chunk kernel
    assert kvpack.kernels.choose_backend(q, kv, window, "auto", chunk=True) == "cpu"
    assert_close(kt.chunk_attention(q, kv, 0.125, window), expected, *CPU_CHUNK_TOL)


@torch.inference_mode()
def test_question_after_cached_document_reads_the_quantized_history(models):
    """A document prefilled in one call, then a question: the same logits as one long prefill."""
    model = models["llama"]
    g = torch.Generator().manual_seed(3)
    doc, question = torch.randint(0, VOCAB, (1, 150), generator=g), torch.randint(0, VOCAB, (1, 30), generator=g)
    one = kvpack.hf.cache_for(model, "int4")
    whole = model(input_ids=torch.cat([doc, question], 1), **{kt.cache_kwarg(model): one}).logits[:, -30:]
    two = kvpack.hf.cache_for(model, "int4")
    model(input_ids=doc, **{kt.cache_kwarg(model): two})
    later = model(input_ids=question, **{kt.cache_kwarg(model): two}).logits
    assert_close(later, whole, atol=1e-4, rtol=1e-4)
    # and the quantized history does matter: a full-precision cache gives other logits
    dense = model.set_attn_implementation("sdpa") or model(input_ids=torch.cat([doc, question], 1)).logits[:, -30:]
    assert (dense - whole).abs().max() > 1e-3


def test_beam_search_fp16_matches_dynamic_cache_and_shares_blocks(models):
    model = _build("llama").to(torch.float16)
    ids, mask = _batch(prompt_len=70)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, num_beams=3, do_sample=False)
    cache = kvpack.hf.cache_for(model, "fp16", batch_size=6)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=40,
        num_beams=3,
        do_sample=False,
        **{kt.cache_kwarg(model): cache},
    )
    assert torch.equal(out, ref)
    report = cache.memory_report()
    assert report.total.shared_bytes > 0  # beams reference the prompt's sealed block instead of copying it
    assert report.used_blocks < report.sequences * 2  # 6 rows x 2 sealed blocks each, stored fewer times
    assert cache.paged.problems() == []


def test_reorder_shares_sealed_blocks_without_copies(models):
    model = models["qwen2"]
    cache = kvpack.hf.cache_for(model, "int8", batch_size=3)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, VOCAB, (3, 130)), **{kt.cache_kwarg(model): cache})
    before = cache.memory_report().used_blocks
    free_before = cache.paged.pool.num_free
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    # nothing allocated or copied: row 1's two blocks are released, row 2's are now referenced twice
    assert cache.paged.pool.num_free == free_before + 2
    assert cache.memory_report().used_blocks == before - 2
    k2, _ = cache.paged.dense(0, cache.seq_ids[0])
    k1, _ = cache.paged.dense(0, cache.seq_ids[1])
    assert torch.equal(k1, k2)
    cache.batch_select_indices(torch.tensor([0, 2]))
    cache.batch_repeat_interleave(2)
    assert len(cache.seq_ids) == 4 and cache.paged.problems() == []


def test_assisted_generation_crops_and_matches_fp16(monkeypatch):
    # the subject is the rollback of rejected drafts, so the verification chunks take the exact dequantize-then-SDPA
    # path (the fused chunk kernel rounds weights and values to bf16, which may flip a greedy token)
    import kvpack.integrations.hf_attention as hfa

    monkeypatch.setattr(hfa, "_chunk_backend", lambda *a: None)
    model = _build("llama").to(torch.float16)
    torch.manual_seed(1)
    assistant = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_hidden_layers": 1})).eval().to(torch.float16)
    ids = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(4))
    ref = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)
    cache = kvpack.hf.cache_for(model, "fp16")
    crops = []
    real_crop = cache.crop
    cache.crop = lambda n: (crops.append(n), real_crop(n))[1]
    out = model.generate(
        input_ids=ids, max_new_tokens=NEW, do_sample=False, **{kt.cache_kwarg(model): cache}, assistant_model=assistant
    )
    assert torch.equal(out, ref)
    assert sum(n < 0 for n in crops) > 10  # rejected draft tokens were rolled back, across the block boundary
    assert cache.fused_position_calls > 0  # candidates inside the tail: one fused decode call a layer
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.paged.problems() == []


@torch.inference_mode()
def test_a_few_new_tokens_in_the_tail_are_one_fused_decode_call(models):
    """Assisted generation's candidates: a few new tokens that all lie in the tail go through the CPU decode kernel
    once, the positions as query heads; the logits are DynamicCache's, left padding included."""
    model = models["llama"]
    ids, mask = _batch(prompt_len=74)
    cache = kvpack.hf.cache_for(model, EXACT, batch_size=2)
    model(input_ids=ids[:, :70], attention_mask=mask[:, :70], **{kt.cache_kwarg(model): cache})
    got = model(input_ids=ids[:, 70:], attention_mask=mask, **{kt.cache_kwarg(model): cache}).logits
    assert cache.fused_position_calls == _layers(model) == cache.chunk_calls  # the prompt took the chunk path
    dense = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    expected = model(input_ids=ids, attention_mask=mask, **{kt.cache_kwarg(model): dense}).logits[:, 70:]
    assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_crop_back_into_a_sealed_block(models):
    model = models["mistral"]
    ids = torch.randint(0, VOCAB, (1, 70), generator=torch.Generator().manual_seed(5))
    cache = kvpack.hf.cache_for(model, EXACT)
    model(input_ids=ids, **{kt.cache_kwarg(model): cache})
    cache.crop(-10)  # 70 -> 60 tokens: block 0 (tokens 0..63) returns to the tail
    assert cache.get_seq_length() == 60
    cont = model(input_ids=ids[:, 60:], **{kt.cache_kwarg(model): cache}).logits
    dense = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    expected = model(input_ids=ids, **{kt.cache_kwarg(model): dense}).logits[:, 60:]
    assert_close(cont, expected, atol=1e-5, rtol=1e-5)


def test_sampling_matches_dynamic_cache(models):
    model = models["qwen2"]
    ids, mask = _batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20)
    torch.manual_seed(7)
    ref = model.generate(**kwargs)
    cache = kvpack.hf.cache_for(model, EXACT, batch_size=2)
    torch.manual_seed(7)
    assert torch.equal(model.generate(**kwargs, **{kt.cache_kwarg(model): cache}), ref)


def test_nothing_full_precision_beyond_the_tail(models):
    model = models["llama"]
    ids, mask = _batch(prompt_len=150)
    cache = kvpack.hf.cache_for(model, "int4", batch_size=2)
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **{kt.cache_kwarg(model): cache}
    )
    report = cache.memory_report()
    t, fmt = report.total, cache.format
    tail_slot = fmt.tail_bytes(cache.kv_heads, cache.head_dim, tail_element_bytes=4)  # fp32 model -> fp32 tail
    assert t.tail_bytes == 2 * _layers(model) * tail_slot  # one block of full precision per sequence and layer
    assert t.payload_bytes + t.scale_bytes == report.used_blocks * _layers(model) * fmt.block_bytes(2, 64)
    assert t.used_bytes == t.theoretical_bytes  # exactly what KVFormat.bytes_for_tokens predicts
    # and the transformers side keeps no dense copy
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    s = cache.bytes_summary()
    assert s["fp16_bytes"] == 2 * 2 * 64 * 2 * 2 * 169 * _layers(model)  # K+V, kv_heads, D, fp16, rows, tokens
    assert s["used_bytes"] < s["fp16_bytes"]


def test_cache_kwarg_names_the_keyword_every_level_takes(models):
    """``cache`` from transformers 5.24, ``past_key_values`` before: read from the signatures, and the same
    name for the causal LM, its base model and an attention module (which receives the cache from its layer)."""
    model = models["llama"]
    name = kt.cache_kwarg(model)
    assert name in ("cache", "past_key_values") and name in inspect.signature(model.forward).parameters
    assert kt.cache_kwarg(model.model) == kt.cache_kwarg(model.model.layers[0].self_attn) == name
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, VOCAB, (1, 5)), **{name: cache})
    assert cache.get_seq_length() == 5  # the model stored into the cache it was given, not a fresh one

    class OnlyKwargs(torch.nn.Module):
        def forward(self, **kwargs):
            return kwargs

    assert kt.cache_kwarg(OnlyKwargs()) == name  # no name in the signature: this transformers version's


def test_other_attention_implementation_is_refused(models):
    model = models["llama"]
    cache = kt.KVPackCache(model.config, "int8")  # not switched: model still runs sdpa
    with pytest.raises(ConfigError, match="set_attn_implementation"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)), **{kt.cache_kwarg(model): cache})
    model.set_attn_implementation("kvpack")
    with pytest.raises(ConfigError, match=f"pass {kt.cache_kwarg(model)}=kvpack.hf.cache_for"):  # this version's
        model(input_ids=torch.randint(0, VOCAB, (1, 8)), use_cache=False)


@pytest.mark.parametrize(
    ("model_type", "kw"),
    [
        ("gptj", {"rotary_dim": 16, "num_key_value_heads": None}),
        ("falcon", {"multi_query": True, "alibi": False}),
        ("bloom", {"num_key_value_heads": None}),
    ],
)
def test_models_that_attend_in_their_own_code_are_refused(model_type, kw):
    """GPT-J, Falcon and Bloom computed attention in their modeling code in transformers 5.19, not through the
    attention interface, so their layers would use the cache's packed handles as tensors: refused. A later
    transformers moves a family onto the interface (GPT-J in 5.24): then it is served, exactly."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**_COMMON, **kw})).eval()
    own_code = not hasattr(sys.modules[type(model).__module__], "ALL_ATTENTION_FUNCTIONS")
    if model_type in ("falcon", "bloom") or transformers.__version__.startswith("5.19."):
        assert own_code  # the premise, on the pinned transformers
    if not own_code:  # served: the passthrough format gives the dense cache's tokens
        ids = torch.randint(0, VOCAB, (1, 40))
        ref = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        cache = kvpack.hf.cache_for(model, EXACT)
        assert torch.equal(
            model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **{kt.cache_kwarg(model): cache}), ref
        )
        return
    with pytest.raises(UnsupportedError, match=f"{type(model).__name__} computes attention in its own code"):
        kvpack.hf.cache_for(model, "int8")
    assert model.config._attn_implementation != "kvpack"  # refused before the model was switched
    cache = kt.KVPackCache(model.config, "int8")  # built by hand and passed anyway: a typed error, not a crash
    if model_type == "falcon":
        assert cache.kv_heads == 1  # multi_query: one kv head, whatever num_kv_heads says
    with pytest.raises(ConfigError, match="its own code, not transformers' attention interface"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)), **{kt.cache_kwarg(model): cache})


def test_a_packed_handle_is_not_a_tensor_but_answers_hasattr(models):
    from kvpack.integrations.hf_attention import PackedKV, WrongAttentionError

    handle = PackedKV(kt.KVPackCache(models["llama"].config, "int8"), 0, 1)
    with pytest.raises(WrongAttentionError, match="asked the handle for 'transpose'"):
        handle.transpose(1, 2)
    assert not hasattr(handle, "to") and getattr(handle, "dtype", None) is None  # AttributeError semantics kept
    with pytest.raises(ConfigError, match="set_attn_implementation"):
        torch.matmul(torch.ones(2), handle)


def test_right_padding_is_refused(models):
    model = models["llama"]
    ids, mask = torch.randint(0, VOCAB, (2, 10)), torch.ones(2, 10, dtype=torch.long)
    mask[1, -3:] = 0
    cache = kvpack.hf.cache_for(model, "int8", batch_size=2)
    with pytest.raises(UnsupportedError, match="padding_side = 'left'"):
        model(input_ids=ids, attention_mask=mask, **{kt.cache_kwarg(model): cache})


def test_unsupported_layer_types_are_listed():
    config = LlamaConfig(**_COMMON)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedError, match="layer 1 is 'linear_attention'") as e:
        kt.KVPackCache(config, "int8")
    assert e.value.reasons == ["layer 1 is 'linear_attention'"]


def test_fallback_to_reference_warns_once_and_is_counted(models, monkeypatch):
    model = models["llama"]
    monkeypatch.setattr(kernels, "_warned", set())
    real = kernels.backend_reasons
    monkeypatch.setattr(
        kernels,
        "backend_reasons",
        lambda name, *a, **k: ["pretend: no kernel"] if name == "cpu" else real(name, *a, **k),
    )
    cache = kvpack.hf.cache_for(model, "int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(
            input_ids=torch.randint(0, VOCAB, (1, 20)),
            max_new_tokens=5,
            do_sample=False,
            **{kt.cache_kwarg(model): cache},
        )
    msgs = [str(w.message) for w in caught if "kvpack" in str(w.message)]
    # one for the prefill (the chunk dispatcher's table), one for decode: each falls back once
    assert len(msgs) == 2 and all("pretend: no kernel" in m for m in msgs)
    assert cache.fused_decode_calls == 0 and cache.decode_backends == {"reference": 4 * _layers(model)}


def test_pool_exhaustion_says_how_to_size_the_cache(models):
    model = models["llama"]
    cache = kvpack.hf.cache_for(model, "int8", max_tokens=64)
    with pytest.raises(PoolExhaustedError, match="max_tokens"):
        model(input_ids=torch.randint(0, VOCAB, (1, 300)), **{kt.cache_kwarg(model): cache})
    assert cache.get_seq_length() == 0  # nothing was written


def test_cache_for_switches_the_model_and_reads_its_geometry(models):
    model = models["gemma3"]
    cache = kvpack.hf.cache_for(model, "k8v4", max_tokens=500, batch_size=3)
    assert model.config._attn_implementation == "kvpack" and cache.previous_attn_implementation == "sdpa"
    assert (cache.num_layers, cache.kv_heads, cache.head_dim) == (6, 1, 256)
    assert cache.windows == [40] * 5 + [None] and cache.is_sliding == [True] * 5 + [False]
    assert cache.blocks_needed(3) == 3 * (8 + 1) + 1


def test_integration_is_not_imported_by_kvpack():
    code = (
        "import sys, kvpack, kvpack.models, kvpack.cli.generate_cmd, kvpack.integrations; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
