"""The adaptive draft length (tandem.engine.draft_length) over measured round costs (tandem.engine.round_costs):
one session with a good drafter drafts its whole block; one whose drafts stop landing rests (plain rows, the
same greedy output, counted) and a probe brings it back; a batch whose plain rows are cheap drafts less;
rejection-sampled sessions keep their draft length; resting and plain sessions decode together in one compiled
call; the calibration measures every cost the policy weighs."""

from __future__ import annotations

import pytest
import torch

from tandem import schema
from tandem.engine.calibration import shared_costs
from tandem.engine.draft_length import DraftLength, DraftState
from tandem.engine.inprocess import Engine
from tandem.engine.round_costs import RoundCosts
from tandem.engine.scheduler import Turn
from tandem.model.checkpoint import DEFAULT_CHECKPOINT


class Fixed(RoundCosts):
    """Round costs set by the test and left as they are by the rounds (every decision reproducible): a plain round
    of ``L`` sessions ``plain * L ** 0.6`` ms, a verify round ``v0 + v1 * rows`` ms, a DFlash draft ``draft`` ms."""

    def __init__(self, plain=0.7, v0=0.4, v1=0.12, draft=0.3) -> None:
        super().__init__()
        self.p, self.v0, self.v1, self.d = plain, v0, v1, draft
        self.calibrated = True

    def saw_plain(self, *a) -> None:
        pass

    def saw_verify(self, *a) -> None:
        pass

    def saw_draft(self, *a) -> None:
        pass

    def known(self, specs, compiled: bool = False) -> bool:
        return True

    def plain_s(self, sessions: int) -> float:
        return self.p * sessions**0.6 / 1e3

    def verify_s(self, rows: int, compiled: bool = False) -> float:
        return (self.v0 + self.v1 * rows) / 1e3

    def draft_s(self, spec: str, k: int, compiled: bool = False) -> float:
        return (self.d * k / 2 if spec == schema.MTP else self.d) / 1e3


class Flaky:
    """A real drafter stage whose drafts are replaced by wrong tokens while ``broken`` (acceptance
    collapses), counting the rounds it drafted."""

    def __init__(self, stage) -> None:
        self.stage, self.broken, self.calls, self.drafts = stage, False, 0, []

    def open(self, sids, *a):
        return self.stage.open(sids, *a)

    def close(self, sids):
        return self.stage.close(sids)

    def draft(self, items):
        self.calls += 1
        out = self.stage.draft(items)
        self.drafts.append({it.sid: d for it, d in zip(items, out)})
        return [[(t + 1) % 8192 for t in d] for d in out] if self.broken else out


@pytest.fixture(scope="module")
def base():
    torch.set_num_threads(1)
    return Engine(DEFAULT_CHECKPOINT, "fp32", prefix_cache_mb=0, adaptive_draft=False)


def _engine(base, costs=None, **config) -> tuple[Engine, Flaky]:
    eng = Engine(
        model=base.model,
        tokenizer=base.tokenizer,
        dflash={a: base.drafters[a].drafters[a] for a in schema.DFLASH_SPECS},
        prefix_cache_mb=0,
        probe_rounds=8,
        costs=costs or Fixed(),
        **config,
    )
    flaky = Flaky(eng.drafters[schema.DFLASH2])
    for spec in schema.DFLASH_SPECS:
        eng.drafters[spec] = eng.sched.drafters[spec] = flaky
    return eng, flaky


def _run(eng, prompts, spec, max_tokens=64, **sampling):
    """Generate ``prompts`` as concurrent sessions (``spec``: theirs, or one each); returns their outputs and the
    sessions' final draft-length states."""
    from tandem.engine.sampling import SamplingParams

    out, states = {}, {}
    smp = SamplingParams.create(**sampling) if sampling else None
    turns = [
        Turn(
            i,
            p,
            max_tokens,
            lambda r, e, f, i=i: out.setdefault(i, []).extend(r.tokens if r else [e]),
            spec=spec[i] if isinstance(spec, list) else spec,
            end=False,
            sampling=smp,
        )
        for i, p in enumerate(prompts)
    ]
    eng.sched.admit(turns)
    while eng.sched.turns:
        eng.sched.burst()
    for i in range(len(prompts)):
        states[i] = eng.sched.sessions[i].drafting
        eng.sched.close(i)
    eng.sched.flush_closes()
    return [out[i] for i in range(len(prompts))], states


def _prompts(base, n):
    texts = [
        "Write a short poem about the sea.",
        "How do plants grow?",
        "Explain how a bicycle works.",
        "Describe a sunset.",
        "Give three tips for learning a language.",
        "What is a river?",
        "Tell me about the moon.",
        "Why is the sky blue?",
    ]
    return [base.tokenizer.chat_prompt(t) for t in texts[:n]]


def test_collapse_rests_keeps_greedy_output_and_a_probe_brings_it_back(base):
    eng, flaky = _engine(base)
    prompt = _prompts(base, 1)
    plain, _ = _run(eng, prompt, "off")
    plain96, _ = _run(eng, prompt, "off", 96)
    healthy, st = _run(eng, prompt, schema.DFLASH2)
    assert healthy == plain and not st[0].resting and eng.sched.stats["demotions"] == 0
    flaky.broken = True
    calls0, rounds0 = flaky.calls, eng.sched.stats["rounds"]
    collapsed, st = _run(eng, prompt, schema.DFLASH2, 96)
    assert collapsed == plain96  # the same greedy tokens, plain rows once it rests
    assert st[0].resting and eng.sched.stats["demotions"] >= 1 and st[0].backoff > 1
    rounds = eng.sched.stats["rounds"] - rounds0
    assert flaky.calls - calls0 < rounds / 4  # resting: its first rounds and a few probes draft
    # the drafter recovers (its spec's rate over every session too): the next probe of a resting session brings
    # it back to drafting
    flaky.broken = False
    sched = eng.sched
    sched.draft_length.spec_counts.clear()
    sched.admit([Turn(50, prompt[0], 200, lambda r, e, f: None, spec=schema.DFLASH2, end=False)])
    s = sched.sessions[50]
    s.drafting = DraftState(hit=[0.0] * 7, tried=[5.0] * 7, resting=True, rest_load=1)
    while 50 in sched.turns:
        sched.burst()
    assert sched.stats["promotions"] >= 1 and not s.drafting.resting


def test_a_good_drafter_drafts_its_block_and_load_shortens_it(base):
    """One DFlash2 session alone drafts its whole block in most rounds; eight together, with plain rows cheap
    per token in a batch, draft fewer a round (or none); every output is the session's alone."""
    eng, _ = _engine(base)
    prompts = _prompts(base, 8)
    alone = [_run(eng, [p], schema.DFLASH2, 48)[0][0] for p in prompts]
    drafted0, rounds0 = eng.sched.stats["drafted"], eng.sched.stats["rounds"]
    assert drafted0 / rounds0 > 3  # (7 drafts a drafting round; the first round of a turn and the tail plain)
    together, _ = _run(eng, prompts, schema.DFLASH2, 48)
    assert together == alone
    drafted, rounds = eng.sched.stats["drafted"] - drafted0, eng.sched.stats["rounds"] - rounds0
    assert drafted / rounds < 0.75 * drafted0 / rounds0  # fewer drafts per session-round under load


def test_rejection_sampling_keeps_its_draft_length_coupled_may_rest(base):
    eng, flaky = _engine(base)
    flaky.broken = True
    prompt = _prompts(base, 1)
    d0 = eng.sched.stats["demotions"]
    _, st = _run(eng, prompt, schema.DFLASH2, temperature=0.8, seed=3)
    assert not st[0].resting and eng.sched.stats["demotions"] == d0  # rejection mode: never changed
    plain, _ = _run(eng, prompt, "off", temperature=0.8, seed=3, mode=schema.COUPLED)
    coupled, st = _run(eng, prompt, schema.DFLASH2, temperature=0.8, seed=3, mode=schema.COUPLED)
    assert st[0].resting and eng.sched.stats["demotions"] == d0 + 1
    assert coupled == plain  # a coupled stream is the same under plain decoding


def test_the_plan_weighs_acceptance_against_the_measured_costs():
    """DraftLength.plan on sessions of known acceptance: a good drafter alone drafts all 7, a middling one fewer,
    a poor one none (it rests, and rests() says until its probe; its probe drafts two, and one that does not pay
    doubles the rest); eight whose plain rows are cheap in a batch draft less each, and do not probe when not even
    every draft accepted would pay."""
    from types import SimpleNamespace

    cfg = schema.ServingConfig(probe_rounds=4)

    def session(sid, rate, spec=schema.DFLASH2):
        st = DraftState(hit=[rate * 10] * 7, tried=[10.0] * 7)
        return SimpleNamespace(
            sid=sid,
            spec=spec,
            degraded=False,
            drafting=st,
            demote_eligible=lambda: True,
            draft_budget=lambda: 7,
            prefix_capture=None,
        )

    def policy(costs):  # a policy whose DFlash2 rounds have been measured (a spec never measured drafts its budget)
        p = DraftLength(cfg, costs, {})
        p.spec_counts[schema.DFLASH2] = ([], [])
        return p

    assert DraftLength(cfg, Fixed(), {}).plan([session(0, 0.2)]) == {0: 7}  # its spec's first round: measured
    pol = policy(Fixed())
    good, poor = session(1, 0.95), session(2, 0.2)
    assert pol.plan([good]) == {1: 7}
    assert pol.plan([poor]) == {2: 0} and poor.drafting.resting and pol.rests(poor, 1) > 4  # (plain calls)
    for _ in range(4):
        assert pol.plan([poor]) == {2: 0}
    assert pol.rests(poor, 1) == 0  # its probe is due
    assert pol.plan([poor]) == {2: 2}  # its probe (two drafts), measured anew
    pol.observe(poor, 0, 2)  # nothing accepted
    assert pol.plan([poor]) == {2: 0} and poor.drafting.backoff == 2  # a probe that did not pay: longer rest
    eight = [session(i, 0.8) for i in range(8)]
    ks = policy(Fixed(plain=0.3, v1=0.3)).plan(eight)
    assert sum(ks.values()) < 8 * 7
    assert 0 < policy(Fixed()).plan([session(9, 0.8)])[9] < 7  # the last drafts land too rarely
    crowd = [session(i, 0.95) for i in range(10, 18)]  # resting, probes due, plain rows very cheap in a batch:
    for x in crowd:  # not even every draft accepted would pay, so no probe
        x.drafting.resting, x.drafting.rest_load, x.drafting.since = True, 8, 100
    assert policy(Fixed(plain=0.1)).plan(crowd) == {x.sid: 0 for x in crowd}
    assert all(x.drafting.since == 0 and x.drafting.resting for x in crowd)
    # the same decided by rests() between compiled plain calls, without a verify round: at a new load (a session
    # ended) and with its probe due, a rest that no acceptance could end goes on, its clocks moved as plan's
    cheap, x = policy(Fixed(plain=0.1)), crowd[0]
    assert cheap.rests(x, 7) == 1 << 30 and (x.drafting.rest_load, x.drafting.since) == (7, 0)
    x.drafting.since, backoff = 100, x.drafting.backoff
    assert cheap.rests(x, 7) == 1 << 30 and x.drafting.since == 0 and x.drafting.backoff == min(2 * backoff, 8)
    x.drafting.since = 100  # alone, where drafting can pay: its probe is due, a plan decides
    assert policy(Fixed()).rests(x, 1) == 0


def test_resting_and_plain_sessions_decode_together_in_one_compiled_call(base, monkeypatch):
    """Plain and resting sessions between probe rounds go to the trunk's decode call together (the
    compiled rounds: a resting session costs what a plain one does), with the tokens and rounds of the rounds one
    verify at a time (a probe due inside a compiled call waits for its end)."""
    prompts = _prompts(base, 3)
    specs = [schema.OFF, schema.DFLASH2, schema.DFLASH2]

    def run(compiled: bool):
        eng, flaky = _engine(base, burst_ms=0)  # (bursts by rounds only: where the probes fall is not timing's)
        flaky.broken = True
        calls: list[int] = []
        real = eng.trunk.decode_rows
        if compiled:
            monkeypatch.setattr(eng.trunk, "decode_rows", lambda items, *a: calls.append(len(items)) or real(items, *a))
        else:
            monkeypatch.setattr(eng.trunk, "decode_rows", None)
        out, st = _run(eng, prompts, specs, 96)
        assert st[1].resting and st[2].resting and eng.sched.stats["demotions"] >= 2
        return out, flaky.drafts, calls, eng.sched.stats["rounds"]

    got, drafts, calls, rounds = run(True)
    want, want_drafts, _, want_rounds = run(False)
    plain, _ = _run(_engine(base)[0], prompts, schema.OFF, 96)
    assert got == want == plain and rounds == want_rounds
    assert 0 < len(drafts) <= len(want_drafts) < rounds / 6  # a few probes (no more than round by round)
    assert calls.count(3) >= 2  # the plain session beside both resting ones


def test_calibration_measures_every_cost_once_per_trunk(base):
    """An engine with the adaptive draft length measures the plain round, the verify line and each drafter's
    round at construction; a second engine on the same trunk and settings shares them."""
    dflash = {a: base.drafters[a].drafters[a] for a in schema.DFLASH_SPECS}
    a = Engine(model=base.model, tokenizer=base.tokenizer, dflash=dflash, prefix_cache_mb=0)
    c = a.costs
    assert c.calibrated and c.known([schema.MTP, *schema.DFLASH_SPECS])
    assert set(c.draft_compiled) == set(schema.DFLASH_SPECS) and 0 < c.verify_s(2, True) < c.verify_s(8, True)
    assert 0 < c.plain_s(1) < c.verify_s(8) and c.verify_s(2) < c.verify_s(8)
    assert all(c.draft_s(s, 7) > 0 for s in schema.DFLASH_SPECS) and c.draft_s(schema.MTP, 2) > c.draft_s(schema.MTP, 1)
    b = Engine(model=base.model, tokenizer=base.tokenizer, dflash=dflash, prefix_cache_mb=0)
    assert b.costs is c is shared_costs(base.model, b.config)
