"""Speculative sessions: the tparallel gate after every burst, greedy spec == plain (fp32),
receipts, and bad input."""

import pytest
import torch

from tandem.engine import Engine
from tandem.gate import tparallel_gate
from tandem.worker import Turn


@pytest.fixture(scope="module")
def engine(trunk_fp32, tokenizer):
    return Engine(model=trunk_fp32, tokenizer=tokenizer, k=3, burst_rounds=2)


def test_tparallel_gate_after_every_burst(engine, tokenizer, sharegpt_prompts):
    """After every burst the fp32 trunk state equals a fresh prime of `committed` within 1e-5,
    over prompts long enough for sparse DSA, with rejected drafts."""
    sched = engine.sched
    worst, bursts, rejected = 0.0, 0, 0
    for i, p in enumerate(sharegpt_prompts[:4]):
        ids = tokenizer.chat_prompt(p + " " + sharegpt_prompts[i + 5])[:200]
        sid = 7000 + i
        got = []
        sched.admit([Turn(sid, ids, 48, lambda r, e, f: got.append((r, e)), spec="mtp")])
        while sid in sched.turns:
            sched.burst()
            s = sched.sessions.get(sid)
            if s is None:
                break
            d = tparallel_gate(engine.model, engine.trunk.cache(sid), s.committed)
            worst = max(worst, max(d.values()))
            bursts += 1
        rejected += sum(r.drafted - r.accepted for r, _ in got if r is not None)
        sched.close(sid)
    assert bursts >= 8 and rejected > 0
    assert worst <= 1e-5, worst


def test_greedy_spec_equals_plain_fp32(engine, tokenizer, sharegpt_prompts):
    taus = []
    for p in sharegpt_prompts:
        ids = tokenizer.chat_prompt(p)
        a = engine.generate(ids, 48, spec="mtp")
        b = engine.generate(ids, 48, spec="off")
        assert a["token_ids"] == b["token_ids"]
        assert a["rounds"] < b["rounds"] or a["accepted"] == 0
        assert b["accepted"] == 0 and b["drafted"] == 0
        taus.append(a["mean_acceptance_length"])
    print(f"mean acceptance length over {len(taus)} prompts: {sum(taus) / len(taus):.2f}")


def test_receipts_account_for_every_token(engine, tokenizer):
    ids = tokenizer.chat_prompt("Write a Python function that reverses a string.")
    bursts = []
    out = engine.generate(ids, 30, spec="mtp", on_burst=bursts.append)
    assert sum(len(r.tokens) for r in bursts) == len(out["token_ids"]) <= 30
    assert sum(r.rounds for r in bursts) == out["rounds"]
    # 1 token from prime, then each round emits accepted + 1, except that a round cut short by the
    # turn budget (or a stop token) among its accepted drafts emits only the accepted ones
    short = out["rounds"] + out["accepted"] - (len(out["token_ids"]) - 1)
    assert short == 0 or (short == 1 and out["finish_reason"] in ("length", "stop"))
    assert out["mean_acceptance_length"] == pytest.approx(1 + out["accepted"] / out["rounds"])
    assert sum(out["accepted_at"]) == out["accepted"]


def test_plain_matches_full_recompute_greedy(engine, tokenizer):
    """Plain decoding equals argmax of a full forward re-run on the growing sequence."""
    model = engine.model
    ids = tokenizer.chat_prompt("Explain what a hash map is.")
    out = engine.generate(ids, 12, spec="off")
    seq = list(ids)
    with torch.no_grad():
        for t in out["token_ids"]:
            nxt = int(model.logits(model.hidden(torch.tensor([seq])))[0, -1].argmax())
            assert nxt == t
            seq.append(t)


@pytest.mark.parametrize("kw,field", [({"max_tokens": 0}, "max_tokens"), ({"spec": "eagle"}, "spec"),
                                      ({"k": 99}, "num_draft_tokens"), ({"tokens": [10**6]}, "input_ids"),
                                      ({"tokens": []}, "input_ids"), ({"tokens": [5] * 5000}, "input_ids"),
                                      ({"start": False}, "sequence id")])
def test_bad_turns_get_clear_errors_and_others_continue(engine, tokenizer, kw, field):
    sched = engine.sched
    good = []
    sched.admit([Turn(9001, tokenizer.chat_prompt("Hello there"), 20, lambda r, e, f: good.append((r, e, f)))])
    errs = []
    args = {"sid": 9002, "tokens": tokenizer.encode("hi"), "max_tokens": 5, "spec": "mtp", "start": True, "k": None}
    args.update(kw)
    sched.admit([Turn(args["sid"], args["tokens"], args["max_tokens"], lambda r, e, f: errs.append((e, f)),
                      spec=args["spec"], start=args["start"], k=args["k"])])
    assert len(errs) == 1 and errs[0][1] is True and field in errs[0][0]
    assert 9002 not in sched.sessions
    while 9001 in sched.turns:
        sched.burst()
    assert good[-1][2] is True and good[-1][1] is None
    assert 9001 not in sched.sessions  # END closes it
    assert not engine.trunk.caches.get(9002) and not engine.trunk.caches.get(9001)


def test_multi_turn_session_and_idle_expiry(engine, tokenizer):
    sched = engine.sched
    got = []
    emit = lambda r, e, f: got.append((r, e, f))
    sched.admit([Turn(9100, tokenizer.chat_prompt("Name a color."), 8, emit, end=False)])
    while 9100 in sched.turns:
        sched.burst()
    s = sched.sessions[9100]
    n1 = len(s.committed)
    sched.admit([Turn(9100, tokenizer.encode("<|user|>\nAnother one.<|assistant|>\n"), 8, emit, start=False, end=False)])
    while 9100 in sched.turns:
        sched.burst()
    assert len(s.committed) > n1 and all(e is None for _, e, _ in got)
    d = tparallel_gate(engine.model, engine.trunk.cache(9100), s.committed)
    assert max(d.values()) <= 1e-5
    assert sched.expire_idle(now=s.last_active + sched.idle_timeout_s + 1) == [9100]
    assert 9100 not in sched.sessions and 9100 not in engine.trunk.caches
