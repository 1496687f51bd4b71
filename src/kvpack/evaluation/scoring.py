"""Exact-match scoring of generated answers, with the normalisation rules written down.

A generated answer counts when its first line, normalised, *starts with* the expected answer, normalised
the same way, and the match ends at a boundary (end of text, whitespace or punctuation): ``"58213."``
matches ``58213`` but ``"582139"`` does not. Greedy generation is cut at a token budget, so what follows
the answer is ignored.

Normalisation (all kinds): Unicode NFKC; the first non-empty line only; surrounding whitespace, quotes,
backticks and Markdown emphasis removed; runs of whitespace collapsed to one space. Then per kind:

* ``number`` (and both ``two-hop`` kinds): thousands separators (``,`` ``_`` thin space) inside a digit run are
  dropped, so ``58,213`` equals ``58213``; the first number in the answer must equal the expected one.
* ``identifier``: case-sensitive (an identifier with a changed case is a different identifier).
* ``sentence``: case-insensitive, and punctuation at the end of the sentence is ignored; every word must
  be reproduced in order (``"The violet kettle sings"`` does not match ``"The violet kettle hums"``).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["could_still_match", "exact_match", "normalize"]

_NUMERIC = ("number", "two-hop", "two-hop-strict")
_WRAP = "\"'`*_“”‘’«» \t"
_END_PUNCT = ".,;:!?)]}"
_DIGIT_GROUPS = re.compile(r"(?<=\d)[,_\u2009\u202f](?=\d{3}\b)")
_NUMBER = re.compile(r"\d+")


def normalize(text: str, kind: str = "identifier") -> str:
    """Normalise ``text`` for the exact-match rule of ``kind`` (see the module docstring)."""
    text = unicodedata.normalize("NFKC", text)
    lines = [line for line in text.splitlines() if line.strip()]
    text = lines[0] if lines else ""
    text = re.sub(r"\s+", " ", text).strip(_WRAP)
    if kind in _NUMERIC:
        text = _DIGIT_GROUPS.sub("", text)
    elif kind == "sentence":
        text = text.casefold().rstrip(_END_PUNCT + _WRAP)
    return text


def exact_match(kind: str, expected: str, generated: str) -> bool:
    """Whether ``generated`` gives the ``expected`` answer of a probe of ``kind``.

    Args:
        kind: ``number``, ``identifier``, ``sentence``, ``two-hop`` or ``two-hop-strict``.
        expected: the answer the probe planted.
        generated: the model's continuation after the primed answer start.
    """
    got = normalize(generated, kind)
    want = normalize(expected, kind)
    if not want:
        return False
    if kind in _NUMERIC:
        first = _NUMBER.search(got)
        # the first number decides: "is 58213" passes, "is not 1, it is 58213" does not
        return first is not None and first.group() == want
    if kind == "sentence":
        got = re.sub(r"[^\w\s'-]", " ", got)
        want_words = re.sub(r"[^\w\s'-]", " ", want).split()
        return got.split()[: len(want_words)] == want_words
    if not got.startswith(want):
        return False
    rest = got[len(want) :]
    return not rest or rest[0].isspace() or rest[0] in _END_PUNCT + _WRAP


def could_still_match(kind: str, expected: str, generated: str) -> bool:
    """Whether more text could still change the score of ``generated``, a partial answer.

    ``False`` once the answer is decided (right or wrong) under :func:`exact_match`'s rules, whatever
    follows; greedy decoding can then stop early. Conservative: ``True`` whenever unsure.
    """
    text = unicodedata.normalize("NFKC", generated)
    if "\n" in text.lstrip():  # the first line is complete
        return False
    got = re.sub(r"\s+", " ", text).lstrip(_WRAP)
    if kind in _NUMERIC:
        want_digits = normalize(expected, kind)
        run = re.search(r"\d[\d,_\u2009\u202f]*", got)
        if run is None:
            return True  # no number yet
        if run.end() == len(got):  # the first number may still grow: only a wrong start decides it
            digits = re.sub(r"\D", "", run.group())
            return want_digits.startswith(digits) or digits.startswith(want_digits)
        return False  # the first number is complete: decided
    if kind == "sentence":
        want = re.sub(r"[^\w\s'-]", " ", normalize(expected, kind)).split()
        words = re.sub(r"[^\w\s'-]", " ", got.casefold()).split()
        ended = not got or not re.match(r"[\w'-]", got[-1])
        complete = words if ended else words[:-1]
        if complete[: len(want)] != want[: len(complete)]:
            return False  # a wrong word
        if len(complete) >= len(want):
            return False  # every word is there
        return ended or want[len(complete)].startswith(words[-1])
    return len(got) <= len(expected) and expected.startswith(got)
