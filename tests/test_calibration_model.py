"""Calibration through a real (tiny, random) transformers model and the ``kvpack calibrate`` command."""

from __future__ import annotations

import json

import pytest
import torch

from kvpack.calibration import KVObserver, load_artifact
from kvpack.calibration.artifact import MANIFEST_NAME
from kvpack.calibration.compare import capture_qkv, evaluate_variants, from_blocks, standard_variants, to_blocks
from kvpack.calibration.run import DEFAULT_FORMAT, calibration_windows, load_model, observe_model
from kvpack.cli.main import main
from kvpack.errors import CalibrationError

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama with a byte-level tokenizer, saved like any local model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-llama")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def test_windows_are_deterministic_disjoint_and_bounded(tiny):
    _, tok = tiny
    a, da = calibration_windows(tok, 3, 32, seed=7)
    b, db = calibration_windows(tok, 3, 32, seed=7)
    c, _ = calibration_windows(tok, 3, 32, seed=8)
    assert torch.equal(a, b) and da["tokens_sha256"] == db["tokens_sha256"] and not torch.equal(a, c)
    assert a.shape == (3, 32) and a.dtype == torch.int64 and da["name"] == "pydoc_data.topics"
    _, dh = calibration_windows(tok, 50, 48, seed=1, exclude=da["offsets"], exclude_len=32)
    for s in dh["offsets"]:
        assert all(s + 48 <= e or e + 32 <= s for e in da["offsets"])
    with pytest.raises(CalibrationError, match="usable windows"):
        calibration_windows(tok, 10**6, 32)


def test_observer_sees_keys_after_rope(tiny):
    model, tok = tiny
    ids, _ = calibration_windows(tok, 2, 64, seed=0)
    obs = KVObserver(())
    observe_model(model, ids, obs, batch_size=1)
    keys, values = obs.stats()
    assert keys.absmax.shape == (LAYERS, KV_HEADS, HEAD_DIM) and int(keys.tokens[0]) == 2 * 64
    qkv = capture_qkv(model, ids)  # what attention actually receives: keys after RoPE
    pre = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: pre.append(o.detach()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    for layer, (_, k, v) in enumerate(qkv):
        torch.testing.assert_close(keys.absmax[layer], k.abs().amax(dim=(0, 2)))
        torch.testing.assert_close(values.absmax[layer], v.abs().amax(dim=(0, 2)))
        before = pre[layer].reshape(2, 64, KV_HEADS, HEAD_DIM).abs().amax(dim=(0, 1))
        assert not torch.allclose(keys.absmax[layer], before), "observed keys must be post-RoPE"


def test_observer_sees_queries_as_attention_reads_them(tiny):
    """The queries' mean square per kv head and channel: each kv head's query heads (GQA) averaged, after RoPE, and
    the model's attention implementation restored afterwards."""
    model, tok = tiny
    ids, _ = calibration_windows(tok, 3, 48, seed=1)
    before = model.config._attn_implementation
    obs = KVObserver(())
    observe_model(model, ids, obs, batch_size=2)  # two batches: the sums must add up across calls
    assert model.config._attn_implementation == before
    energy = obs.query_energy()
    assert energy.shape == (LAYERS, KV_HEADS, HEAD_DIM) and energy.dtype == torch.float32
    for layer, (q, _, _) in enumerate(capture_qkv(model, ids)):
        want = q.pow(2).reshape(3, KV_HEADS, HEADS // KV_HEADS, 48, HEAD_DIM).mean(dim=(0, 2, 3))
        torch.testing.assert_close(energy[layer], want, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(energy[0, 0], energy[0, 1]), "kv heads must not be pooled together"


def test_calibrate_command_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "calib"
    args = ["calibrate", "--model", str(tiny_dir), "--samples", "3", "--seq-len", "32", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "calibrated llama (2 layers" in printed and "query statistics: recorded" in printed
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_dir)
    art = load_artifact(out, model=cfg, format=DEFAULT_FORMAT)
    assert art.source == "rope" and art.data["samples"] == 3 and art.data["seq_len"] == 32
    assert art.key_scales.scale.shape == (LAYERS, KV_HEADS, 1, HEAD_DIM) and art.value_scales is None
    assert art.fingerprint["kv_heads"] == KV_HEADS
    assert art.query_energy.shape == (LAYERS, KV_HEADS, HEAD_DIM) and bool((art.query_energy > 0).all())
    cfg.num_key_value_heads = 4
    with pytest.raises(CalibrationError, match="kv_heads: artifact 2, model 4"):
        load_artifact(out, model=cfg)

    out2 = tmp_path / "calib-p"
    args2 = [*args[:-1], str(out2), "--percentile", "99.5", "--format", "kv=fp8:tensor:static:fp32"]
    assert main(args2) == 0
    manifest = json.loads((out2 / MANIFEST_NAME).read_text())
    assert manifest["source"] == "p99.5" and 99.5 in manifest["percentiles"]
    assert manifest["scales"] == {"keys": "fp8_e4m3:tensor:fp32:static", "values": "fp8_e4m3:tensor:fp32:static"}


def test_calibrate_command_errors(tiny_dir, tmp_path, capsys):
    rc = main(["calibrate", "--model", str(tiny_dir), "--format", "k=int9", "--out", str(tmp_path / "x")])
    assert rc == 2 and "unknown key dtype" in capsys.readouterr().err
    rc = main(["calibrate", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x")])
    assert rc == 2 and "not a folder" in capsys.readouterr().err
    rc = main(["calibrate", "--model", str(tiny_dir), "--range", "p100", "--out", str(tmp_path / "x")])
    assert rc == 2 and "percentile" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_comparison_machinery_on_synthetic_keys():
    g = torch.Generator().manual_seed(0)
    from kvpack.testing import realistic_keys

    k = realistic_keys(1, 2, 128, 64, generator=g)
    q = torch.randn(1, 4, 128, 64, generator=g)
    v = torch.randn(1, 2, 128, 64, generator=g)
    assert torch.equal(from_blocks(to_blocks(k), 1), k)
    obs = KVObserver((99.9, 99.99))
    obs.observe(0, k, v)
    keys, _ = obs.stats()
    rows = {r["variant"]: r for r in evaluate_variants([(q, k, v)], standard_variants(keys))}
    assert rows["int8 per-channel, block-local"]["bits"] == pytest.approx(8 + 16 / 64)  # fp16 scale per channel
    assert rows["int4 per-channel + 4 outliers (calibrated)"]["bits"] > rows["int4 per-channel, block-local"]["bits"]
    # calibrated on the same keys: abs-max static clips nothing; keeping outliers helps per-token int4 keys
    assert rows["int8 per-channel, static abs-max"]["clipped"] == 0
    assert rows["int4 per-token + 4 outliers (calibrated)"]["snr_mean"] > rows["int4 per-token (asym)"]["snr_mean"] + 6
    assert rows["int8 per-channel, block-local"]["err_mean"] < rows["int4 per-channel, block-local"]["err_mean"]
