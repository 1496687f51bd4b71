"""Centred keys (key spec ``center``; the ``fp8`` preset): stored keys are ``k - mu``, ``mu`` the mean of the
sequence's first block after position 0, fixed when that block seals. Scores all move by ``q . mu``, so the
softmax and every kernel's output are unchanged; ``dense`` adds ``mu`` back."""

from __future__ import annotations

import math

import pytest
import torch

from kvpack.cache import PagedKVCache
from kvpack.errors import FormatError, NonFiniteError
from kvpack.evaluation.simulate import key_center, roundtrip_blocks
from kvpack.formats import parse_format
from kvpack.kernels import decode_attention
from kvpack.kernels.reference import dense_history

H, D, B, L = 2, 64, 16, 2
CENTRED = "k=fp8:head:center,v=fp8:head,block=16,sink=1"
PLAIN = "k=fp8:head,v=fp8:head,block=16,sink=1"


def offset_keys(n: int, seed: int = 0, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with a large constant offset per channel (as real keys have) and plain random values."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(1, H, 1, D, generator=g) * 6
    k = offset + torch.randn(batch, H, n, D, generator=g) * 0.5
    return k, torch.randn(batch, H, n, D, generator=g)


def fill(cache: PagedKVCache, sids: list[int], k: torch.Tensor, v: torch.Tensor, cuts: list[int]) -> None:
    """Append ``k``/``v`` ``[batch, H, n, D]`` in chunks ending at ``cuts``, every layer per chunk."""
    lo = 0
    for hi in cuts:
        for layer in range(L):
            cache.append(layer, sids, k[:, :, lo:hi], v[:, :, lo:hi])
        lo = hi


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 decode attention: q ``[Hq, D]``, k/v ``[H, n, D]`` -> ``[Hq, D]``."""
    g = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q.double(), k) / math.sqrt(D), dim=-1)
    return torch.einsum("hn,hnd->hd", p, v).float()


def test_the_field_parses_prints_and_refuses_what_cannot_work() -> None:
    f = parse_format(CENTRED)
    assert f.key.center and not f.value.center and parse_format(f.spec_string()) == f
    assert str(f.key).endswith(":center")
    assert parse_format("fp8").key.center  # the preset
    assert not parse_format("fp8@static").key.center  # calibrated ranges are of the keys as they come
    for bad, why in (
        ("k=fp8:head,v=fp8:head:center", "keys only"),
        ("kv=int8:channel:center", "keys only"),
        ("k=int8:channel:static:center,v=int8", "static"),
        ("k=fp16:center,v=fp16", "takes no fields"),
    ):
        with pytest.raises(FormatError, match=why):
            parse_format(bad)
    # one head_dim vector per kv head in the tail dtype, per sequence and layer
    assert f.center_bytes(8, 128, 2) == 8 * 128 * 2
    assert parse_format(PLAIN).center_bytes(8, 128, 2) == 0
    assert f.bytes_for_tokens(100, 8, 128) - parse_format(PLAIN).bytes_for_tokens(100, 8, 128) == 8 * 128 * 2


@pytest.mark.parametrize("tail_dtype", [torch.float32, torch.bfloat16])
def test_the_centre_is_the_first_block_mean_fixed_at_its_seal(tail_dtype: torch.dtype) -> None:
    cache = PagedKVCache(CENTRED, L, H, D, 32, tail_dtype=tail_dtype)
    sid = cache.add_sequence()
    k, v = offset_keys(40)
    fill(cache, [sid], k, v, [5])
    assert cache.view(0, [sid]).key_center.abs().sum() == 0  # nothing sealed yet: keys stored as they come
    assert torch.equal(cache.view(0, [sid]).tail_k[0, :, :5], k[0, :, :5].to(tail_dtype))
    fill(cache, [sid], k[:, :, 5:], v[:, :, 5:], [15, 35])  # positions 5-19, 20-39: block 0 seals mid-chunk
    for layer in range(L):
        view = cache.view(layer, [sid])
        want = k[0, :, 1:B].to(tail_dtype).float().mean(1)
        ulp = 2**-7 if tail_dtype == torch.bfloat16 else 1e-6  # the centre is stored in the tail dtype
        torch.testing.assert_close(view.key_center[0].float(), want, atol=1e-6, rtol=ulp)
        mu = view.key_center[0].float()[:, None]
        # the tail and the sink hold centred keys; dense() gives the keys back
        torch.testing.assert_close(
            view.tail_k[0, :, :8].float() + mu, k[0, :, 32:40].to(tail_dtype).float(), atol=0.05, rtol=0.01
        )
        torch.testing.assert_close(view.sink_k[0, :, 0].float() + mu[:, 0], k[0, :, 0].float(), atol=0.05, rtol=0.01)
        hk, _ = dense_history(view, 0)
        assert (hk - k[0]).abs().max() < 0.1


def test_centring_cuts_the_key_error_of_fp8_and_leaves_attention_exact() -> None:
    k, v = offset_keys(300, seed=1, batch=2)
    q = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(9)) * 2
    errs = {}
    for fmt in (CENTRED, PLAIN):
        cache = PagedKVCache(fmt, L, H, D, 64, tail_dtype=torch.float32)
        sids = [cache.add_sequence(), cache.add_sequence()]
        fill(cache, sids, k, v, [50, 80, *range(81, 140), 300])  # prefill, first seal, decode steps, prefill
        view = cache.view(1, sids)
        out = {b: decode_attention(q, view, backend=b) for b in ("cpu", "reference")}
        for row in range(2):
            hk, hv = dense_history(view, row)
            want = attention(q[row], hk, hv)  # the attention of the keys and values the cache gives back
            for b, o in out.items():
                torch.testing.assert_close(o[row], want, atol=2e-4, rtol=2e-3, msg=f"{fmt} {b} row {row}")
        errs[fmt] = max((dense_history(view, r)[0] - k[r]).abs().max().item() for r in range(2))
    assert errs[CENTRED] < 0.5 * errs[PLAIN]


def test_fork_reorder_and_prefix_reuse_carry_the_centre() -> None:
    cache = PagedKVCache(CENTRED, L, H, D, 64, tail_dtype=torch.float32)
    k, v = offset_keys(40, seed=2)
    tokens = list(range(40))
    a = cache.add_sequence(tokens)
    fill(cache, [a], k, v, [40])
    mu = cache.view(0, [a]).key_center[0].clone()
    b = cache.fork(a)
    assert torch.equal(cache.view(0, [b]).key_center[0], mu)
    c = cache.add_sequence(tokens)  # reuses the first two blocks from the prefix cache
    assert cache.cached_prefix_len(c) == 32
    assert torch.equal(cache.view(0, [c]).key_center[0], mu)
    fill(cache, [c], k[:, :, 32:], v[:, :, 32:], [8])
    torch.testing.assert_close(dense_history(cache.view(1, [c]), 0)[0], dense_history(cache.view(1, [a]), 0)[0])
    fresh = cache.add_sequence()
    assert cache.view(0, [fresh]).key_center.abs().sum() == 0  # a new sequence starts uncentred
    cache.reorder([a, fresh], [1, 0])
    assert cache.view(0, [a]).key_center.abs().sum() == 0 and torch.equal(cache.view(0, [fresh]).key_center[0], mu)


def test_crop_into_the_first_block_keeps_the_centre_and_stays_consistent() -> None:
    cache = PagedKVCache(CENTRED, L, H, D, 64, tail_dtype=torch.float32)
    k, v = offset_keys(60, seed=3)
    sid = cache.add_sequence()
    fill(cache, [sid], k, v, [40])
    mu = cache.view(0, [sid]).key_center[0].clone()
    cache.crop(sid, 9)  # back inside block 0: its kept tokens return to the tail, centred
    assert torch.equal(cache.view(0, [sid]).key_center[0], mu)
    fill(cache, [sid], k[:, :, 9:], v[:, :, 9:], [51])  # seal again: the same centre
    view = cache.view(0, [sid])
    assert torch.equal(view.key_center[0], mu)
    hk, hv = dense_history(view, 0)
    assert (hk - k[0]).abs().max() < 0.1
    q = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(
        decode_attention(q, view, backend="cpu")[0], attention(q[0], hk, hv), atol=2e-4, rtol=2e-3
    )


def test_a_non_finite_first_block_is_reported_at_its_position_and_changes_nothing() -> None:
    cache = PagedKVCache(CENTRED, L, H, D, 32, tail_dtype=torch.float32)
    sid = cache.add_sequence()
    k, v = offset_keys(20, seed=5)
    k[0, 1, 7, 3] = float("nan")
    with pytest.raises(NonFiniteError) as e:
        cache.append(0, [sid], k, v)
    assert e.value.where[0]["position"] == 7 and e.value.where[0]["head"] == 1
    assert cache.seq_len(sid) == 0 and cache.view(0, [sid]).key_center.abs().sum() == 0


def test_the_simulate_engine_reconstructs_what_the_cache_returns() -> None:
    k, v = offset_keys(48, seed=6)
    cache = PagedKVCache(CENTRED, 1, H, D, 16, tail_dtype=torch.float32)
    sid = cache.add_sequence()
    cache.append(0, [sid], k, v)
    fmt = parse_format(CENTRED)
    mu = key_center(k[:, :, :B], fmt.key)
    torch.testing.assert_close(mu, cache.view(0, [sid]).key_center, atol=1e-6, rtol=0)
    rec = roundtrip_blocks(k, fmt.key, B, center=mu)
    hk, _ = dense_history(cache.view(0, [sid]), 0)
    hk[:, :1] = rec[0, :, :1]  # position 0 is the sink: exact in the cache, a block row in the roundtrip
    torch.testing.assert_close(rec[0], hk, atol=1e-5, rtol=1e-5)
