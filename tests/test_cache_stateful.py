"""Stateful property test: random add / append (prefill chunks and single tokens) / fork / crop / free /
prefix sharing / offload / restore against a plain full-precision model of the same sequences.

After every step: each sequence's dequantized contents equal what the quant primitives give for the same
tokens block by block (the tail exactly), reference counts equal the references held, nothing leaked,
and the memory report balances. An operation that runs out of blocks leaves the cache exactly as it was.
Keys and values are a function of the token prefix (as a model's are), so prefix sharing is checkable.
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpack.cache import PagedKVCache
from kvpack.errors import PoolExhaustedError, SequenceError
from kvpack.formats import parse_format
from kvpack.outliers import dequantize_outliers, quantize_outliers
from kvpack.quant import dequantize, quantize
from kvpack.testing import assert_bitexact

H, D, B, L = 2, 32, 4, 2
NUM_BLOCKS = 14
_memo: dict = {}


def token_kv(prefix: tuple, layer: int) -> torch.Tensor:
    """[2, H, D] key and value of the last token of ``prefix`` in ``layer`` (deterministic)."""
    key = (prefix, layer)
    if key not in _memo:
        g = torch.Generator().manual_seed(hash(key) % 2**31)
        _memo[key] = torch.randn(2, H, D, generator=g) * 2
    return _memo[key]


class ModelSeq:
    def __init__(self, tokens, record):
        self.tokens = list(tokens)  # the ids the values come from (recorded ids may run ahead of n)
        self.record = record
        self.n = 0
        self.k = [torch.zeros(H, 0, D) for _ in range(L)]  # full-precision values in the tail dtype
        self.v = [torch.zeros(H, 0, D) for _ in range(L)]
        self.offloaded = False
        self.released = 0  # leading blocks the sliding window released

    def copy(self):
        other = ModelSeq(self.tokens, self.record)
        other.n, other.k, other.v, other.released = self.n, list(self.k), list(self.v), self.released
        return other


def snapshot(cache):
    state = {name: t.clone() for name, t in cache.storage.pools().items()}
    state.update(tk=cache.slots.tail_k.clone(), tv=cache.slots.tail_v.clone(), tables=cache.slots.tables.clone())
    state.update(lens=cache.slots.lens.clone(), refs=torch.tensor(cache.pool.ref_counts()))
    blocks = {s: list(cache.slots.seqs[s].blocks) for s in cache.seq_ids}
    return state, cache.pool.num_free, cache.pool.num_cached, blocks


def assert_unchanged(before, after):
    for name in before[0]:
        assert_bitexact(after[0][name], before[0][name], name)
    assert before[1:] == after[1:]


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        fmt=st.sampled_from(
            [
                "int8",
                "int4",
                "kivi2",
                "fp8-plain",
                "fp8-o4",
                "fp16",
                "k=int8:channel:asym:e8m0,v=int4:g8:sym",
                "int4,sink=1",
                "k4v2,sink=4",  # the whole first block kept (block_size 4 here)
            ]
        ),
        tail=st.sampled_from([torch.float32, torch.float16]),
        rng=st.randoms(use_true_random=False),
        window=st.sampled_from([None, None, 6, [5, 9]]),
    )
    def setup(self, fmt, tail, rng, window):
        self.rng = rng  # fresh token ids (two symbols, so prefixes repeat often)
        self.fmt = parse_format(fmt).with_block_size(B)
        self.tail = tail
        self.window = window if window is None or isinstance(window, int) else max(window)
        self.cache = PagedKVCache(self.fmt, L, H, D, NUM_BLOCKS, tail_dtype=tail, max_seqs=2, window=window)
        self.seqs: dict[int, ModelSeq] = {}
        self.freed: list[int] = []

    # -- helpers ----------------------------------------------------------------------------------------
    def live(self, offloaded=False):
        return sorted(s for s, m in self.seqs.items() if m.offloaded == offloaded)

    def values(self, m: ModelSeq, start: int, stop: int, layer: int):
        kv = torch.stack([token_kv(tuple(m.tokens[: p + 1]), layer) for p in range(start, stop)], dim=2)
        kv = kv.to(self.tail).float()  # what the tail can hold
        return kv[0], kv[1]  # [H, T, D]

    def expected(self, spec, x, released=0, sink=None):
        """Dequantized contents of x [H, n, D]: full blocks via the primitives, the tail exact, positions
        released by the sliding window zero; the first ``sink`` (default: the format's) sealed positions exact."""
        nb = x.shape[1] // B
        blocks = x[:, : nb * B].reshape(H, nb, B, D).transpose(0, 1)
        rec = (
            dequantize_outliers(quantize_outliers(blocks, spec))
            if spec.has_outliers
            else dequantize(quantize(blocks, spec))
        )
        sealed = rec.transpose(0, 1).reshape(H, nb * B, D)
        out = torch.cat([sealed, x[:, nb * B :]], dim=1)
        s = min(self.fmt.sink if sink is None else sink, nb * B)
        out[:, :s] = x[:, :s]
        out[:, : released * B] = 0
        return out

    def do_append(self, sids, t):
        """Append t tokens to each of sids in every layer; True if it fit in the pool."""
        new_tokens = {}
        for s in sids:
            m = self.seqs[s]
            while len(m.tokens) < m.n + t:  # pending prompt ids first, then fresh ones
                tok = self.rng.randint(0, 1)
                m.tokens.append(tok)
                new_tokens.setdefault(s, []).append(tok)
        per_layer = []
        for layer in range(L):
            parts = [self.values(self.seqs[s], self.seqs[s].n, self.seqs[s].n + t, layer) for s in sids]
            per_layer.append((torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])))
        before = snapshot(self.cache)
        try:
            self.cache.append(0, sids, *per_layer[0])
        except PoolExhaustedError:
            assert_unchanged(before, snapshot(self.cache))
            for s, toks in new_tokens.items():
                del self.seqs[s].tokens[-len(toks) :]
            return False
        for layer in range(1, L):
            self.cache.append(layer, sids, *per_layer[layer])
        for i, s in enumerate(sids):
            m = self.seqs[s]
            for layer in range(L):
                m.k[layer] = torch.cat([m.k[layer], per_layer[layer][0][i]], dim=1)
                m.v[layer] = torch.cat([m.v[layer], per_layer[layer][1][i]], dim=1)
            if self.window is not None:  # blocks no query of this step attends
                m.released = max(m.released, max(0, m.n - self.window + 1) // B)
            m.n += t
            if m.record and s in new_tokens:
                self.cache.append_tokens(s, new_tokens[s])
        return True

    # -- rules ------------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < 6)
    @rule(data=st.data(), record=st.booleans(), extra=st.integers(1, 9))
    def add(self, data, record, extra):
        tokens = []
        if record and self.seqs and data.draw(st.booleans()):  # share a prefix with a known sequence
            src = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
            tokens = src.tokens[: data.draw(st.one_of(st.just(len(src.tokens)), st.integers(0, len(src.tokens))))]
        tokens += [self.rng.randint(0, 1) for _ in range(extra)]
        sid = self.cache.add_sequence(tokens if record else None)
        m = ModelSeq(tokens if record else [], record)
        prefix = self.cache.cached_prefix_len(sid)
        assert prefix % B == 0 and prefix <= max(0, len(tokens) - 1) // B * B
        if prefix:
            for layer in range(L):
                m.k[layer], m.v[layer] = self.values(m, 0, prefix, layer)
            m.n = prefix
        self.seqs[sid] = m
        if record and len(tokens) > prefix:  # prefill the rest of the prompt in one chunk
            self.do_append([sid], len(tokens) - prefix)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), t=st.sampled_from([1, 1, 1, 2, 3, 5, 9]))
    def append(self, data, t):
        live = self.live()
        sids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        self.do_append(sids, t)

    @precondition(lambda self: self.live() and len(self.seqs) < 6)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self.live()))
        sid = self.cache.fork(src)
        self.seqs[sid] = self.seqs[src].copy()

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def crop(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        m = self.seqs[sid]
        n = data.draw(st.integers(0, m.n + 2))
        if n > m.n or (m.released and n - self.window + 1 < m.released * B):
            before = snapshot(self.cache)
            try:
                self.cache.crop(sid, n)
                raise AssertionError("crop beyond the length or into released positions must fail")
            except SequenceError:
                assert_unchanged(before, snapshot(self.cache))
            return
        self.cache.crop(sid, n)
        j, r = divmod(n, B)
        for layer in range(L):
            k, v = m.k[layer][:, :n], m.v[layer][:, :n]
            if r and j < m.n // B:  # the kept part of a sealed block comes back dequantized (sink rows exact)
                sink = self.fmt.sink if j == 0 else 0
                k = torch.cat(
                    [k[:, : j * B], self.expected(self.fmt.key, m.k[layer][:, j * B : (j + 1) * B], 0, sink)[:, :r]],
                    1,
                )
                v = torch.cat(
                    [v[:, : j * B], self.expected(self.fmt.value, m.v[layer][:, j * B : (j + 1) * B], 0, sink)[:, :r]],
                    1,
                )
                k, v = k.to(self.tail).float(), v.to(self.tail).float()
            m.k[layer], m.v[layer] = k, v
        m.n = n
        del m.tokens[n:]

    @precondition(lambda self: len(self.live()) >= 2)
    @rule(data=st.data())
    def reorder(self, data):
        live = self.live()
        sids = data.draw(st.lists(st.sampled_from(live), min_size=2, max_size=len(live), unique=True))
        src = data.draw(st.lists(st.integers(0, len(sids) - 1), min_size=len(sids), max_size=len(sids)))
        self.cache.reorder(sids, src)
        models = [self.seqs[s].copy() for s in sids]
        for s, i in zip(sids, src):
            self.seqs[s] = models[i].copy()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.cache.free(sid)
        del self.seqs[sid]
        self.freed.append(sid)
        try:
            self.cache.free(sid)
            raise AssertionError("double free must fail")
        except SequenceError:
            pass

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def offload(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        used = self.cache.pool.num_used
        moved = self.cache.offload(sid)
        per_block = L * self.fmt.block_bytes(H, D)
        assert moved % per_block == 0
        assert self.cache.pool.num_used == used - moved // per_block
        self.seqs[sid].offloaded = True

    @precondition(lambda self: self.live(offloaded=True))
    @rule(data=st.data())
    def restore(self, data):
        sid = data.draw(st.sampled_from(self.live(offloaded=True)))
        before = snapshot(self.cache)
        try:
            self.cache.restore(sid)
        except PoolExhaustedError:
            assert_unchanged(before, snapshot(self.cache))
            return
        self.seqs[sid].offloaded = False

    # -- invariants -------------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.problems() == []
        elem = self.cache.slots.tail_k.element_size()
        theory = sum(self.fmt.bytes_for_tokens(m.n - m.released * B, H, D, L, elem) for m in self.seqs.values())
        t = self.cache.memory_report().total
        if not self.fmt.is_passthrough:
            assert t.used_bytes + t.host_bytes == theory - t.shared_bytes

    @invariant()
    def contents_match_the_model(self):
        if not hasattr(self, "cache"):
            return
        for sid, m in self.seqs.items():
            assert self.cache.seq_len(sid) == self.cache.seq_len(sid, L - 1) == m.n
            if m.offloaded:
                continue
            for layer in range(L):
                k, v = self.cache.dense(layer, sid)
                want_k = self.expected(self.fmt.key, m.k[layer], m.released)
                assert_bitexact(k, want_k, f"keys of {sid} layer {layer}")
                assert_bitexact(
                    v, self.expected(self.fmt.value, m.v[layer], m.released), f"values of {sid} layer {layer}"
                )

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for sid in list(self.seqs):
            self.cache.free(sid)
        pool = self.cache.pool
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == NUM_BLOCKS - 1
        assert self.cache.problems() == []


CacheMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_cache_state_machine = CacheMachine.TestCase
