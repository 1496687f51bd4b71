"""Where the evaluation's text comes from: the built-in prose, or the user's own files (``kvpack eval --text``).

Two things are cut from it, both measured in the model's own tokens:

* **haystacks** (:meth:`Corpus.haystack`): documents with facts planted at depths. From the built-in prose
  (:mod:`kvpack.evaluation.haystack`) a seeded shuffle of sentences; from the user's text a run of it **in
  its own order**, starting at a seeded place, cut into sentences and lines so a fact lands between two of
  them;
* **passages** (:meth:`Corpus.passage`): token windows for the teacher-forced fidelity, the per-layer
  sensitivity and the plan search. From the user's text a window of its tokens at a seeded offset.

The user's text is never repeated: a run that needs more tokens than the files hold is refused up front
(:meth:`Corpus.check`), saying how many tokens there are and how many each part of the sweep needs.

Files are untrusted input: at most :data:`MAX_TEXT_BYTES` in all, UTF-8 (a byte-order mark is dropped), no
NUL bytes; ``.jsonl`` / ``.ndjson`` files hold one JSON object per line with a string ``text`` field (each one
a document); any other file is plain text (one document). Every refusal is a :class:`ConfigError` naming the
file (and line) and the fix.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpack.errors import ConfigError
from kvpack.evaluation.haystack import Haystack, build_haystack

__all__ = ["MAX_TEXT_BYTES", "Corpus", "TextFile", "TextSource", "builtin_source", "load_text"]

MAX_TEXT_BYTES = 16 * 2**20  # all --text files together; the longest sweeps need well under 1 MiB
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_MAX_UNIT_WORDS = 64  # a line without sentence ends (a list, a log, code) is cut every this many words


@dataclass(frozen=True)
class TextFile:
    """One ``--text`` file as read.

    Attributes:
        path: the path as given.
        bytes: its size.
        documents: its documents (plain text: the whole file; JSONL: each line's ``text``), newlines
            normalised to ``\\n``.
        jsonl: read as JSONL.
    """

    path: str
    bytes: int
    documents: tuple[str, ...]
    jsonl: bool


@dataclass(frozen=True)
class TextSource:
    """The text an evaluation cuts its documents from: the built-in prose (``files`` empty) or the user's."""

    files: tuple[TextFile, ...] = ()

    @property
    def builtin(self) -> bool:
        return not self.files

    @property
    def name(self) -> str:
        if self.builtin:
            return f"pydoc_data.topics of Python {platform.python_version()}"
        return ", ".join(f.path for f in self.files)


def builtin_source() -> TextSource:
    """The built-in prose: the Python language reference shipped with CPython (``pydoc_data.topics``)."""
    return TextSource()


def _read(path: str, budget: int) -> tuple[str, int]:
    """The text of ``path`` (UTF-8, at most ``budget`` bytes) and its size; ConfigError saying what is wrong."""
    where = f"--text {path}"
    if not os.path.exists(path):
        raise ConfigError(f"{where}: no such file; give the path of a text or JSONL file")
    if os.path.isdir(path):
        raise ConfigError(f"{where} is a folder; give text or JSONL files (e.g. {os.path.join(path, '*.txt')})")
    if not os.path.isfile(path):
        raise ConfigError(f"{where} is not a regular file (a device or a pipe); save the text to a file and give that")
    try:
        with open(path, "rb") as fh:
            data = fh.read(budget + 1)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e}); check the path and its permissions") from e
    if len(data) > budget:
        mib = MAX_TEXT_BYTES // 2**20
        raise ConfigError(
            f"{where}: more text than --text takes ({mib} MiB in all, files together; a sweep needs well under "
            f"1 MiB); give a part of it, e.g. head -c 1M {path} > part.txt"
        )
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{where} looks binary (a NUL byte at offset {nul:,}); give plain text or JSONL")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start:,} cannot be decoded); "
            f"convert it, e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n"), len(data)


def _jsonl_documents(path: str, text: str) -> list[str]:
    docs = []
    for no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--text {path}: line {no} is not JSON ({e.msg} at column {e.colno}); a .jsonl file holds one "
                'object per line, such as {"text": "..."}'
            ) from None
        if not isinstance(rec, dict) or "text" not in rec:
            keys = f"its keys: {', '.join(map(str, list(rec)[:8]))}" if isinstance(rec, dict) else type(rec).__name__
            raise ConfigError(
                f'--text {path}: line {no} has no "text" field ({keys}); every line needs {{"text": "..."}}, or '
                "give the file as plain text under a name not ending in .jsonl"
            )
        if not isinstance(rec["text"], str):
            raise ConfigError(
                f'--text {path}: line {no}: "text" is {type(rec["text"]).__name__}, not a string; give the text itself'
            )
        if rec["text"].strip():
            docs.append(rec["text"].replace("\r\n", "\n").replace("\r", "\n"))
    return docs


def load_text(paths: Sequence[str]) -> TextSource:
    """Read ``--text`` files (see the module docstring for what is accepted).

    Raises:
        ConfigError: a file is missing, a folder, unreadable, too large (all files together), binary, not
            UTF-8, empty, or a JSONL line is not an object with a string ``text``.
    """
    if not paths:
        raise ConfigError("--text needs at least one file")
    files = []
    left = MAX_TEXT_BYTES
    for path in paths:
        text, size = _read(str(path), left)
        left -= size
        jsonl = str(path).lower().endswith(JSONL_SUFFIXES)
        docs = _jsonl_documents(str(path), text) if jsonl else ([text] if text.strip() else [])
        if not docs:
            what = "no line with a non-empty text" if jsonl else "no text"
            raise ConfigError(f"--text {path}: the file holds {what}; give a file with text in it")
        files.append(TextFile(str(path), size, tuple(docs), jsonl))
    return TextSource(tuple(files))


def _units(document: str) -> list[str]:
    """A document cut into the pieces a fact may be planted between: sentences, within lines, at most
    :data:`_MAX_UNIT_WORDS` words each. Together they keep every word, in order."""
    out = []
    for line in document.split("\n"):
        for sentence in _SENTENCE_END.split(line.strip()):
            words = sentence.split()
            for i in range(0, len(words), _MAX_UNIT_WORDS):
                out.append(" ".join(words[i : i + _MAX_UNIT_WORDS]))
    return [u for u in out if u]


@dataclass
class Corpus:
    """A :class:`TextSource` measured in one tokenizer's tokens.

    Args:
        source: the text.
        encode: text -> token ids without special tokens (:meth:`LoadedModel.encode`).
    """

    source: TextSource
    encode: Callable[[str], list[int]]
    file_tokens: list[int] = field(default_factory=list, init=False)
    _ids: list[int] = field(default_factory=list, init=False, repr=False)
    _units: list[str] = field(default_factory=list, init=False, repr=False)
    _unit_chars: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.source.builtin:
            return
        sep = self.encode("\n\n")
        for f in self.source.files:
            n = 0
            for doc in f.documents:
                ids = self.encode(doc)
                if self._ids:  # documents are joined by a paragraph break, counted with the one after it
                    ids = sep + ids
                self._ids += ids
                n += len(ids)
                self._units += _units(doc)
            self.file_tokens.append(n)
        # characters from each unit to the end: where a haystack may start and still have enough text
        total = 0
        for u in reversed(self._units):
            total += len(u) + 1
            self._unit_chars.append(total)
        self._unit_chars.reverse()

    @property
    def tokens(self) -> int | None:
        """Tokens of the user's text (None: the built-in prose, which wraps around and never runs out)."""
        return None if self.source.builtin else len(self._ids)

    def describe(self) -> dict:
        """What ``results.json`` records of the text: its name and, for files, each one's bytes, documents
        and tokens."""
        out: dict = {"source": "builtin" if self.source.builtin else "files", "name": self.source.name}
        if not self.source.builtin:
            out["files"] = [
                {"path": f.path, "bytes": f.bytes, "format": "jsonl" if f.jsonl else "text",
                 "documents": len(f.documents), "tokens": n}
                for f, n in zip(self.source.files, self.file_tokens)
            ]  # fmt: skip
            out["tokens"] = len(self._ids)
        return out

    def check(self, needs: Sequence[tuple[str, int]]) -> None:
        """Refuse a sweep the user's text is too short for.

        Args:
            needs: ``(what, tokens)`` for each part of the sweep, e.g. ``("--lengths 4096", 4096)``.

        Raises:
            ConfigError: naming the text's tokens and every part that needs more.
        """
        have = self.tokens
        if have is None:
            return
        short = [(what, n) for what, n in needs if n > have]
        if not short:
            return
        per_file = ", ".join(f"{f.path} {n:,}" for f, n in zip(self.source.files, self.file_tokens))
        parts = "; ".join(f"{what} needs {n:,}" for what, n in short)
        raise ConfigError(
            f"--text has {have:,} tokens of text ({per_file}) and the sweep needs more: {parts}; give more text "
            "(it is never repeated) or ask for less"
        )

    # -- cutting ------------------------------------------------------------------------------------
    def haystack(
        self, n_tokens: int, facts: Sequence[str] = (), depths: Sequence[float] = (), seed: int = 0
    ) -> Haystack:
        """A document of ``n_tokens`` tokens with ``facts`` planted at ``depths`` (:func:`build_haystack`)."""
        if self.source.builtin:
            return build_haystack(self.encode, n_tokens, facts, depths, seed=seed)
        # start anywhere that leaves about enough text (characters per token of this text, with a margin)
        chars_per_token = sum(len(u) + 1 for u in self._units) / max(1, len(self._ids))
        need_chars = 1.2 * n_tokens * chars_per_token
        starts = [i for i, c in enumerate(self._unit_chars) if c >= need_chars] or [0]
        start = random.Random(seed).choice(starts)
        hay = build_haystack(
            self.encode, n_tokens, facts, depths, seed=seed, sentences=self._units[start:], shuffle=False
        )
        if start and hay.n_tokens < n_tokens - 8:  # the estimate was off: the whole text from its start
            hay = build_haystack(self.encode, n_tokens, facts, depths, seed=seed, sentences=self._units, shuffle=False)
        if hay.n_tokens < n_tokens - 8:
            raise ConfigError(
                f"--text: a document of {n_tokens:,} tokens does not fit in the text ({len(self._ids):,} tokens, "
                f"{hay.n_tokens:,} of them as a document); give more text or ask for shorter --lengths"
            )
        return hay

    def passage(self, n_tokens: int, seed: int = 0) -> list[int]:
        """``n_tokens`` token ids of running text: a seeded window of the user's text, or of the built-in prose
        (a haystack without facts, as the evaluation always used)."""
        if self.source.builtin:
            return self.encode(build_haystack(self.encode, n_tokens + 64, seed=seed).text)[:n_tokens]
        if n_tokens > len(self._ids):
            raise ConfigError(
                f"--text has {len(self._ids):,} tokens of text and a passage of {n_tokens:,} was asked for; give "
                "more text or ask for less"
            )
        start = random.Random(seed).randrange(len(self._ids) - n_tokens + 1)
        return self._ids[start : start + n_tokens]

    def passages(self, n_tokens: int, count: int, seed: int = 0) -> list[list[int]]:
        """``count`` passages of ``n_tokens`` token ids that share no text: of the built-in prose, one per seed
        (``seed``, ``seed + 1``, ...; the first is :meth:`passage`'s); of the user's text, one seeded window in
        each of ``count`` equal stretches of it (one window: :meth:`passage`'s).

        Raises:
            ConfigError: the user's text holds fewer than ``count * n_tokens`` tokens.
        """
        if self.source.builtin or count == 1:
            return [self.passage(n_tokens, seed + i) for i in range(count)]
        have = len(self._ids)
        if count * n_tokens > have:
            raise ConfigError(
                f"--text has {have:,} tokens of text and {count} passages of {n_tokens:,} tokens that share none "
                f"were asked for ({count * n_tokens:,}); give more text or ask for fewer or shorter passages"
            )
        rng = random.Random(seed)
        out = []
        for i in range(count):
            lo, hi = have * i // count, have * (i + 1) // count  # this passage's stretch of the text
            start = lo + rng.randrange(max(1, hi - lo - n_tokens + 1))
            out.append(self._ids[start : start + n_tokens])
        return out
