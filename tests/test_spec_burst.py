"""Speculative rounds in one compiled call (``tandem.ops.cpu.spec_burst``, ``tandem.engine.compiled_rounds``) against
the same rounds one call at a time (the drafter's compiled round, the trunk's compiled verify pass, the accept walk
and the commit): the drafts, the emitted tokens, the acceptance, the caches and the drafter's context after, on the
shipped checkpoint; and through the engine, every session's tokens and counts with the compiled rounds on and off."""

import pytest
import torch

from tandem.engine.accept import accept_walk
from tandem.engine.inprocess import Engine
from tandem.ops import dispatch
from tandem.ops.cpu import dflash as cpu_dflash, trunk_pass
from tandem.ops.state import ContextKV


@pytest.fixture(scope="module")
def engines(checkpoint):
    on = Engine(checkpoint, prefix_cache_mb=0, adaptive_draft=False)
    off = Engine(
        checkpoint,
        model=on.model,
        tokenizer=on.tokenizer,
        prefix_cache_mb=0,
        adaptive_draft=False,
        compiled_spec_rounds=False,
    )
    return on, off


def _start(e, stage, spec, prompt):
    """A trunk cache primed with ``prompt`` (committed), a fresh drafter context, the anchor and the prompt's
    features (what the drafter takes in first)."""
    m, d = e.model, stage.drafters[spec]
    c = m.new_cache()
    r = trunk_pass.verify_rows(m, [c], [prompt], features=e.trunk.feature_layers)[0]
    c.commit(len(prompt))
    a = d.layers[0].self_attn
    return c, ContextKV(len(d.layers), a.h, a.d, d.fc.weight), int(r["tokens"][-1]), r["features"]


def _rounds_one_at_a_time(e, stage, spec, c, ctx, anchor, feats, k, stops, budget, rounds):
    m, d, head = e.model, stage.drafters[spec], stage.head
    out = []
    for _ in range(rounds):
        drafts, _ = cpu_dflash.draft_round(
            d, m.embed_tokens.weight, head.weight, head.kernels.replace(rows=True), ctx, feats, anchor, k
        )
        v = trunk_pass.verify_rows(m, [c], [[anchor] + drafts], features=e.trunk.feature_layers)[0]
        w = accept_walk(drafts, v["tokens"].tolist(), stops, budget)
        out.append((drafts, w.emitted, w.accepted, v["gaps"][: len(w.emitted)].tolist()))
        budget -= len(w.emitted)
        feats, anchor = v["features"][: len(w.emitted)], w.emitted[-1]
        c.commit(len(w.emitted))
        if w.finish:
            break
    return out, feats


@pytest.mark.parametrize("spec, groups", [("dflash", 1), ("dflash2", 2)])
@torch.no_grad()  # (the compiled calls serve with autograd off)
def test_a_burst_equals_its_rounds_one_call_at_a_time(engines, tokenizer, spec, groups):
    """Two sessions drafting 3 and 5 a round (one compiled call, or one per session on two threads): every round's
    drafts, emitted tokens, acceptance and gaps equal the rounds one call at a time, the second session stopping
    at its budget of 29 tokens; afterwards the next draft and verify from each session's caches and drafter
    context equal the reference's (bit for bit)."""
    e = engines[0]
    stage = e.drafters[spec]
    prompts = [tokenizer.chat_prompt("Explain how a hash table works."), tokenizer.chat_prompt("Name three rivers.")]
    ks, budgets, rounds = [3, 5], [200, 29], 12
    ref = []
    for p, k, b in zip(prompts, ks, budgets):
        c, ctx, anchor, feats = _start(e, stage, spec, p)
        ref.append(_rounds_one_at_a_time(e, stage, spec, c, ctx, anchor, feats, k, (), b, rounds)[0])
    starts = [_start(e, stage, spec, p) for p in prompts]
    out = dispatch.spec_burst(
        e.model,
        stage.drafters[spec],
        stage.head,
        [s[0] for s in starts],
        [s[1] for s in starts],
        [s[2] for s in starts],
        ks,
        [s[3] for s in starts],
        [(), ()],
        budgets,
        rounds,
        e.trunk.feature_layers,
        [range(2)] if groups == 1 else [range(1), range(1, 2)],
    )
    assert sum(len(x[1]) for x in ref[1]) == 29  # (the budget ends the second session's rounds)
    for j in range(2):
        want = ref[j][: len(out[j]["emitted"])]
        assert [x[0] for x in want] == out[j]["drafts"]
        assert [x[1] for x in want] == out[j]["emitted"]
        assert [x[2] for x in want] == out[j]["accepted"]
        assert [x[3] for x in want] == out[j]["gaps"]
        assert sum(out[j]["accepted"]) > 0
    # past the call, each session goes on from where its reference stands after as many rounds
    d, head = stage.drafters[spec], stage.head
    for j in range(2):
        n = len(out[j]["emitted"])
        c, ctx, anchor, feats = _start(e, stage, spec, prompts[j])
        _, feats = _rounds_one_at_a_time(e, stage, spec, c, ctx, anchor, feats, ks[j], (), budgets[j], n)
        c2, ctx2 = starts[j][0], starts[j][1]
        c2.commit(len(out[j]["emitted"][-1]))
        assert torch.equal(feats, out[j]["features"]) and (c.pos, ctx.rows) == (c2.pos, ctx2.rows)
        anchor = out[j]["emitted"][-1][-1]
        nxt = []
        for cc, cx, f in ((c, ctx, feats), (c2, ctx2, out[j]["features"])):
            dr, _ = cpu_dflash.draft_round(
                d, e.model.embed_tokens.weight, head.weight, head.kernels.replace(rows=True), cx, f, anchor, 4
            )
            v = trunk_pass.verify_rows(e.model, [cc], [[anchor] + dr], features=e.trunk.feature_layers)[0]
            nxt.append((dr, v["tokens"].tolist(), v["hidden"]))
        assert nxt[0][:2] == nxt[1][:2] and torch.equal(nxt[0][2], nxt[1][2])


def test_compiled_rounds_give_the_engine_the_rounds_one_call_at_a_time(engines, tokenizer):
    """Through the engine (draft length fixed, 3 drafts a round, the bursts' rounds in compiled calls or one call at a
    time): for each DFlash spec and prompt the tokens, the finish reason, the rounds and the accepted drafts are
    equal, and equal plain decoding's tokens; the compiled path ran (its pace measured) and the one-call path did
    not take it."""
    on, off = engines
    texts = ["Write a haiku about the sea.", "What is a hash table?", "Explain recursion."]
    for spec in ("dflash", "dflash2"):
        for t in texts:
            p = tokenizer.chat_prompt(t)
            a = on.generate(p, max_tokens=61, spec=spec, num_draft_tokens=3)
            b = off.generate(p, max_tokens=61, spec=spec, num_draft_tokens=3)
            plain = off.generate(p, max_tokens=61, spec="off")
            assert a["token_ids"] == b["token_ids"] == plain["token_ids"], (spec, t)
            keys = ("finish_reason", "rounds", "accepted", "drafted")
            assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}, (spec, t)
    assert on.sched.compiled.round_s > 0 and off.sched.compiled.round_s == 0


def _concurrent(eng, prompts, specs, max_tokens, ks=None):
    """``prompts`` as concurrent sessions of ``specs`` drafting ``ks`` (None: the defaults): per session its tokens,
    and the engine's rounds, drafted and accepted drafts."""
    from tandem.engine.session import Turn

    out: dict[int, list] = {}
    turns = [
        Turn(
            100 + i,
            p,
            max_tokens,
            lambda r, e, f, i=i: out.setdefault(i, []).extend(r.tokens if r else [e]),
            spec=a,
            num_draft_tokens=k,
        )
        for i, (p, a, k) in enumerate(zip(prompts, specs, ks or [None] * len(prompts)))
    ]
    before = dict(eng.sched.stats)
    eng.sched.admit(turns)
    while eng.sched.turns:
        eng.sched.burst()
    eng.sched.flush_closes()
    return [out[i] for i in range(len(prompts))], {
        key: eng.sched.stats[key] - before[key] for key in ("rounds", "accepted", "drafted")
    }


def test_plain_and_drafting_sessions_share_the_compiled_rounds(engines, tokenizer):
    """Three sessions of spec ``off`` beside two drafting DFlash2 ones (3 and 7 drafts a round) in one compiled
    call a burst (the plain ones a row a round): every session's tokens equal plain decoding's and the run with the
    rounds one call at a time, rounds and accepted drafts included; the compiled path ran."""
    on, off = engines
    texts = ["Write a haiku about the sea.", "What is a hash table?", "Explain recursion.", "Name three rivers."]
    prompts = [tokenizer.chat_prompt(t) for t in texts] + [tokenizer.chat_prompt(texts[0])]
    specs, ks = ["off", "dflash2", "off", "off", "dflash2"], [None, 3, None, None, 7]
    calls = []
    real = on.trunk.spec_burst
    on.trunk.spec_burst = lambda items, *a: calls.append(len(items)) or real(items, *a)
    try:
        got, counts = _concurrent(on, prompts, specs, 45, ks)
    finally:
        del on.trunk.spec_burst
    want, want_counts = _concurrent(off, prompts, specs, 45, ks)
    plain, _ = _concurrent(off, prompts, ["off"] * 5, 45)
    assert got == want == plain and counts == want_counts and counts["accepted"] > 0
    assert calls and max(calls) == 5
