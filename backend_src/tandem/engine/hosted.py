"""The rounds of a burst against a trunk that hosts the drafters (``colocate``,
:mod:`tandem.engine.colocated`): one ``draft_verify`` call runs several rounds (the trunk's process
runs the accept walk between them), and the scheduler replays each round as
:meth:`~tandem.engine.scheduler.Scheduler.round` would apply it, so a session's state, receipts and
demotion are what per-round calls would give, with one process round trip per burst instead of per
round.
"""

from __future__ import annotations

import time
from typing import Callable

from .protocols import RoundsPlan, Rows
from .session import Receipt, SpecSession


class HostedRounds:
    """Mixed into :class:`~tandem.engine.scheduler.Scheduler` (whose ``trunk``, ``config``,
    ``demotion``, ``stats``, ``timing``, ``active`` and ``_after_verify`` it uses)."""

    def _hosted_burst(self, receipts: dict[int, Receipt], deadline: float | None = None) -> None:
        """``burst_rounds`` rounds for every active session in as few calls as can be (sessions with
        stop strings take one round a call), ending at the first round boundary after ``deadline``
        (``time.perf_counter()`` seconds; each call is told the time left, ``BURST_MS``)."""
        n = self.config.burst_rounds
        burst = [s.sid for s in self.active()]
        left, ended = dict.fromkeys(burst, n), {}  # ended: sid -> the burst round its turn ended in

        def load(t: int) -> int:  # sessions active in burst round t, as round() counts them
            return sum(1 for sid in burst if ended.get(sid, n) >= t)

        while act := [s for s in self.active() if left.get(s.sid, 0) > 0]:
            ms = None if deadline is None else max(0.0, (deadline - time.perf_counter()) * 1e3)
            if receipts and ms == 0.0:
                break
            for sid, ran in self._hosted_call(act, receipts, left, len(burst), load, ended, ms).items():
                left[sid] -= ran

    def _hosted_call(self, act: list[SpecSession], receipts: dict[int, Receipt], left: dict[int, int], most: int,
                     load: Callable[[int], int], ended: dict[int, int], ms: float | None = None) -> dict[int, int]:
        """One ``draft_verify`` call of a trunk that hosts the drafters, up to ``left[sid]`` rounds per
        session (one for a session with stop strings: only this side can cut them; fewer where the
        demotion policy could change its plan, :meth:`Demotion.steady`), then each round replayed in
        order exactly as :meth:`round` would apply it (the accept walk, receipts, the policy asked
        round by round), checking that the trunk's walk chose the same anchors and the plan held.
        ``left[sid]`` counts down the burst's ``burst_rounds``, so a replayed round's burst round is
        known, and the demotion policy sees ``load(burst round)`` active sessions (``most`` at most, the
        bound its plan assumes), as per-round calls would; ``ended`` records where turns end.
        ``ms``: the call ends at the first round boundary after that many milliseconds (None: no limit).
        Returns rounds run per session. The call's time counts as verify, the replay as accept."""
        clock = time.perf_counter
        t0 = clock()
        plan = {s.sid: self.demotion.steady(s, 1 if s.stop_text is not None else max(1, left[s.sid]), most,
                                            s.num_draft_tokens) for s in act}  # (drafts?, rounds) per session
        plans = [RoundsPlan(s.arm if plan[s.sid][0] else None, s.num_draft_tokens, plan[s.sid][1], s.turn_remaining,
                            s.stop_ids, s.max_ctx - len(s.committed)) for s in act]
        per = self.trunk.draft_verify_rounds([Rows(s.sid, [s.anchor], commit=s.trunk_commit) for s in act], plans, ms)
        t1 = clock()
        for r in range(max(map(len, per), default=0)):
            live = [(s, x[r]) for s, x in zip(act, per) if r < len(x)]
            spec = {s.sid for s, _ in live if self.demotion.speculates(s)}  # as round() asks, round by round
            for s, (anchor, drafts, out) in live:
                assert s.anchor == anchor and not s.turn_done, (s.sid, s.anchor, anchor, r)  # the walks replay exactly
                assert (s.sid in spec) == plan[s.sid][0], (s.sid, r)  # the plan held (Demotion.steady)
                if s.sid in spec:
                    s.drafter_rows, s.ingest = len(s.committed), None
                rc = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
                t = self.config.burst_rounds - left[s.sid] + r
                s.trunk_commit = self._after_verify(s, drafts, out, rc, load(t) if s.sid in spec else None)
                if s.turn_done:
                    ended[s.sid] = t
            self.stats["rounds"] += len(live)
            self.timing["rounds"] += 1
        self.timing["verify_s"] += t1 - t0
        self.timing["accept_s"] += clock() - t1
        return {s.sid: len(x) for s, x in zip(act, per)}
