"""The backend contract: every registered backend is a :class:`DecodeBackend`; the view's format-level invariants
(:meth:`PagedKV.reasons_invalid`) name what is wrong with a broken view; the dispatcher refuses what a backend's
capabilities exclude, with its reasons, and rotates the query for a backend that does not read rotated keys.

Nothing here runs a compiled kernel: the fused backends are asked for reasons only."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

import kvpack.kernels as K
from kvpack.errors import ConfigError, ShapeError, UnsupportedError
from kvpack.formats import PRESETS, parse_format
from kvpack.kernels import reference
from kvpack.kernels.backend import (
    CHUNK_REASON,
    OUTLIER_REASON,
    SINK_REASON,
    Capabilities,
    DecodeBackend,
    ModuleBackend,
)
from kvpack.kernels.views import PagedKV
from kvpack.rotation import key_rotation, rotate
from kvpack.testing import random_paged_kv

D = 64


def _kv(fmt: str = "int8", keep_sink: bool = False) -> PagedKV:
    """A valid view of ``fmt`` (block 16), without the sink rows the presets keep unless ``keep_sink``."""
    f = (PRESETS[fmt] if fmt in PRESETS else parse_format(fmt)).with_block_size(16)
    if not keep_sink:
        f = dataclasses.replace(f, sink=0, name="")
    kv, _, _ = random_paged_kv(f, [20, 40], kv_heads=2, head_dim=D)
    return kv


def _is_reasons(r: object) -> bool:
    return isinstance(r, list) and all(isinstance(x, str) and x for x in r)


# ----------------------------------------------------------------------------------------------------
# Every registered backend conforms


@pytest.mark.parametrize("name", list(K.BACKENDS))
def test_registered_backends_conform_to_the_protocol(name: str) -> None:
    backend = K.BACKENDS[name]
    assert isinstance(backend, DecodeBackend)
    assert backend.name == name and isinstance(backend.capabilities, Capabilities)
    good = _kv()
    assert good.reasons_invalid() == []
    q = torch.randn(good.batch, 4, D)
    for chunk, query in ((False, q), (True, q.unsqueeze(1))):
        assert _is_reasons(backend.reasons_unsupported(query, good, None, chunk=chunk))
        assert _is_reasons(K.backend_reasons(name, query, good, chunk=chunk))
    # a view that breaks the format's invariants: the reasons function still answers with a list (whether the
    # backend can run such a case is its business; that the view is wrong is PagedKV.check's)
    bad = dataclasses.replace(good, k_scale=None)
    assert bad.reasons_invalid()
    assert _is_reasons(backend.reasons_unsupported(q, bad, None))
    # a query no fused backend takes: refused with a reason, not a bare False
    if name != "reference":
        assert backend.reasons_unsupported(q.double(), good, None)


def test_the_reference_runs_every_valid_case_and_checks_the_view() -> None:
    kv = _kv("fp8-o4")
    q = torch.randn(kv.batch, 4, D)
    assert K.backend_reasons("reference", q, kv) == []
    assert K.backend_reasons("reference", q.unsqueeze(1), kv, chunk=True) == []
    with pytest.raises(ShapeError, match="come together"):
        K.decode_attention(q, dataclasses.replace(kv, k_outlier_idx=None), backend="reference")


def test_a_module_backend_declares_its_multi_query_entry_exactly() -> None:
    with pytest.raises(ConfigError, match="chunk_module"):
        ModuleBackend("odd", Capabilities(chunk=True), "kvpack.kernels.reference")
    with pytest.raises(ConfigError, match="chunk_module"):
        ModuleBackend("odd", Capabilities(), "kvpack.kernels.reference", "kvpack.kernels.reference")


# ----------------------------------------------------------------------------------------------------
# The view's invariants, checked once for every backend


def _sink(kv: PagedKV, s: int, dtype: torch.dtype | None = None) -> PagedKV:
    shape = (kv.batch, kv.kv_heads, s, kv.head_dim)
    dtype = dtype or kv.tail_k.dtype
    return dataclasses.replace(kv, sink_k=torch.zeros(shape, dtype=dtype), sink_v=torch.zeros(shape, dtype=dtype))


def _broken() -> list[tuple[str, PagedKV, str]]:
    i8 = _kv("int8")
    asym = _kv("k=int8:channel:asym,v=int4:g32:asym")
    out = _kv("fp8-o4")
    cases = [
        ("missing key scale", dataclasses.replace(i8, k_scale=None), "k_scale (key scale) is missing"),
        ("key scale dtype", dataclasses.replace(i8, k_scale=i8.k_scale.float()), "k_scale (key scale) must be"),
        ("value scale blocks", dataclasses.replace(i8, v_scale=i8.v_scale[:2]), "v_scale (value scale) has 2 blocks"),
        ("missing key zero", dataclasses.replace(asym, k_zero=None), "k_zero (key zero) is missing"),
        ("value zero shape", dataclasses.replace(asym, v_zero=asym.v_zero[:, :, :3]), "v_zero (value zero) must be"),
        ("payload dtype", dataclasses.replace(i8, k_data=i8.k_data.view(torch.int8)), "key payload dtype"),
        ("payload shape", dataclasses.replace(asym, v_data=asym.v_data[..., :8]), "v_data (value payload) must be"),
        ("pool blocks", dataclasses.replace(i8, v_data=i8.v_data[:2], v_scale=i8.v_scale[:2]), "differ in blocks"),
        ("tail length", dataclasses.replace(i8, tail_v=i8.tail_v[:, :, :8]), "tails must be"),
        ("tail dtypes", dataclasses.replace(i8, tail_v=i8.tail_v.half()), "tail_k and tail_v must share"),
        ("tail dtype", dataclasses.replace(i8, tail_k=i8.tail_k.double(), tail_v=i8.tail_v.double()), "must share"),
        ("table dtype", dataclasses.replace(i8, block_tables=i8.block_tables.long()), "block_tables must be"),
        ("lengths dtype", dataclasses.replace(i8, seq_lens=i8.seq_lens.long()), "seq_lens must be"),
        ("start shape", dataclasses.replace(i8, start_pos=torch.zeros(3, dtype=torch.int32)), "start_pos must be"),
        ("outliers alone", dataclasses.replace(out, k_outlier_idx=None), "come together"),
        ("outlier dtype", dataclasses.replace(out, k_outlier=out.k_outlier.float()), "k_outlier must be"),
        ("outlier index", dataclasses.replace(out, k_outlier_idx=out.k_outlier_idx[..., :2]), "k_outlier_idx must be"),
        ("outliers missing", dataclasses.replace(out, k_outlier=None, k_outlier_idx=None), "keeps 4 outlier channels"),
        (
            "outliers unasked",
            dataclasses.replace(out, format=parse_format("fp8-plain,block=16")),
            "keeps no outlier channels",
        ),
        ("sink alone", dataclasses.replace(_sink(i8, 2), sink_v=None), "sink_k and sink_v come together"),
        ("sink dtype", _sink(i8, 2, torch.float16), "in the tail dtype"),
        ("sink length", _sink(i8, 17), "S <= block_size"),
        ("rotation shape", dataclasses.replace(i8, key_rotation=torch.eye(D + 1)), "key_rotation must be"),
        ("one device", dataclasses.replace(i8, tail_k=i8.tail_k.to("meta")), "on one device"),
    ]
    return cases


@pytest.mark.parametrize("case", _broken(), ids=lambda c: c[0])
def test_views_invariants_name_what_is_wrong(case: tuple[str, PagedKV, str]) -> None:
    _, kv, needle = case
    reasons = kv.reasons_invalid()
    assert any(needle in r for r in reasons), reasons
    with pytest.raises(ShapeError, match=re.escape(needle)):
        kv.check()


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4", "k8v4", "kivi2", "fp8", "fp8-o4", "int4-o4"])
def test_valid_views_pass(fmt: str) -> None:
    kv = _kv(fmt)
    assert kv.reasons_invalid() == [] and kv.sink_k is None
    kv.check()
    assert _sink(kv, 3).reasons_invalid() == []
    own = _kv(fmt, keep_sink=True)  # the preset's own sink rows
    assert own.reasons_invalid() == [] and own.sink == own.format.sink


# ----------------------------------------------------------------------------------------------------
# Dispatch reads the capabilities


def _bare(monkeypatch: pytest.MonkeyPatch, **caps: bool) -> str:
    """Register ``bare``: the reference's functions under the given capabilities (none by default)."""
    chunk = caps.get("chunk", False)
    mod = "kvpack.kernels.reference"
    monkeypatch.setitem(K.BACKENDS, "bare", ModuleBackend("bare", Capabilities(**caps), mod, mod if chunk else None))
    return "bare"


def test_dispatch_refuses_what_the_capabilities_exclude(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _bare(monkeypatch)
    plain, outliers, sink = _kv("int8"), _kv("fp8-o4"), _sink(_kv("int8"), 2)
    q = torch.randn(plain.batch, 4, D)
    assert K.backend_reasons(name, q, plain) == []
    assert torch.equal(K.decode_attention(q, plain, backend=name), reference.decode_attention(q, plain))
    assert K.backend_reasons(name, q, outliers) == [OUTLIER_REASON]
    assert K.backend_reasons(name, q, sink) == [SINK_REASON]
    assert K.backend_reasons(name, q.unsqueeze(1), plain, chunk=True) == [CHUNK_REASON]
    for kv, reason in ((outliers, OUTLIER_REASON), (sink, SINK_REASON)):
        with pytest.raises(UnsupportedError, match=re.escape(reason)) as e:
            K.decode_attention(q, kv, backend=name)
        assert e.value.reasons == [reason]
    with pytest.raises(UnsupportedError) as e:
        K.chunk_attention(q.unsqueeze(1), plain, backend=name)
    assert e.value.reasons == [CHUNK_REASON]
    with pytest.raises(UnsupportedError, match="multi-query"):
        K.run_chunk_backend(name, q.unsqueeze(1), plain)
    assert K.fused_chunk_backend(q.unsqueeze(1), plain, None, name) is None
    # given the capabilities, the same backend takes them all
    name = _bare(monkeypatch, outliers=True, sink=True, chunk=True)
    for kv in (plain, outliers, sink):
        assert K.backend_reasons(name, q, kv) == [] and K.backend_reasons(name, q.unsqueeze(1), kv, chunk=True) == []


def test_auto_falls_back_when_a_capability_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = K.BACKENDS["cpu"]
    monkeypatch.setitem(K.BACKENDS, "cpu", dataclasses.replace(cpu, capabilities=Capabilities(sink=True, chunk=True)))
    monkeypatch.setattr(K, "_warned", set())
    kv = _kv("fp8-o4")
    q = torch.randn(kv.batch, 4, D)
    assert OUTLIER_REASON in K.backend_reasons("cpu", q, kv)
    with pytest.warns(RuntimeWarning, match=re.escape(OUTLIER_REASON)):
        got = K.decode_attention(q, kv)
    assert torch.equal(got, reference.decode_attention(q, kv))
    with pytest.raises(UnsupportedError, match=re.escape(OUTLIER_REASON)):
        K.decode_attention(q, kv, backend="cpu")


class _Recorder:
    """A backend that is a plain class, not a module: records what the dispatcher hands it."""

    name = "recorder"
    capabilities = Capabilities(chunk=True)

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, PagedKV]] = []

    def reasons_unsupported(self, q, kv, window=None, *, chunk=False) -> list[str]:
        return []

    def decode_attention(self, q, kv, sm_scale=None, window=None, out=None) -> torch.Tensor:
        self.calls.append((q, kv))
        return torch.zeros_like(q)

    chunk_attention = decode_attention


def test_a_backend_without_rotated_keys_gets_the_rotated_query(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder()
    assert isinstance(rec, DecodeBackend)
    monkeypatch.setitem(K.BACKENDS, rec.name, rec)
    kv = dataclasses.replace(_kv("int8"), key_rotation=key_rotation(D))
    q = torch.randn(kv.batch, 4, D)
    K.decode_attention(q, kv, backend=rec.name)
    K.chunk_attention(q.unsqueeze(1), kv, backend=rec.name)
    for (got_q, got_kv), want in zip(rec.calls, (q, q.unsqueeze(1))):
        assert got_kv.key_rotation is None
        assert torch.equal(got_q, rotate(want, kv.key_rotation))
    # one view without the rotation per rotated view, call after call (kernels keep per-view state)
    assert rec.calls[0][1] is rec.calls[1][1]
    other = dataclasses.replace(kv)
    K.decode_attention(q, other, backend=rec.name)
    assert rec.calls[2][1] is not rec.calls[0][1]
    # the reference reads the rotation itself: handed the view as it is
    assert K.BACKENDS["reference"].capabilities.rotated_keys
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K.decode_attention(q, kv, backend="reference")


def test_unknown_backends_are_refused_with_the_known_ones() -> None:
    kv = _kv()
    q = torch.randn(kv.batch, 4, D)
    assert K.backend_reasons("tpu", q, kv) == ["unknown backend 'tpu'; backends are reference, cpu, triton"]
    with pytest.raises(UnsupportedError, match="unknown backend"):
        K.run_backend("tpu", q, kv)
