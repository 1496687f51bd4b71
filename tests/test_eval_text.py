"""The user's own text (``--text``), ``--lengths max`` and the time estimate, on the tiny model's byte tokenizer."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from kvpack.errors import ConfigError
from kvpack.evaluation import corpus as corpus_mod
from kvpack.evaluation.corpus import Corpus, builtin_source, load_text
from kvpack.evaluation.estimate import Estimate, Probe, estimate
from kvpack.evaluation.haystack import build_haystack
from kvpack.evaluation.runner import wrap
from kvpack.evaluation.suite import EvalConfig, resolve_lengths, run_eval
from kvpack.evaluation.tiny import ByteTokenizer, tiny_model


def encode(text: str) -> list[int]:
    return ByteTokenizer()(text)["input_ids"]


def numbered_text(n_sentences: int) -> str:
    """Sentences that say where they are: 'Sentence 17 of the notes is here.'"""
    paras = []
    for p in range(0, n_sentences, 5):
        paras.append(" ".join(f"Sentence {i} of the notes is here." for i in range(p, min(p + 5, n_sentences))))
    return "\n\n".join(paras) + "\n"


@pytest.fixture
def notes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(numbered_text(400), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def lm():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = tiny_model(seed=0, max_positions=1024)
    yield wrap(model, tok, "tiny-llama")
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------------
# Reading files: untrusted input, clear errors


def test_plain_text_and_jsonl_are_read(tmp_path, notes):
    data = tmp_path / "chats.jsonl"
    lines = [json.dumps({"text": "First chat.\r\nSecond line.", "id": 1}), "", json.dumps({"text": "  "})]
    lines.append(json.dumps({"text": "Another one."}))
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfWith a mark.\r\nAnd CRLF.\r\n")
    src = load_text([str(notes), str(data), str(bom)])
    assert [f.jsonl for f in src.files] == [False, True, False]
    assert src.files[1].documents == ("First chat.\nSecond line.", "Another one.")  # blank records skipped
    assert src.files[2].documents == ("With a mark.\nAnd CRLF.\n",)
    assert src.files[0].bytes == notes.stat().st_size
    assert src.name == f"{notes}, {data}, {bom}" and not src.builtin


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.txt", "no such file"),
        (b"", "empty.txt", "holds no text"),
        (b"  \n\n\t ", "blank.txt", "holds no text"),
        (b"abc\x00def", "bin.txt", "looks binary (a NUL byte at offset 3)"),
        (b"caf\xe9 au lait", "latin1.txt", "not UTF-8 text (byte 0xe9 at offset 3"),
        (b'{"text": "ok"}\n{"prompt": "no text here"}\n', "a.jsonl", 'line 2 has no "text" field (its keys: prompt)'),
        (b'{"text": "ok"}\nnot json\n', "b.jsonl", "line 2 is not JSON"),
        (b'{"text": 12}\n', "c.jsonl", '"text" is int, not a string'),
        (b'["text"]\n', "d.ndjson", 'line 1 has no "text" field (list)'),
        (b'{"text": ""}\n\n', "e.jsonl", "no line with a non-empty text"),
    ],
)
def test_bad_files_are_refused_with_the_fix(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_text([str(path)])
    assert message in str(info.value) and str(path) in str(info.value)


def test_a_folder_and_too_much_text_are_refused(tmp_path, notes, monkeypatch):
    with pytest.raises(ConfigError, match="is a folder"):
        load_text([str(tmp_path)])
    with pytest.raises(ConfigError, match="not a regular file"):
        load_text(["/dev/null"])
    monkeypatch.setattr(corpus_mod, "MAX_TEXT_BYTES", notes.stat().st_size + 10)
    load_text([str(notes)])  # one file fits
    with pytest.raises(ConfigError, match="more text than --text takes"):
        load_text([str(notes), str(notes)])  # the limit is for all files together


# ----------------------------------------------------------------------------------------------------
# Cutting documents from it


def test_haystacks_are_runs_of_the_text_in_order(notes):
    c = Corpus(load_text([str(notes)]), encode)
    assert c.tokens == len(encode(notes.read_text())) and c.file_tokens == [c.tokens]
    fact = "The access code for the east vault is 58213."
    for seed in (0, 1, 2):
        hay = c.haystack(1000, [fact], [0.5], seed=seed)
        assert abs(hay.n_tokens - 1000) <= 8 and fact in hay.text
        numbers = [int(m) for m in re.findall(r"Sentence (\d+) of", hay.text)]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # consecutive: never shuffled
        assert 0.4 < hay.actual_depths[0] < 0.6
    starts = {re.search(r"Sentence (\d+)", c.haystack(1000, seed=s).text).group(1) for s in range(6)}
    assert len(starts) > 1  # the seed picks where the run starts
    assert c.haystack(1000, seed=3) == c.haystack(1000, seed=3)


def test_passages_are_windows_of_the_tokens(notes):
    c = Corpus(load_text([str(notes)]), encode)
    ids = c.passage(700, seed=5)
    assert len(ids) == 700 and bytes(ids).decode() in notes.read_text()
    assert c.passage(700, seed=5) == ids and c.passage(700, seed=6) != ids
    assert c.passage(c.tokens, seed=1) == encode(notes.read_text())  # the whole text, once
    with pytest.raises(ConfigError, match="tokens of text"):
        c.passage(c.tokens + 1)


def test_several_passages_share_no_text(notes):
    c = Corpus(load_text([str(notes)]), encode)
    texts = c.passages(700, 3, seed=4)
    assert [len(t) for t in texts] == [700] * 3 and c.passages(700, 3, seed=4) == texts
    spans = []
    for t in texts:
        text = bytes(t).decode()
        assert text in notes.read_text()
        numbers = [int(m) for m in re.findall(r"Sentence (\d+) of", text)]
        spans.append((numbers[0], numbers[-1]))
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))  # in order, no sentence in two passages
    assert c.passages(700, 1, seed=4) == [c.passage(700, seed=4)]  # one passage is passage()'s
    with pytest.raises(ConfigError, match=r"3 passages of .* that share none"):
        c.passages(c.tokens // 3 + 1, 3)
    builtin = Corpus(builtin_source(), encode)
    assert builtin.passages(300, 2, seed=7) == [builtin.passage(300, seed=7), builtin.passage(300, seed=8)]


def test_jsonl_documents_are_joined_in_order(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"Document {i} says hello."}) for i in range(50)), encoding="utf-8")
    c = Corpus(load_text([str(path)]), encode)
    text = bytes(c.passage(c.tokens)).decode()
    assert text.startswith("Document 0 says hello.\n\nDocument 1 says") and text.endswith("Document 49 says hello.")
    assert c.describe()["files"] == [
        {"path": str(path), "bytes": path.stat().st_size, "format": "jsonl", "documents": 50, "tokens": c.tokens}
    ]


def test_too_little_text_says_how_much_it_has_and_needs(notes):
    c = Corpus(load_text([str(notes)]), encode)
    have = c.tokens
    c.check([("--lengths 1024", 1024)])  # enough
    with pytest.raises(ConfigError) as info:
        c.check([("--lengths 16384", 16384), ("--fidelity-tokens 2048", 2048), ("--fidelity-tokens 99999", 99999)])
    msg = str(info.value)
    assert f"--text has {have:,} tokens" in msg and f"{notes} {have:,}" in msg
    assert "--lengths 16384 needs 16,384" in msg and "--fidelity-tokens 99999 needs 99,999" in msg
    assert "2048" not in msg  # a part that fits is not listed
    Corpus(builtin_source(), encode).check([("--lengths 1m", 1 << 20)])  # the built-in prose wraps around


def test_the_builtin_prose_is_cut_as_before():
    c = Corpus(builtin_source(), encode)
    facts, depths = ["The part number is QX-1."], [0.3]
    assert c.haystack(600, facts, depths, seed=9) == build_haystack(encode, 600, facts, depths, seed=9)
    assert c.passage(500, seed=7) == encode(build_haystack(encode, 564, seed=7).text)[:500]
    assert c.tokens is None and c.describe()["source"] == "builtin"


def test_an_in_order_haystack_never_repeats_its_sentences():
    short = ["One sentence of five words.", "Another sentence of five words."]
    hay = build_haystack(encode, 400, sentences=short, shuffle=False)
    assert hay.text == " ".join(short) and hay.n_tokens < 400
    assert build_haystack(encode, 400, sentences=short).n_tokens >= 390  # shuffled: wraps around


# ----------------------------------------------------------------------------------------------------
# The sweep on the user's text


def small(**kw):
    base = dict(
        formats=["fp16", "int8"],
        lengths=[192],
        depths=[0.5],
        kinds=["number"],
        fidelity_tokens=256,
        fidelity_chunk=128,
        attribution=[],
        sensitivity_tokens=128,
        speculative_tokens=4,
        speculative_prompts=1,
        speculative_context=192,
        engine="simulate",
    )
    return EvalConfig(**(base | kw))


def test_every_text_of_the_sweep_comes_from_the_file(lm, notes, monkeypatch):
    cut: list[str] = []

    class Spy(Corpus):
        def haystack(self, *a, **k):
            hay = super().haystack(*a, **k)
            cut.append(hay.text)
            return hay

        def passage(self, *a, **k):
            ids = super().passage(*a, **k)
            cut.append(bytes(ids).decode())
            return ids

    monkeypatch.setattr("kvpack.evaluation.suite.Corpus", Spy)
    r = run_eval(small(text=[str(notes)]), lm=lm)
    source = notes.read_text()
    assert len(cut) == 4  # a needle document, the fidelity text, the sensitivity text, a speculative prompt
    for text in cut:
        plain = text.replace(r["needles"]["cases"][0]["facts"][0], "").split()
        assert plain and " ".join(plain) in " ".join(source.split())  # the file's words, in its order
    assert r["text"] == {
        "source": "files",
        "name": str(notes),
        "files": [{"path": str(notes), "bytes": len(source), "format": "text", "documents": 1, "tokens": len(source)}],
        "tokens": len(source),
    }
    assert r["environment"]["haystack_corpus"] == str(notes) and r["config"]["text"] == [str(notes)]
    builtin = run_eval(small(), lm=lm)
    assert builtin["text"]["source"] == "builtin" and "pydoc_data" in builtin["environment"]["haystack_corpus"]
    assert builtin["fidelity"]["variants"]["int8"] != r["fidelity"]["variants"]["int8"]


def test_a_short_text_is_refused_before_the_sweep(lm, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(numbered_text(5), encoding="utf-8")  # about 170 bytes
    with pytest.raises(ConfigError) as info:
        run_eval(small(text=[str(path)]), lm=lm)
    msg = str(info.value)
    assert "--lengths 192 needs 192" in msg and "--fidelity-tokens 256 needs 256" in msg
    assert "the speculative prompts (--speculative-tokens 0 skips them) needs 192" in msg


def test_lengths_max(lm):
    assert resolve_lengths([1024, "max", 1024], 4096) == [1024, 4032]
    assert resolve_lengths(["max", 4032], 4096) == [4032]
    with pytest.raises(ConfigError, match="no usable context window"):
        resolve_lengths(["max"], 0)
    model, tok = tiny_model(seed=0, max_positions=320)
    r = run_eval(small(lengths=[128, "max"], fidelity_tokens=0, sensitivity_tokens=0, speculative_tokens=0),
                 lm=wrap(model, tok, "short"))  # fmt: skip
    assert r["config"]["lengths"] == [128, 256] and r["config"]["lengths_requested"] == [128, "max"]
    assert sorted({c["length"] for c in r["needles"]["cases"]}) == [128, 256]
    assert max(c["doc_tokens"] for c in r["needles"]["cases"]) <= 256
    with pytest.raises(ConfigError, match=re.escape("lengths must be at least 64 tokens (or 'max')")):
        small(lengths=["biggest"]).check()


# ----------------------------------------------------------------------------------------------------
# The estimate


def fake_probe(**kw):
    base = dict(tokens=512, prefill_s=0.25, chunk_s=0.3, step_s=0.025, draft_step_s=0.02, fill_s=0.05, sensitivity_s=0.5,
                text_s=1e-5, weight_flops=2.0e8, attention_flops=4.0 * 9 * 64 * 30)  # fmt: skip
    return Probe(**(base | kw))


def test_probe_arithmetic():
    p = fake_probe()
    assert p.prefill(512) == pytest.approx(0.25) and p.prefill_tok_s == pytest.approx(2048)
    assert p.prefill(4096) > 8 * p.prefill(512)  # attention grows with the square of the length
    assert p.prefill(64) / p.prefill(32) == pytest.approx(p.chunk(64, 0) / p.chunk(32, 0))  # one arithmetic
    assert p.step(512) == pytest.approx(0.025) and p.step(8192) > p.step(512)
    assert p.step(512, draft=True) == pytest.approx(0.02)
    assert p.fill(512) == pytest.approx(0.05) and p.fill(0) == pytest.approx(0.025)
    assert p.chunk(64, 512) == pytest.approx(0.3) and p.chunk(64, 4096) > p.chunk(64, 512)
    # a chunk's fixed part is paid once whatever its length
    fixed = fake_probe(chunk_fixed_s=0.2)
    assert fixed.chunk(64, 512) == pytest.approx(0.3)
    assert fixed.chunk(512, 0) - 0.2 == pytest.approx((p.chunk(512, 0)) / 3)  # 0.1 of 0.3 is per token
    assert p.chunks(1024, 512) == pytest.approx(p.chunk(512, 0) + p.chunk(512, 512))
    assert p.sensitivity(64) == pytest.approx(0.5) and p.sensitivity(256) == pytest.approx(1.0)


def test_estimate_counts_what_the_config_runs():
    p = fake_probe()
    full = estimate(small(lengths=[1024, 2048], depths=[0.1, 0.5, 0.9]), p, 5, 9, 30)
    assert set(full.sections) == {"needles", "fidelity", "sensitivity", "speculative"}
    assert full.seconds == pytest.approx(sum(full.sections.values()))
    bare = estimate(small(fidelity_tokens=0, sensitivity_tokens=0, speculative_tokens=0), p, 5, 0, 30)
    assert set(bare.sections) == {"needles"}
    more = estimate(small(lengths=[1024, 2048], depths=[0.1, 0.5, 0.9]), p, 9, 13, 30)
    assert more.sections["needles"] > full.sections["needles"] and more.seconds > full.seconds
    one_depth = estimate(small(lengths=[1024, 2048], depths=[0.5]), p, 5, 9, 30)
    assert full.sections["needles"] == pytest.approx(3 * one_depth.sections["needles"])
    plan = estimate(small(plan_budget=0.01), p, 2, 2, 30)
    assert plan.sections["plan"] > 0


def test_estimate_line():
    p = fake_probe(prefill_s=512 / 1800, step_s=0.025)
    est = Estimate(14 * 60 + 10, {}, 5, 4, p)
    assert est.line() == "about 14 min for 5 formats x 4 lengths (probe: 1,800 tok/s prefill, 25 ms per decode step)"
    assert Estimate(42.4, {}, 1, 1, p).line().startswith("about 42 s for 1 format x 1 length (")
    assert Estimate(0.2, {}, 2, 1, p).line().startswith("about 1 s for 2 formats")
    assert Estimate(3 * 3600, {}, 2, 1, p).line().startswith("about 3.0 h")


def test_run_eval_tells_the_estimate_before_the_sweep(lm):
    lines: list[str] = []
    order: list[str] = []

    class Progress:
        def start(self, section, total):
            order.append(section)

        def advance(self, n=1):
            pass

        def end(self):
            pass

    def note(line):
        lines.append(line)
        order.append("note")

    r = run_eval(small(), lm=lm, progress=Progress(), notify=note)
    assert any(line.startswith("kvpack eval: about ") and "tok/s prefill" in line for line in lines)
    assert order[0] == "note" and order[-1] != "note"  # told before the first section starts
    est = r["run"]["estimate"]
    assert est["seconds"] > 0 and est["probe"]["prefill_tok_s"] > 0 and set(est["sections"]) >= {"needles"}
    assert "estimate" not in run_eval(small(), lm=lm)["run"]  # no one to tell: no probe
