"""The exact-match scorer and its normalisation rules."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.evaluation.scoring import could_still_match, exact_match, normalize


@pytest.mark.parametrize(
    "generated",
    [" 58213.<|im_end|>", "58213", " 58,213.", '"58213"', " **58213**", "58213\n\nThe access code", " 58213 is it"],
)
def test_number_matches(generated):
    assert exact_match("number", "58213", generated)


@pytest.mark.parametrize(
    "generated",
    [" 58231.", " 582139", " 5821", "", " not 1, it is 58213", " 58213"[:3], "\n\n", " fifty-eight thousand"],
)
def test_number_rejects(generated):
    assert not exact_match("number", "58213", generated)


@pytest.mark.parametrize(
    "generated", [" QX-4417-KB.", "QX-4417-KB", ' "QX-4417-KB".', " `QX-4417-KB`", " QX-4417-KB, yes"]
)
def test_identifier_matches(generated):
    assert exact_match("identifier", "QX-4417-KB", generated)


@pytest.mark.parametrize(
    "generated",
    [" QX-4417-KD.", " qx-4417-kb", " QX-4471-KB", " QX-4417-KBC", " QX4417KB", " QX-4417", " The QX-4417-KB"],
)
def test_identifier_rejects(generated):
    # case-sensitive, no extra characters glued on, nothing garbled, and it must open the answer
    assert not exact_match("identifier", "QX-4417-KB", generated)


def test_sentence_rules():
    want = "The violet kettle sings over the frozen harbor."
    assert exact_match("sentence", want, " The violet kettle sings over the frozen harbor.\n\nThis")
    assert exact_match("sentence", want, " the violet kettle sings over the frozen harbor")
    assert exact_match("sentence", want, ' "The violet kettle sings over the frozen harbor!" and more')
    assert not exact_match("sentence", want, " The violet kettle hums over the frozen harbor.")
    assert not exact_match("sentence", want, " The violet kettle sings over the frozen")
    assert not exact_match("sentence", want, " The secret sentence is: The violet kettle sings")
    # only the first line counts
    assert not exact_match("sentence", want, "\nThe violet\nkettle sings over the frozen harbor.")


def test_two_hop_is_scored_as_a_number():
    assert exact_match("two-hop", "671", " 671.<|im_end|>")
    assert not exact_match("two-hop", "671", " room 617, not 671")


def test_normalize_rules():
    assert normalize("  \n  “QX-1”  \nrest") == "QX-1"
    assert normalize("a   b\tc") == "a b c"
    assert normalize("1,234,567", "number") == "1234567"
    assert normalize("The Cat.", "sentence") == "the cat"
    assert normalize("") == ""
    assert not exact_match("identifier", "", "anything")


ANSWERS = {
    "number": "58213",
    "two-hop": "671",
    "identifier": "QX-4417-KB",
    "sentence": "The violet kettle sings over the frozen harbor.",
}


@pytest.mark.parametrize("kind", list(ANSWERS))
@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_early_stop_never_changes_the_score(kind, data):
    """Wherever decoding may stop (could_still_match is False), no continuation changes the score."""
    want = ANSWERS[kind]
    pieces = [want, want[:3], " ", ".", ",", '"', "\n", "x", "1", "7", "KB", " harbor", "The ", "violet"]
    full = "".join(data.draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=6)))
    for cut in range(len(full) + 1):
        prefix = full[:cut]
        if not could_still_match(kind, want, prefix):
            assert exact_match(kind, want, prefix) == exact_match(kind, want, full), (prefix, full)
            break


def test_early_stop_decides_quickly():
    assert could_still_match("number", "58213", " 582")
    assert not could_still_match("number", "58213", " 583")
    assert not could_still_match("number", "58213", " 58213.")
    assert could_still_match("number", "58213", " 58213")  # a sixth digit would make it wrong
    assert not could_still_match("identifier", "QX-4417-KB", "QX-44X")
    assert not could_still_match("identifier", "QX-4417-KB", 'QX-4417-KB"')
    assert could_still_match("sentence", ANSWERS["sentence"], " The violet ket")
    assert not could_still_match("sentence", ANSWERS["sentence"], " The violet kettle hums")
    assert not could_still_match("sentence", ANSWERS["sentence"], " The violet kettle sings over the frozen harbor.")
