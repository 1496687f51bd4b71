"""On the embedded SmolLM2-135M: a needle found at fp16 is lost by a planted broken format, and the verdict says so.

One short case (a 384-token document, the question as a later chunk): the real model, the real prompt and
scorer, and kvpack's own cache for the honest format.
"""

import pytest
import torch

from kvpack.evaluation.runner import load
from kvpack.evaluation.suite import EvalConfig, run_eval


@pytest.fixture(scope="module")
def smol():
    # one thread: short sequences gain little from a second one, and contending threads on a shared
    # machine cost far more than they give
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load(None)
    torch.set_num_threads(n)


def one_case(**kw):
    base = dict(
        formats=["fp16", "int8"],
        lengths=[384],
        depths=[0.5],
        kinds=["number"],
        fidelity_tokens=0,
        sensitivity_tokens=0,
        speculative_tokens=0,
    )
    base.update(kw)
    return EvalConfig(**base)


def test_real_model_finds_the_needle_and_a_broken_format_loses_it(smol):
    honest = run_eval(one_case(engine="kvpack"), lm=smol)
    case = honest["needles"]["cases"][0]
    assert case["correct"] == {"fp16": True, "int8": True}, case["outputs"]
    assert honest["verdicts"]["int8"]["status"] == "ok"

    broken = run_eval(one_case(engine="simulate"), lm=smol, zero_keys_for=["int8"])
    case = broken["needles"]["cases"][0]
    assert case["correct"] == {"fp16": True, "int8": False}, case["outputs"]
    v = broken["verdicts"]["int8"]
    assert v["status"] == "fails"
    assert "lost 1 of 1 needles fp16 found (first at 384, number, depth 0.5)" in v["text"]
