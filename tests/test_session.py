"""Speculative sessions: the tparallel gate after every burst, greedy spec == plain (fp32),
receipts, and bad input."""

import pytest
import torch

from tandem import schema
from tandem.engine.gate import tparallel_gate
from tandem.engine.inprocess import Engine
from tandem.engine.scheduler import Turn


@pytest.fixture(scope="module")
def engine(trunk_fp32, tokenizer):
    """MTP with 3 drafts, 2 rounds a burst, adaptive draft length off (these tests measure the spec itself;
    tests/test_draft_length.py covers the adaptive draft length)."""
    return Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, burst_rounds=2, adaptive_draft=False)


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
            if s.prefill is not None:  # still primed in pieces (the prefill budget): no anchor yet
                continue
            cache = engine.trunk.cache(sid)  # the last commit is deferred into the next verify
            assert s.trunk_commit >= 1 and cache.pending is not None and cache.pos + s.trunk_commit == len(s.committed)
            sched.settle()
            assert s.trunk_commit == 0 and cache.pending is None
            d = tparallel_gate(engine.model, cache, s.committed)
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
        # the MTP drafter predicts this trunk's continuations: every prompt accepts drafts
        assert a["accepted"] > 0 and a["rounds"] < b["rounds"], (p[:60], a["accepted"], a["rounds"])
        assert b["accepted"] == 0 and b["drafted"] == 0 and b["mean_acceptance_length"] == 1.0
        taus.append(a["mean_acceptance_length"])
    mean_tau = sum(taus) / len(taus)
    print(f"mean acceptance length over {len(taus)} prompts: {mean_tau:.2f}")
    assert mean_tau >= 1.5


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


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_tokens": 0}, "MAX_TOKENS must be in [1, 4096], got 0"),
        ({"spec": "eagle"}, "SPEC must be one of"),
        ({"k": 99}, "NUM_DRAFT_TOKENS must be in [1, 8], got 99"),
        ({"tokens": [10**6]}, "INPUT_IDS: token ids must be in [0, 8192), got 1000000"),
        ({"tokens": []}, "INPUT_IDS: the first turn"),
        ({"tokens": [5] * 5000}, "INPUT_IDS"),
        ({"start": False}, "sequence_id: unknown sequence id 9002"),
    ],
)
def test_bad_turns_get_clear_errors_and_others_continue(engine, tokenizer, kw, field):
    sched = engine.sched
    good = []
    sched.admit([Turn(9001, tokenizer.chat_prompt("Hello there"), 20, lambda r, e, f: good.append((r, e, f)))])
    errs = []
    args = {"sid": 9002, "tokens": tokenizer.encode("hi"), "max_tokens": 5, "spec": "mtp", "start": True, "k": None}
    args.update(kw)
    sched.admit(
        [
            Turn(
                args["sid"],
                args["tokens"],
                args["max_tokens"],
                lambda r, e, f: errs.append((e, f)),
                spec=args["spec"],
                start=args["start"],
                num_draft_tokens=args["k"],
            )
        ]
    )
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

    def emit(r, e, f):
        got.append((r, e, f))

    sched.admit([Turn(9100, tokenizer.chat_prompt("Name a color."), 8, emit, end=False)])
    while 9100 in sched.turns:
        sched.burst()
    s = sched.sessions[9100]
    n1 = len(s.committed)
    sched.admit([Turn(9100, tokenizer.chat_prompt("Another one."), 8, emit, start=False, end=False)])
    while 9100 in sched.turns:
        sched.burst()
    assert len(s.committed) > n1 and all(e is None for _, e, _ in got)
    sched.settle()
    d = tparallel_gate(engine.model, engine.trunk.cache(9100), s.committed)
    assert max(d.values()) <= 1e-5
    assert sched.expire_idle(now=s.last_active + sched.config.idle_timeout_s + 1) == [9100]
    assert 9100 not in sched.sessions and 9100 not in engine.trunk.caches


def _drive(sched, sid):
    while sid in sched.turns:
        sched.burst()


def test_forced_context_finish(trunk_fp32, tokenizer):
    """A turn that runs into the context capacity ends with finish "context"; the session keeps
    exactly max_ctx - 1 committed rows plus the anchor and passes the tparallel gate."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, max_ctx=48)
    ids = tokenizer.chat_prompt("Count from one to one hundred, one number per line.")
    assert len(ids) < 40
    got = []
    eng.sched.admit([Turn(1, ids, 40, lambda r, e, f: got.append((r, e, f)), end=False)])
    _drive(eng.sched, 1)
    s = eng.sched.sessions[1]
    final = got[-1][0]
    assert got[-1][2] and final.finish_reason == "context" and s.finish_reason == "context" and s.finished()
    assert len(s.committed) == s.pos() == 47 and s.anchor is not None
    emitted = [t for r, _, _ in got for t in r.tokens]
    assert len(ids) + len(emitted) == 48 and s.committed == ids + emitted[:-1]
    eng.sched.settle()
    assert max(tparallel_gate(eng.model, eng.trunk.cache(1), s.committed).values()) <= 1e-5
    errs = []
    eng.sched.admit([Turn(1, [5], 4, lambda r, e, f: errs.append(e), start=False)])
    assert errs and errs[0].startswith("INPUT_IDS: 48 context + 1 new tokens leaves no room")
    eng.sched.close(1)


@pytest.mark.parametrize("spec", ["mtp", "off"])
def test_session_contract_members(engine, tokenizer, spec):
    """Each session-contract member's documented behaviour on the specs that exist."""
    sched = engine.sched
    sid = 9300
    sched.admit(
        [Turn(sid, tokenizer.chat_prompt("Name three rivers."), 24, lambda r, e, f: None, spec=spec, end=False)]
    )
    s = sched.sessions[sid]
    assert s.rounds == 0 and s.mean_acceptance_length() is None
    _drive(sched, sid)
    assert s.cache_max_ctx() == engine.config.max_ctx
    sched.settle()
    assert s.pos() == len(s.committed) == engine.trunk.cache(sid).pos
    assert s.cache_ref() is engine.trunk.cache(sid) and s.cache_ref().pending is None
    assert s.rounds > 0 and s.mean_acceptance_length() == pytest.approx(1 + s.accepted / s.rounds)
    assert (s.accepted > 0) == (spec == "mtp")
    assert s.finish_reason == "length" and not s.finished()
    # no spec that exists keeps a prefix capture or a block drafter's KV tail
    assert s.take_prefix_capture() is None and not s.prefix_capture_ready()
    assert s.export_draft_tail(s.pos()) is None and s.export_draft_tail(1) is None
    assert s.demote_eligible()
    sched.close(sid)
    sched.burst()
    assert sid not in engine.trunk.caches and sid not in engine.drafters["mtp"].states


def test_two_turns_for_one_sequence_in_one_drain(engine, tokenizer):
    """Two START turns for one sequence id in the same admission: the first runs, the second gets
    one final error naming the id; an unrelated running sequence is untouched; nothing leaks."""
    sched = engine.sched
    other, first, second = [], [], []
    sched.admit([Turn(9400, tokenizer.chat_prompt("Hello"), 12, lambda r, e, f: other.append((r, e, f)))])
    sched.burst()
    sched.admit(
        [
            Turn(9401, tokenizer.chat_prompt("Hi"), 8, lambda r, e, f: first.append((r, e, f))),
            Turn(9401, tokenizer.chat_prompt("Hi again"), 8, lambda r, e, f: second.append((r, e, f))),
        ]
    )
    assert second == [(None, "sequence_id: sequence id 9401 sent two turns at once; the first one runs", True)]
    _drive(sched, 9401)
    _drive(sched, 9400)
    assert first[-1][2] and first[-1][1] is None and other[-1][2] and other[-1][1] is None
    assert all(e is None for _, e, _ in other)
    assert (
        9400 not in engine.trunk.caches
        and 9401 not in engine.trunk.caches
        and 9401 not in engine.drafters["mtp"].states
    )


class _FailingPrime:
    """A trunk stage whose next prime raises (a dead or failing stage model)."""

    def __init__(self, stage):
        self.stage, self.fail = stage, False

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def prime(self, items):
        if self.fail:
            self.fail = False
            raise RuntimeError("trunk.prime: stage process gone")
        return self.stage.prime(items)


def test_stage_failure_during_admission(trunk_fp32, tokenizer):
    """A stage call that fails while turns are admitted: each of them gets one final error naming the
    stage, no state is left for them, a running session continues, and the next request works."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=2)
    trunk = _FailingPrime(eng.trunk)
    sched = type(eng.sched)(trunk, eng.drafters, eng.config, stop_ids=tokenizer.stop_ids)
    running, failed = [], []
    sched.admit([Turn(1, tokenizer.chat_prompt("Hello"), 16, lambda r, e, f: running.append((r, e, f)), spec="mtp")])
    trunk.fail = True
    sched.admit(
        [Turn(s, tokenizer.chat_prompt("Hi"), 8, lambda r, e, f: failed.append((e, f)), spec="mtp") for s in (2, 3)]
    )
    assert failed == [("admission failed: RuntimeError: trunk.prime: stage process gone", True)] * 2
    assert set(sched.sessions) == {1} and set(eng.trunk.caches) == {1} and set(eng.drafters["mtp"].states) == {1}
    _drive(sched, 1)
    assert running[-1][2] and all(e is None for _, e, _ in running)
    ok = []
    sched.admit([Turn(4, tokenizer.chat_prompt("Hi"), 4, lambda r, e, f: ok.append((r, e, f)))])
    _drive(sched, 4)
    assert ok[-1][2] and ok[-1][1] is None and not eng.trunk.caches


class _OracleDrafter:
    """Drafts the trunk's own greedy continuation (known in advance), so every draft is accepted."""

    def __init__(self, prompt, continuation):
        self.seq, self.pos = list(prompt) + list(continuation), {}

    def open(self, sids):
        for s in sids:
            self.pos[s] = 0

    def close(self, sids):
        for s in sids:
            self.pos.pop(s, None)

    def draft(self, items):
        out = []
        for it in items:
            self.pos[it.sid] += len(it.next_tokens)  # rows ingested so far; the anchor sits at this position
            p = self.pos[it.sid] + 1
            out.append(self.seq[p : p + it.num_draft_tokens])
        return out


@pytest.mark.parametrize("max_ctx", [40, 41, 42, 43])
def test_context_capacity_holds_when_every_draft_is_accepted(engine, tokenizer, max_ctx):
    """Prompt + emitted tokens never exceed max_ctx, even when whole blocks are accepted at the edge."""
    from tandem.engine.scheduler import Scheduler
    from tandem.schema import ServingConfig

    ids = tokenizer.chat_prompt("Tell me a long story about a lighthouse keeper and the sea, in many short sentences.")[
        :20
    ]
    assert len(ids) == 20
    plain = engine.generate(ids, 60, spec="off")["token_ids"]
    cfg = ServingConfig(max_ctx=max_ctx, num_draft_tokens=4)
    sched = Scheduler(engine.trunk, {"mtp": _OracleDrafter(ids, plain)}, cfg, stop_ids=())
    got = []
    sched.admit([Turn(77, ids, 30, lambda r, e, f: got.append((r, e, f)), end=False)])
    while 77 in sched.turns:
        sched.burst()
    assert all(e is None for _, e, _ in got), [e for _, e, _ in got]
    emitted = [t for r, _, _ in got for t in r.tokens]
    s = sched.sessions[77]
    assert got[-1][0].finish_reason == "context" and emitted == plain[: len(emitted)]
    assert len(ids) + len(emitted) == max_ctx and len(s.committed) == max_ctx - 1
    assert s.accepted == s.drafted  # the oracle's drafts were all accepted
    sched.close(77)
    sched.burst()


def test_later_turn_changes_num_draft_tokens(engine, tokenizer):
    """NUM_DRAFT_TOKENS on a later turn applies to that turn (the spec stays)."""
    sched = engine.sched
    got = []
    emit = lambda r, e, f: got.append((r, e, f))  # noqa: E731
    sched.admit(
        [
            Turn(
                9500,
                tokenizer.chat_prompt("Name a fruit."),
                6,
                emit,
                end=False,
                num_draft_tokens=1,
                spec=schema.DFLASH2,
            )
        ]
    )
    while 9500 in sched.turns:
        sched.burst()
    s = sched.sessions[9500]
    assert s.num_draft_tokens == 1 and s.drafted == s.rounds
    d0, r0 = s.drafted, s.rounds
    sched.admit([Turn(9500, tokenizer.chat_prompt("Another."), 20, emit, start=False, num_draft_tokens=4)])
    while 9500 in sched.turns:
        sched.burst()
    assert all(e is None for _, e, _ in got) and s.num_draft_tokens == 4 and len(s.accepted_at) == 4
    assert s.drafted - d0 == 4 * (s.rounds - r0)


def test_stop_token_ids_cut_inside_an_accepted_block(trunk_fp32, tokenizer):
    """A turn's STOP_TOKEN_IDS end it where plain decoding first produces one of them, also when that
    token is an accepted draft with more of the block after it: nothing after it is emitted, the trunk
    cache holds exactly the emitted context (the rest of the block rolled back), the receipts count
    only emitted tokens, and the stop token stays context for the next turn (it is not the template's)."""
    eng = Engine(model=trunk_fp32, tokenizer=tokenizer, num_draft_tokens=3, burst_rounds=1, adaptive_draft=False)
    ids = tokenizer.chat_prompt("Write a Python function that reverses a string.")
    ref = eng.generate(ids, 40, spec="off")["token_ids"]
    rounds: list[list[int]] = []
    eng.generate(ids, 40, spec="mtp", on_burst=lambda r: rounds.append(list(r.tokens)))  # one receipt per round
    ends, n = set(), 0
    for toks in rounds:
        n += len(toks)
        ends.add(n - 1)  # index of each round's last token
    inside = 0
    for k in range(1, 30):
        x = ref[k]
        if ref.index(x) != k or x in tokenizer.stop_ids:
            continue
        sid, got = 9700 + k, []
        eng.sched.admit(
            [Turn(sid, ids, 40, lambda r, e, f: got.append((r, e)), spec="mtp", end=False, stop_token_ids=(x,))]
        )
        while sid in eng.sched.turns:
            eng.sched.burst()
        assert all(e is None for _, e in got)
        out = [t for r, _ in got for t in r.tokens]
        assert out == ref[: k + 1] and got[-1][0].finish_reason == "stop", k
        s = eng.sched.sessions[sid]
        eng.sched.settle()
        assert s.committed == ids + ref[:k] and s.anchor == x and eng.trunk.cache(sid).pos == len(s.committed)
        assert sum(r.rounds for r, _ in got) == s.rounds and sum(len(r.tokens) for r, _ in got) == k + 1
        if k not in ends:
            inside += 1
            if inside == 1:  # the next turn keeps the stop token as context (one ordinary token)
                nxt = tokenizer.chat_prompt("Thanks")
                eng.sched.admit([Turn(sid, nxt, 2, lambda r, e, f: None, start=False)])
                assert s.committed == ids + ref[: k + 1] + nxt
                while sid in eng.sched.turns:
                    eng.sched.burst()
        eng.sched.close(sid)
    assert inside >= 2, "no stop landed inside an accepted block: the case is not exercised"
