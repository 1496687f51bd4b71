"""Haystacks: real English prose every machine has offline, cut to a token length, with facts planted at depths.

The prose is the Python language reference that ships with CPython (``pydoc_data.topics``): code blocks,
grammar rules and heading underlines are dropped, paragraphs are re-flowed, and the text is split into
sentences. A haystack is a run of those sentences (order shuffled by a seed) measured in the model's own
tokens; each fact (a needle) becomes its own short paragraph at the sentence boundary nearest its depth.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpack.errors import ConfigError

__all__ = ["Haystack", "build_haystack", "prose_sentences"]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_UNDERLINE = re.compile(r"^[*=\-~^\"]{3,}\s*$")


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of one pydoc topic that read as prose (no code, grammar or heading lines)."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if any(_UNDERLINE.match(line) for line in lines):
            continue  # a heading
        if any(line.startswith((" ", "\t")) for line in lines):
            continue  # code, grammar, tables, indented notes
        para = " ".join(line.strip() for line in lines).strip()
        if len(para) < 80 or para.count('"') > 8 or "::=" in para or para.startswith((">>>", "*", "+")):
            continue
        out.append(para)
    return out


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Every prose sentence of ``pydoc_data.topics``, in a fixed order (topic name, then text order)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # pragma: no cover - part of every CPython
        raise ConfigError(f"Python's pydoc_data is missing ({e}); reinstall Python with its standard library") from e
    sentences = []
    for name in sorted(topics):
        for para in _prose_paragraphs(topics[name]):
            for s in _SENTENCE_END.split(para):
                s = s.strip()
                if len(s.split()) >= 5:
                    sentences.append(s)
    return tuple(sentences)


@dataclass(frozen=True)
class Haystack:
    """A document of about ``target_tokens`` tokens with facts planted in it.

    Attributes:
        text: the document.
        n_tokens: its length in the tokenizer's tokens (tokenized alone, no special tokens).
        target_tokens: the length asked for.
        facts: the planted facts, in the order given.
        depths: the depth each fact was asked for (0 = start, 1 = end).
        actual_depths: where each fact landed, as the fraction of the document's characters before it.
        seed: the seed that chose and ordered the prose.
    """

    text: str
    n_tokens: int
    target_tokens: int
    facts: tuple[str, ...]
    depths: tuple[float, ...]
    actual_depths: tuple[float, ...]
    seed: int


def _count(tokenize: Callable[[str], list[int]], text: str) -> int:
    return len(tokenize(text))


def build_haystack(
    tokenize: Callable[[str], list[int]],
    n_tokens: int,
    facts: Sequence[str] = (),
    depths: Sequence[float] = (),
    seed: int = 0,
    sentences: Sequence[str] | None = None,
    shuffle: bool = True,
) -> Haystack:
    """Build a document of ``n_tokens`` tokens (within a few) with ``facts[i]`` planted at ``depths[i]``.

    Args:
        tokenize: text -> token ids, without special tokens (for example
            ``lambda s: tok(s, add_special_tokens=False)["input_ids"]``).
        n_tokens: target length of the whole document, facts included.
        facts: sentences to plant; each becomes a paragraph of its own.
        depths: one per fact, in ``[0, 1]``: the fraction of the filler prose that comes before the fact.
        seed: chooses where in the corpus the prose starts and shuffles it; the same seed gives the same text.
        sentences: the corpus (default :func:`prose_sentences`).
        shuffle: shuffle the corpus by ``seed`` and wrap around it as often as the length needs (the
            built-in prose); ``False`` takes ``sentences`` in order, once, so the document is shorter than
            ``n_tokens`` when they run out (the caller's text, :mod:`kvpack.evaluation.corpus`).

    Raises:
        ConfigError: mismatched facts and depths, a depth outside ``[0, 1]``, or a length the facts alone
            exceed.
    """
    if len(facts) != len(depths):
        raise ConfigError(f"give one depth per fact: {len(facts)} facts, {len(depths)} depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"depths must lie in [0, 1], got {list(depths)}")
    corpus = list(sentences if sentences is not None else prose_sentences())
    if not corpus:
        raise ConfigError("the prose corpus is empty")
    if shuffle:
        random.Random(seed).shuffle(corpus)
    fact_tokens = sum(_count(tokenize, "\n\n" + f + "\n\n") for f in facts)
    budget = n_tokens - fact_tokens
    if budget <= 0:
        raise ConfigError(f"a haystack of {n_tokens} tokens cannot hold facts of {fact_tokens} tokens; ask for more")
    # Take sentences until the filler reaches its budget; cut the last one at a word so the total lands on it.
    chosen: list[str] = []
    costs: list[int] = []
    used = 0
    i = 0
    while used < budget and (shuffle or i < len(corpus)):
        s = corpus[i % len(corpus)]
        i += 1
        cost = _count(tokenize, " " + s)
        if used + cost > budget:
            words = s.split()
            lo, hi = 0, len(words)
            while lo < hi:  # longest word prefix that fits
                mid = (lo + hi + 1) // 2
                if used + _count(tokenize, " " + " ".join(words[:mid])) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                chosen.append(" ".join(words[:lo]))
                costs.append(_count(tokenize, " " + chosen[-1]))
            break
        chosen.append(s)
        costs.append(cost)
        used += cost
    # Sentence boundaries in filler tokens, so a depth maps to the nearest boundary.
    bounds = [0]
    for c in costs:
        bounds.append(bounds[-1] + c)
    order = sorted(range(len(facts)), key=lambda j: depths[j])
    cut_at = {}
    for j in order:
        target = depths[j] * bounds[-1]
        cut_at[j] = min(range(len(bounds)), key=lambda b: (abs(bounds[b] - target), b))
    pieces: list[str] = []
    cursor = 0
    for j in order:
        k = cut_at[j]
        if k > cursor:
            pieces.append(" ".join(chosen[cursor:k]))
        pieces.append(facts[j])
        cursor = max(cursor, k)
    if cursor < len(chosen):
        pieces.append(" ".join(chosen[cursor:]))
    text = "\n\n".join(p for p in pieces if p)
    actual = []
    for f in facts:
        at = text.find(f)
        actual.append(round(at / max(1, len(text)), 4))
    return Haystack(
        text=text,
        n_tokens=_count(tokenize, text),
        target_tokens=n_tokens,
        facts=tuple(facts),
        depths=tuple(float(d) for d in depths),
        actual_depths=tuple(actual),
        seed=seed,
    )
