"""Demotion (tandem.engine.demotion): a session whose speculation stops paying decodes plain rows,
with the same greedy output, counted; load raises the bar; rejection-sampled sessions never move;
a probe promotes a session whose drafter recovered."""

from __future__ import annotations

import pytest
import torch

from tandem import schema
from tandem.engine.inprocess import Engine
from tandem.engine.scheduler import Turn
from tandem.model.checkpoint import DEFAULT_CHECKPOINT


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
    return Engine(DEFAULT_CHECKPOINT, "fp32", prefix_cache_mb=0)


def _engine(base, **config) -> tuple[Engine, Flaky]:
    eng = Engine(
        model=base.model,
        tokenizer=base.tokenizer,
        dflash={a: base.drafters[a].drafters[a] for a in schema.DFLASH_SPECS},
        prefix_cache_mb=0,
        demote_probe_rounds=8,
        **config,
    )
    flaky = Flaky(eng.drafters[schema.DFLASH2])
    for spec in schema.DFLASH_SPECS:
        eng.drafters[spec] = eng.sched.drafters[spec] = flaky
    return eng, flaky


def _run(eng, prompts, spec, max_tokens=64, **sampling):
    """Generate ``prompts`` as concurrent sessions (``spec``: theirs, or one each); returns their outputs and
    sessions' final states."""
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
        states[i] = eng.sched.sessions[i].demotion
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


def test_collapse_demotes_keeps_greedy_output_and_a_probe_promotes(base):
    eng, flaky = _engine(base)
    prompt = _prompts(base, 1)
    plain, _ = _run(eng, prompt, "off")
    plain96, _ = _run(eng, prompt, "off", 96)
    healthy, st = _run(eng, prompt, schema.DFLASH2)
    assert healthy == plain and not st[0].demoted and eng.sched.stats["demotions"] == 0
    flaky.broken = True
    calls0, rounds0 = flaky.calls, eng.sched.stats["rounds"]
    collapsed, st = _run(eng, prompt, schema.DFLASH2, 96)
    assert collapsed == plain96  # the same greedy tokens, decoded plain once demoted
    assert st[0].demoted and eng.sched.stats["demotions"] == 1
    rounds = eng.sched.stats["rounds"] - rounds0
    assert flaky.calls - calls0 < rounds / 2  # demoted: only the warm-up and one probe round in 8 draft
    # the drafter recovers: the next probe round of a demoted session promotes it
    flaky.broken = False
    sched = eng.sched
    sched.admit([Turn(50, prompt[0], 200, lambda r, e, f: None, spec=schema.DFLASH2, end=False)])
    s = sched.sessions[50]
    s.demotion.demoted, s.demotion.tau_ema, s.demotion.spec_rounds = True, 1.5, 20
    while 50 in sched.turns:
        sched.burst()
    assert sched.stats["promotions"] == 1 and not s.demotion.demoted


def test_load_raises_the_bar(base):
    """With a steep load slope, one DFlash2 session alone speculates but eight together are demoted;
    every output is the session's alone."""
    eng, _ = _engine(base, demote_load_slope=0.5)
    prompts = _prompts(base, 8)
    alone = [_run(eng, [p], schema.DFLASH2, 48) for p in prompts]
    assert all(not st[0].demoted for _, st in alone)
    d0 = eng.sched.stats["demotions"]
    together, st = _run(eng, prompts, schema.DFLASH2, 48)
    assert together == [o[0] for o, _ in alone]
    assert eng.sched.stats["demotions"] - d0 >= 6 and sum(s.demoted for s in st.values()) >= 6


def test_rejection_sampling_is_never_demoted_coupled_is(base):
    eng, flaky = _engine(base)
    flaky.broken = True
    prompt = _prompts(base, 1)
    d0 = eng.sched.stats["demotions"]
    _, st = _run(eng, prompt, schema.DFLASH2, temperature=0.8, seed=3)
    assert not st[0].demoted and eng.sched.stats["demotions"] == d0  # rejection mode: never eligible
    plain, _ = _run(eng, prompt, "off", temperature=0.8, seed=3, mode=schema.COUPLED)
    coupled, st = _run(eng, prompt, schema.DFLASH2, temperature=0.8, seed=3, mode=schema.COUPLED)
    assert st[0].demoted and eng.sched.stats["demotions"] == d0 + 1
    assert coupled == plain  # a coupled stream is the same under plain decoding


def test_steady_predicts_what_speculates_answers_round_by_round():
    """Demotion.steady (a co-located call's plan) against speculates() + observe() round by round,
    for an undemoted session far from and near the bar and a demoted one between probes: over the
    rounds steady allows, speculates gives the planned answer whatever the rounds accept."""
    from types import SimpleNamespace

    from tandem.engine.demotion import Demotion, DemotionState

    cfg = schema.ServingConfig()

    def session(**st):
        return SimpleNamespace(
            spec=schema.DFLASH2, degraded=False, demotion=DemotionState(**st), demote_eligible=lambda: True
        )

    pol = Demotion(cfg, {})
    for st, want in (
        (dict(tau_ema=6.0, spec_rounds=20), (True, 4)),
        (dict(tau_ema=2.3, spec_rounds=20), (True, 2)),
        (dict(tau_ema=2.2, spec_rounds=20), (True, 1)),
        (dict(tau_ema=1.0, spec_rounds=20, demoted=True, since=3), (False, 4)),
        (dict(tau_ema=1.0, spec_rounds=20, demoted=True, since=13), (False, 2)),
        (dict(tau_ema=1.0, spec_rounds=20, demoted=True, since=15), (True, 1)),
        (dict(spec_rounds=2), (True, 4)),
    ):
        s = session(**st)
        assert pol.steady(s, 4, 1, 7) == want, st
        for _ in range(want[1]):  # the worst case: nothing accepted
            assert pol.speculates(s) == want[0]
            if want[0]:
                pol.observe(s, 0, 7, 1)
    s = session(tau_ema=2.2, spec_rounds=20)
    pol.speculates(s)
    pol.observe(s, 0, 7, 1)  # near the bar: one round of nothing accepted demotes it
    assert s.demotion.demoted and pol.speculates(s) is False


def test_demoted_and_plain_sessions_decode_together_in_one_compiled_call(base, monkeypatch):
    """Plain and demoted sessions between probe rounds go to the trunk's decode call together (the
    compiled rounds: a demoted session costs what a plain one does), with the tokens, the probe rounds
    and the drafts of every probe (the drafter took in the same rows) of the rounds one verify at a
    time."""
    prompts = _prompts(base, 3)
    specs = [schema.OFF, schema.DFLASH2, schema.DFLASH2]

    def run(compiled: bool):
        eng, flaky = _engine(base)
        flaky.broken = True
        calls: list[int] = []
        real = eng.trunk.decode_rows
        if compiled:
            monkeypatch.setattr(eng.trunk, "decode_rows", lambda items, *a: calls.append(len(items)) or real(items, *a))
        else:
            monkeypatch.setattr(eng.trunk, "decode_rows", None)
        out, st = _run(eng, prompts, specs, 96)
        assert st[1].demoted and st[2].demoted and eng.sched.stats["demotions"] == 2
        return out, flaky.drafts, calls, eng.sched.stats["rounds"]

    got, drafts, calls, rounds = run(True)
    want, want_drafts, _, want_rounds = run(False)
    plain, _ = _run(_engine(base)[0], prompts, schema.OFF, 96)
    assert got == want == plain and rounds == want_rounds
    assert drafts == want_drafts and len(drafts) < rounds / 6  # the same probes, drafting from the same rows
    assert calls.count(3) >= 2  # the plain session beside both demoted ones
