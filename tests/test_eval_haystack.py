"""Haystacks (length control, fact placement, determinism) and needles."""

import random

import pytest

from kvpack.errors import ConfigError
from kvpack.evaluation.haystack import build_haystack, prose_sentences
from kvpack.evaluation.needles import KINDS, make_probe
from kvpack.evaluation.scoring import exact_match
from kvpack.evaluation.tiny import ByteTokenizer

TOK = ByteTokenizer()


def enc(text):
    return TOK(text)["input_ids"]


def words(text):
    return text.split()  # a word-level "tokenizer": a second token granularity


def test_corpus_is_prose():
    s = prose_sentences()
    assert len(s) > 500
    assert all(len(x.split()) >= 5 for x in s)
    assert not any("::=" in x for x in s)  # grammar rules dropped


@pytest.mark.parametrize("tokenize", [enc, words])
@pytest.mark.parametrize("n", [300, 1000, 4000])
def test_length_is_controlled(tokenize, n):
    fact = "The access code for the north gate is 12345."
    h = build_haystack(tokenize, n, [fact], [0.5], seed=3)
    assert abs(len(tokenize(h.text)) - n) <= max(3, n // 100), (len(tokenize(h.text)), n)
    assert h.n_tokens == len(tokenize(h.text))
    assert h.text.count(fact) == 1


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_fact_lands_at_its_depth(depth):
    fact = "The access code for the north gate is 12345."
    h = build_haystack(enc, 3000, [fact], [depth], seed=1)
    assert abs(h.actual_depths[0] - depth) < 0.05, h.actual_depths
    assert h.actual_depths[0] == round(h.text.find(fact) / len(h.text), 4)


def test_two_facts_in_depth_order_and_deterministic():
    facts = ["Second fact is here.", "First fact is here."]
    a = build_haystack(enc, 2000, facts, [0.8, 0.2], seed=5)
    b = build_haystack(enc, 2000, facts, [0.8, 0.2], seed=5)
    c = build_haystack(enc, 2000, facts, [0.8, 0.2], seed=6)
    assert a == b
    assert a.text != c.text
    assert a.text.find("First fact") < a.text.find("Second fact")


def test_bad_haystack_requests():
    with pytest.raises(ConfigError, match="one depth per fact"):
        build_haystack(enc, 500, ["a"], [])
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        build_haystack(enc, 500, ["a"], [1.5])
    with pytest.raises(ConfigError, match="cannot hold"):
        build_haystack(enc, 10, ["a much longer fact than ten tokens"], [0.5])


@pytest.mark.parametrize("kind", KINDS)
def test_probes_are_seeded_and_self_consistent(kind):
    a = make_probe(kind, random.Random(1))
    b = make_probe(kind, random.Random(1))
    c = make_probe(kind, random.Random(2))
    assert a == b
    assert a != c
    # the facts hold the answer (two-hop: the second fact), and the answer scores against itself
    assert a.answer in " ".join(a.facts)
    assert exact_match(kind, a.answer, " " + a.answer + ".")
    assert len(a.facts) == {"two-hop": 2, "two-hop-strict": 3}.get(kind, 1)
    if kind == "two-hop-strict":  # the distractor room has another number
        assert a.answer not in a.facts[2]


def test_unknown_kind():
    with pytest.raises(ConfigError, match="kinds are"):
        make_probe("riddle", random.Random(0))
