"""Speculative decoding: how often a full-precision draft's tokens survive a target that reads a quantized cache.

With one model available, it drafts for itself: the draft reads a full-precision cache, the target the
format under test. Greedy assisted generation, as transformers' ``assistant_model`` does it with a fixed
number of draft tokens: the draft proposes ``k`` tokens one by one; the target scores them in one chunk
against its (quantized) cache; the longest prefix the target agrees with is accepted, plus the target's own
next token; both caches are cropped back to what was accepted. With a full-precision target every draft
token is accepted (same model, same numbers); each rejection is a place where the quantized cache changed
the target's greedy choice, and costs a wasted draft run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SpeculativeResult", "assisted_greedy"]


@dataclass
class SpeculativeResult:
    """Counts of one assisted generation.

    Attributes:
        proposed: draft tokens proposed.
        accepted: draft tokens the target accepted.
        target_calls: target forwards (verification chunks).
        tokens: the generated token ids (the target's greedy output).
    """

    proposed: int
    accepted: int
    target_calls: int
    tokens: list[int]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 1.0

    @property
    def tokens_per_call(self) -> float:
        return len(self.tokens) / self.target_calls if self.target_calls else 0.0


def _crop_to(cache: Any, length: int) -> None:
    n = cache.get_seq_length()
    if n > length:
        cache.crop(length - n)  # transformers' convention: a negative count of tokens to remove


@torch.inference_mode()
def assisted_greedy(
    runner: Any,
    prompt: Sequence[int],
    target_cache: Any,
    draft_cache: Any,
    max_new_tokens: int = 32,
    draft_tokens: int = 4,
) -> SpeculativeResult:
    """Greedy assisted generation of ``max_new_tokens`` after ``prompt``.

    Args:
        runner: a :class:`kvpack.evaluation.runner.Runner`.
        prompt: all prompt ids but the last are already in both caches; the last one is fed first.
        target_cache: the cache under test (holds ``prompt[:-1]``).
        draft_cache: the full-precision draft cache (holds ``prompt[:-1]``).
        max_new_tokens: tokens to generate.
        draft_tokens: ``k``, draft tokens per round.
    """
    seq = list(prompt)  # prompt + committed tokens
    n_prompt = len(seq)
    in_draft = len(seq) - 1  # tokens the draft cache holds (both caches hold all but the last token)
    proposed = accepted = calls = 0
    while len(seq) - n_prompt < max_new_tokens:
        k = min(draft_tokens, max_new_tokens - (len(seq) - n_prompt))
        guesses: list[int] = []
        feed = seq[in_draft:]
        for _ in range(k):
            logits = runner.forward(feed, draft_cache, logits_to_keep=1)
            guesses.append(int(logits[-1].argmax()))
            feed = [guesses[-1]]
        # the target scores the last token + guesses: position i predicts what follows guesses[:i]
        choice = runner.forward([seq[-1], *guesses], target_cache).argmax(-1).tolist()
        calls += 1
        a = 0
        while a < k and guesses[a] == choice[a]:
            a += 1
        proposed += k
        accepted += a
        old = len(seq)
        seq += [*guesses[:a], choice[a]]
        _crop_to(target_cache, len(seq) - 1)
        # the draft fed seq[:old] and guesses[:k-1]; what it holds stays valid up to the accepted ones
        in_draft = old + min(a, k - 1)
        _crop_to(draft_cache, in_draft)
    return SpeculativeResult(proposed, accepted, calls, seq[n_prompt : n_prompt + max_new_tokens])
