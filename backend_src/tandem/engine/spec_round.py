"""The engine core's verify round: draft, verify, accept walk, commit. Every active session's draft work
goes to one drafter call per drafter stage, all verify work to one trunk call that also carries each
session's previous round's commit; the accept walk (:func:`~tandem.engine.accept.accept_walk`) runs
here, once per session per round, and nowhere else."""

from __future__ import annotations

import time

from .accept import Walk, accept_walk
from .draft_length import DraftLength
from .protocols import DraftRequest, Rows, VerifyOut
from .session import Receipt, SpecSession, finish
from .stage_set import StageSet


def plain_ok(act: list[SpecSession]) -> bool:
    """Whether a round of ``act`` without drafts would run as compiled plain rounds (greedy, no stop strings, no
    structured output), what the draft-length policy weighs a drafting round against."""
    return all(s.plain_greedy() for s in act)


class SpecRound:
    """One verify round over the active sessions (:meth:`run`); a session without drafts (spec ``off``,
    resting, degraded) verifies its anchor alone, a plain round.

    Args: ``stages`` — the trunk and the drafters (a failed drafter call degrades its group there);
    ``policy`` — how many drafts each session verifies this round, told each drafting round's outcome, its
    costs told each round's measured times; ``stats`` and ``timing`` — the engine core's counters (``rounds``,
    ``accept_walks``) and stage clocks (``draft_s``, ``verify_s``, ``accept_s``, ``rounds``), added to in place.
    """

    def __init__(self, stages: StageSet, policy: DraftLength, stats: dict, timing: dict) -> None:
        self.stages, self.policy, self.stats, self.timing = stages, policy, stats, timing

    def run(self, act: list[SpecSession], receipts: dict[int, Receipt], ks: dict[int, int] | None = None) -> None:
        """One round over the active sessions ``act`` (some): one drafter call per stage and one trunk
        verify, which first commits each session's previous round (the walk's rows kept, see
        :meth:`~tandem.engine.scheduler.Scheduler.settle`). Each session's receipt in ``receipts`` (made
        when missing) gets the round. ``ks``: the drafts per session the policy planned for this round (None:
        planned here)."""
        clock = time.perf_counter
        t0 = clock()
        drafts: dict[int, list[int]] = {s.sid: [] for s in act}
        if ks is None:
            ks = self.policy.plan(act, plain_ok(act))
        costs = self.policy.costs
        for stage, group in self.stages.by_drafter([s for s in act if ks[s.sid] > 0]):
            reqs = [
                DraftRequest(s.sid, rows.hidden, emitted, ks[s.sid], rows.features, s.spec)
                for s in group
                for rows, emitted in (s.drafter_input(),)
            ]
            t = clock()
            for s, d in zip(group, self.stages.draft(stage, group, reqs)):
                s.drafter_rows, s.ingest, drafts[s.sid] = len(s.committed), None, d
            took = clock() - t
            for spec in {s.spec for s in group}:  # (a stage serving two specs: its time split by sessions)
                mine = [s for s in group if s.spec == spec]
                costs.saw_draft(spec, len(mine), sum(ks[s.sid] for s in mine), took * len(mine) / len(group))
        t1 = clock()
        outs = self.stages.trunk.verify([Rows(s.sid, [s.anchor] + drafts[s.sid], commit=s.trunk_commit) for s in act])
        t2 = clock()
        for s, out in zip(act, outs):
            r = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
            s.trunk_commit = self._after_verify(s, drafts[s.sid], out, r, ks[s.sid] > 0)
        t3 = clock()
        costs.saw_verify(len(act) + sum(len(d) for d in drafts.values()), t3 - t1)
        self.stats["rounds"] += len(act)
        tm = self.timing
        tm["draft_s"] += t1 - t0
        tm["verify_s"] += t2 - t1
        tm["accept_s"] += t3 - t2
        tm["rounds"] += 1

    def _after_verify(self, s: SpecSession, drafts: list[int], out: VerifyOut, r: Receipt, drafted: bool) -> int:
        """Apply the accept walk to the session and the burst's receipt (and, after a round in which it
        ``drafted``, to the draft-length policy); returns rows to commit."""
        w = accept_walk(drafts, out.argmax.tolist(), s.stop_ids, s.turn_remaining)
        self.stats["accept_walks"] += 1
        if s.stop_text is not None and (n := s.stop_text.scan(w.emitted)) is not None:  # a stop string: cut there
            w = Walk(min(w.accepted, n), w.emitted[:n], "stop")
        if s.constraint is not None:  # the grammar's state after the emitted tokens (its masks made the targets)
            s.constraint.advance(w.emitted)
        m = len(w.emitted)
        apply_walk(s, r, drafts, w, out.top2_gap[:m].tolist(), self.policy if drafted else None)
        if s.drafts_later:  # a resting session: its rows wait for the drafter's next round
            s.queue_for_drafter(out.rows(m), w.emitted)
        else:
            s.ingest = (out.rows(m), w.emitted)
        finish(s, r, w.finish)
        return m


def apply_walk(
    s: SpecSession, r: Receipt, drafts: list[int], w: Walk, gaps: list[float], policy: DraftLength | None
) -> None:
    """A round's accept walk ``w`` over ``drafts`` applied to session ``s`` and its burst's receipt ``r``: the
    counters, the committed rows (the anchor and the emitted tokens but the last, which is the next anchor), the
    emitted tokens with their top-2 ``gaps``, and (a round that drafted) the draft-length ``policy``'s acceptance."""
    m = len(w.emitted)
    s.rounds += 1
    s.drafted += len(drafts)
    s.accepted += w.accepted
    r.rounds += 1
    r.spec_rounds += bool(drafts)
    r.drafted += len(drafts)
    r.accepted += w.accepted
    for i in range(w.accepted):
        s.accepted_at[i] += 1
        r.accepted_at[i] += 1
    s.committed.extend([s.anchor] + w.emitted[:-1])
    s.anchor = w.emitted[-1]
    s.turn_remaining -= m
    r.tokens.extend(w.emitted)
    r.top2_gaps.extend(gaps)
    if policy is not None:
        policy.observe(s, w.accepted, len(drafts))
    s.last_active = time.monotonic()
