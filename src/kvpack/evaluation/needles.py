"""Needles: facts to plant in a haystack, the question that asks for them, and the exact answer.

Kinds:

* ``number``: a five-digit code;
* ``identifier``: a made-up part number such as ``QX-4417-KB`` (letters, digits, dashes: the kind of string
  a quantized cache garbles first);
* ``sentence``: a short nonsense sentence to reproduce word for word;
* ``two-hop``: two linked facts half a document apart: the object is kept in a room named by its colour;
  a second fact gives that room's number. The question names the object; the answer is in the second fact.
  With no other numbered room in the document a model can shortcut through "room number", so this is
  retrieval of a far fact the question does not name;
* ``two-hop-strict``: the same plus a distractor (another colour's room number), so the answer needs both
  facts. Not in the default sweep: SmolLM2-135M answers it at chance even in full precision (1 of 6 at 2k).

Values come from a seeded :class:`random.Random`, so a seed gives the same needles everywhere. The answer
is primed (the assistant turn starts with the words that lead to it), which small models need and which
keeps the scored span short.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from kvpack.errors import ConfigError

__all__ = ["DEFAULT_KINDS", "KINDS", "Probe", "make_probe"]

KINDS = ("number", "identifier", "sentence", "two-hop", "two-hop-strict")
DEFAULT_KINDS = ("number", "identifier", "sentence", "two-hop")

_PLACES = ["archive room", "north gate", "boiler room", "river lock", "signal tower", "east vault", "seed bank"]
_MACHINES = ["cooling pump", "main valve", "drive belt", "pressure gauge", "fuel filter", "lift motor"]
_ADJ = ["violet", "silent", "copper", "frozen", "hollow", "amber", "restless", "crooked", "velvet", "distant"]
_NOUN = ["kettle", "lantern", "harbor", "orchard", "compass", "meadow", "glacier", "violin", "tunnel", "falcon"]
_VERB = ["sings", "sleeps", "wanders", "glows", "waits", "dances", "hums", "drifts"]
_PREP = ["over", "beneath", "beside", "behind", "across", "inside"]
_OBJECTS = ["red umbrella", "brass key", "blue notebook", "silver watch", "old map", "green scarf"]
_COLOURS = ["yellow", "purple", "orange", "white", "black", "grey"]


@dataclass(frozen=True)
class Probe:
    """One retrieval test: facts to plant, a question, the primed answer start and the expected answer.

    Attributes:
        kind: one of :data:`KINDS`.
        facts: the sentences to plant (two for ``two-hop``).
        question: asked after the document, as a separate chunk.
        answer_prefix: the start of the assistant's answer, fed with the question.
        answer: what must come next for the answer to count (scored by :mod:`kvpack.evaluation.scoring`).
    """

    kind: str
    facts: tuple[str, ...]
    question: str
    answer_prefix: str
    answer: str


def _identifier(rng: random.Random) -> str:
    up = string.ascii_uppercase
    return f"{rng.choice(up)}{rng.choice(up)}-{rng.randint(1000, 9999)}-{rng.choice(up)}{rng.choice(up)}"


def make_probe(kind: str, rng: random.Random) -> Probe:
    """A fresh probe of ``kind`` with values drawn from ``rng``."""
    if kind == "number":
        place = rng.choice(_PLACES)
        code = str(rng.randint(10000, 99999))
        return Probe(
            kind,
            (f"The access code for the {place} is {code}.",),
            f"What is the access code for the {place}?",
            f"The access code for the {place} is",
            code,
        )
    if kind == "identifier":
        machine = rng.choice(_MACHINES)
        ident = _identifier(rng)
        # quoted, and the answer primed with the opening quote: SmolLM2-135M then copies it at every depth
        # tested, where the unquoted phrasing drifted to numbers from the surrounding prose at shallow depths
        return Probe(
            kind,
            (f'The part number of the {machine} is "{ident}".',),
            f"What is the part number of the {machine}?",
            f'The part number of the {machine} is "',
            ident,
        )
    if kind == "sentence":
        a1, a2 = rng.sample(_ADJ, 2)
        n1, n2 = rng.sample(_NOUN, 2)
        sentence = f"The {a1} {n1} {rng.choice(_VERB)} {rng.choice(_PREP)} the {a2} {n2}."
        return Probe(
            kind,
            (f"The secret sentence is: {sentence}",),
            "What is the secret sentence? Repeat it word for word.",
            "The secret sentence is:",
            sentence,
        )
    if kind in ("two-hop", "two-hop-strict"):
        obj = rng.choice(_OBJECTS)
        colour, other = rng.sample(_COLOURS, 2)
        room, decoy = (str(n) for n in rng.sample(range(100, 1000), 2))
        facts = (f"The {obj} is kept in the {colour} room.", f"The {colour} room is room number {room}.")
        if kind == "two-hop-strict":
            facts += (f"The {other} room is room number {decoy}.",)
        return Probe(
            kind,
            facts,
            f"What is the number of the room where the {obj} is kept?",
            f"The {obj} is kept in room number",
            room,
        )
    raise ConfigError(f"unknown needle kind {kind!r}; kinds are: {', '.join(KINDS)}")
