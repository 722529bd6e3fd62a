"""Structured output (tandem.engine.structured) in-process on the shipped checkpoint: JSON schemas give JSON that
validates, and a constrained speculative stream equals constrained plain decoding token for token (greedy on every
arm, with adaptive and fixed draft lengths; coupled sampling with a seed); regex, EBNF and any-JSON formats; the
matcher's masks follow the drafts and leave it as it was; bad formats are refused naming the field."""

from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from tandem import schema  # noqa: E402
from tandem.engine.structured import Grammars, ResponseFormat  # noqa: E402
from tandem.schema import WireError  # noqa: E402
from tandem.tools.bench_structured import CASES, response_format  # noqa: E402


SCHEMAS = CASES


def _fmt(s: dict) -> dict:
    return response_format(s)


@pytest.fixture(scope="module")
def fixed(shipped):
    """The shipped engine's models with a fixed draft length: every round of a speculating session drafts its
    most, so rejected drafts (and the matcher's rollback over them) come every round."""
    from tandem.engine.inprocess import Engine

    return Engine(model=shipped.model, tokenizer=shipped.tokenizer, adaptive_draft=False, costs=shipped.costs)


def test_json_schemas_give_valid_json_and_speculation_is_lossless(shipped):
    tok = shipped.tokenizer
    free = tok.decode(shipped.generate(tok.chat_prompt(SCHEMAS[0][0]), 40, spec="off")["token_ids"])
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the miniature writes prose: the mask does the work
        json.loads(free)
    for prompt, s in SCHEMAS:
        ids = tok.chat_prompt(prompt)
        plain = shipped.generate(ids, 200, spec="off", response_format=_fmt(s))
        spec = shipped.generate(ids, 200, spec="dflash2", response_format=_fmt(s))
        assert spec["token_ids"] == plain["token_ids"], prompt
        assert plain["finish_reason"] == "stop", (prompt, tok.decode(plain["token_ids"]))
        assert plain["token_ids"][-1] in tok.stop_ids  # the format ended, then its stop token
        jsonschema.validate(json.loads(tok.decode(plain["token_ids"])), s)


@pytest.mark.parametrize("spec", ["mtp", "dflash", "dflash2"])
def test_every_arm_drafting_every_round_equals_plain(fixed, spec):
    tok = fixed.tokenizer
    drafted = 0
    for prompt, s in SCHEMAS[:6]:
        ids = tok.chat_prompt(prompt)
        plain = fixed.generate(ids, 200, spec="off", response_format=_fmt(s))
        r = fixed.generate(ids, 200, spec=spec, response_format=_fmt(s), num_draft_tokens=4 if spec == "mtp" else None)
        assert r["token_ids"] == plain["token_ids"], (spec, prompt)
        drafted += r["drafted"]
        assert r["accepted"] < r["drafted"]  # drafts were rejected: the matcher rolled back over them
    assert drafted > 0


def test_coupled_sampling_under_a_schema_equals_plain_sampling(shipped):
    tok = shipped.tokenizer
    for prompt, s in SCHEMAS[:5]:
        ids = tok.chat_prompt(prompt)
        kw = dict(temperature=0.8, seed=11, sampling=schema.COUPLED, response_format=_fmt(s))
        plain = shipped.generate(ids, 200, spec="off", **kw)
        spec = shipped.generate(ids, 200, spec="dflash2", **kw)
        assert spec["token_ids"] == plain["token_ids"], prompt
        jsonschema.validate(json.loads(tok.decode(plain["token_ids"])), s)
    ids = tok.chat_prompt(SCHEMAS[1][0])  # rejection sampling: lossless in distribution, valid every time
    r = shipped.generate(ids, 200, spec="dflash2", temperature=0.8, seed=5, response_format=_fmt(SCHEMAS[1][1]))
    jsonschema.validate(json.loads(tok.decode(r["token_ids"])), SCHEMAS[1][1])


def test_regex_grammar_and_any_json(shipped):
    tok = shipped.tokenizer
    ids = tok.chat_prompt("Give me a code.")
    r = shipped.generate(ids, 40, spec="dflash2", response_format={"type": "regex", "regex": "[0-9]{3}-[a-z]{2,4}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", tok.decode(r["token_ids"])), tok.decode(r["token_ids"])
    g = {"type": "grammar", "grammar": 'root ::= "yes" | "no" | "it depends"'}
    r = shipped.generate(ids, 40, spec="mtp", response_format=g)
    assert tok.decode(r["token_ids"]) in ("yes", "no", "it depends")
    r = shipped.generate(ids, 120, spec="off", response_format={"type": "json_object"})
    if r["finish_reason"] == "stop":
        assert isinstance(json.loads(tok.decode(r["token_ids"])), dict)
    else:  # a free-form object the miniature does not close within the budget: still an object's beginning
        assert tok.decode(r["token_ids"]).lstrip().startswith("{")
    plain = shipped.generate(ids, 40, spec="off", response_format={"type": "text"})
    assert plain["token_ids"] == shipped.generate(ids, 40, spec="off")["token_ids"]  # text: no constraint


def test_max_tokens_inside_the_structure_ends_with_length(shipped):
    tok = shipped.tokenizer
    prompt, s = SCHEMAS[5]
    ids = tok.chat_prompt(prompt)
    whole = shipped.generate(ids, 200, spec="off", response_format=_fmt(s))
    cut = shipped.generate(ids, 5, spec="dflash2", response_format=_fmt(s))
    assert cut["finish_reason"] == "length" and cut["token_ids"] == whole["token_ids"][:5]


def test_row_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(shipped, checkpoint):
    tok = shipped.tokenizer
    g = Grammars(checkpoint / "tokenizer.json", shipped.model.cfg.vocab_size, tok.stop_ids)
    c = g.constraint(g.compile(ResponseFormat("regex", "ab[0-9]+c")), 9)
    a, b, seven, cc, x = (tok.encode(t)[0] for t in ("a", "b", "7", "c", "x"))

    def allowed(bm, row):
        return {t for t in (a, b, seven, cc, x) if (int(bm[row, t // 32]) >> (t % 32)) & 1}

    m = c.row_masks([a, b, seven])
    assert [allowed(m, i) for i in range(4)] == [{a}, {b}, {seven}, {seven, cc}]
    again = c.row_masks([x, b])  # x is refused at row 0: the rows after allow everything (the walk stops there)
    assert allowed(again, 0) == {a} and allowed(again, 1) == allowed(again, 2) == {a, b, seven, cc, x}
    c.advance([a, b])  # the emitted tokens: the state moves on
    assert allowed(c.row_masks([]), 0) == {seven}
    with pytest.raises(RuntimeError, match="not allowed"):
        c.advance([cc])
    assert g.stats["mask_rows"] == 4 + 1 + 1 and g.stats["mask_s"] > 0


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "RESPONSE_FORMAT must be a JSON object"),
        ("[1]", "RESPONSE_FORMAT must be a JSON object, got list"),
        ('{"type": "xml"}', "RESPONSE_FORMAT.type must be one of"),
        ('{"type": "json_schema"}', r"RESPONSE_FORMAT.json_schema.schema must be a JSON schema"),
        ('{"type": "regex", "regex": ""}', "RESPONSE_FORMAT.regex must be a non-empty string"),
        ('{"type": "regex", "regex": "a", "grammar": "b"}', r"unknown field\(s\) \['grammar'\]"),
    ],
)
def test_bad_formats_are_refused_naming_the_field(text, match):
    with pytest.raises(WireError, match=match):
        ResponseFormat.parse(text)


def test_formats_that_do_not_compile_are_refused(shipped):
    ids = shipped.tokenizer.chat_prompt("hi")
    bad = [
        (_fmt({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "RESPONSE_FORMAT.json_schema.schema"),
        ({"type": "regex", "regex": "(ab"}, "RESPONSE_FORMAT.regex does not compile"),
        ({"type": "grammar", "grammar": "root ::= undefined_rule"}, "RESPONSE_FORMAT.grammar does not compile"),
    ]
    for fmt, match in bad:
        with pytest.raises(ValueError, match=re.escape(match)):
            shipped.generate(ids, 8, spec="off", response_format=fmt)
    assert ResponseFormat.parse(ResponseFormat("regex", "a+").wire()) == ResponseFormat("regex", "a+")
    assert ResponseFormat.parse('{"type": "text"}') is None and ResponseFormat.parse("") is None


def test_drafts_equal_to_the_constrained_output_are_all_accepted(shipped):
    """The masks line up with the drafts: a verify whose drafts are constrained plain decoding's next tokens gets
    every one of them back as its targets (row i masked with the state after the first i drafts)."""
    from tandem.engine.protocols import Commit, Rows

    tok, trunk, grammars = shipped.tokenizer, shipped.trunk, shipped.sched.admission.grammars
    prompt, s = SCHEMAS[10]
    ids = tok.chat_prompt(prompt)
    want = shipped.generate(ids, 200, spec="off", response_format=_fmt(s))["token_ids"]
    c = grammars.constraint(grammars.compile(ResponseFormat.parse(json.dumps(_fmt(s)))), 9)
    sid = 987654321
    trunk.open([sid])
    try:
        got = [int(trunk.prime([Rows(sid, ids, constraint=c)])[0].argmax[-1])]
        c.advance(got)
        while len(got) + 8 <= len(want):
            drafts = want[len(got) : len(got) + 7]
            out = trunk.verify([Rows(sid, [got[-1], *drafts])])[0]
            assert out.argmax.tolist()[:7] == drafts
            trunk.commit([Commit(sid, 8)])
            got += drafts + [int(out.argmax[7])]
            c.advance(drafts + [got[-1]])
        assert got == want[: len(got)] and len(got) > 16
    finally:
        trunk.close([sid])
