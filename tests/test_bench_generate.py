"""``kvpack bench generate``'s peers on the tiny model: transformers' QuantizedCache with the quanto and hqq
backends produce timed decode steps, the peer list is what the installed transformers has, and a missing
package says how to install it. CI installs the packages (the ``peers`` extra is part of ``all``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from kvpack.bench import generate, peers
from kvpack.evaluation.tiny import tiny_model

PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}


@pytest.fixture(scope="module")
def prefilled():
    model, _ = tiny_model(layers=2)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    kv, first, _ = generate._prefill(model, ids)
    return model, kv, first


def _need(backend: str) -> None:
    module = PACKAGES[backend]
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install 'kvpack[peers]'")


@pytest.mark.parametrize("name", ["quanto-int4", "quanto-int2", "hqq-int4"])
def test_peer_row_is_timed(prefilled, name):
    model, kv, first = prefilled
    peer = next(p for p in peers.PEERS if p.name == name)
    _need(peer.backend)
    row = generate.measure(model, kv, first, {"kind": "peer", "name": name}, batch=2, new_tokens=3)
    dense = generate.measure(model, kv, first, {"kind": "dynamic"}, batch=2, new_tokens=3)
    assert row["provider"] == name and row["steps"] == 3 and row["batch"] == 2 and row["context"] == 64
    assert row["tokens_per_s"] > 0 and row["ms_per_step_median"] > 0
    # 64 quantized tokens (4 or 2 bits, scales and zeros per 64) plus 4 full-precision residual ones
    assert 0 < row["cache_bytes"] < dense["cache_bytes"] / 2


def test_peer_list_is_what_transformers_has(prefilled):
    model, _, _ = prefilled
    found, missing, unsupported = peers.available_peers(model.config)
    names = {p.name for p in found}
    for peer in peers.PEERS:  # each peer is timed, missing with a reason, or not in this transformers
        said = [line for line in missing if line.startswith(f"{peer.name}:")] + [
            u for u in unsupported if u.startswith(f"{peer.name} ")
        ]
        assert (peer.name in names) != bool(said), peer.name
    for backend, module in PACKAGES.items():
        if importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module):
            assert {p.name for p in peers.PEERS if p.backend == backend} <= names


def test_missing_peer_says_how_to_install(prefilled, monkeypatch):
    model, _, _ = prefilled

    def no_package(peer, config):
        raise ImportError(f"You need to install {peer.package}")

    monkeypatch.setattr(peers, "make_cache", no_package)
    found, missing, _ = peers.available_peers(model.config, ["quanto-int4", "hqq-int4"])
    assert found == [] and len(missing) == 2
    assert all("pip install 'kvpack[peers]'" in line for line in missing)


def test_group_size_reasons():
    # quanto and hqq quantize the flattened [batch, kv_heads, tokens, head_dim] in groups of 64
    assert peers.peer_reasons(1, 1, 129, 32) and peers.peer_reasons(1, 3, 63, 32)
    assert not peers.peer_reasons(2, 1, 129, 32) and not peers.peer_reasons(1, 3, 4097, 64)
