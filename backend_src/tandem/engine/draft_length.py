"""Adaptive draft length: how many drafts each session verifies in a round (``k``; 0: a plain row), chosen
for the batch's expected goodput (tokens a second) from each session's measured acceptance and this
machine's measured round costs (:class:`~tandem.engine.round_costs.RoundCosts`).

Acceptance: per session and draft position ``i``, the rate at which draft ``i`` is accepted when every draft
before it was, counted over its speculative rounds with older rounds weighing less (:data:`DECAY`) and
:data:`PRIOR_WEIGHT` rounds of the spec's own rate (over every session) added, so a new session starts from
what its spec does. The expected tokens of a round with ``k`` drafts are ``1 + sum_{i<=k} prod_{j<=i}
a_j`` (the bonus token and the accepted drafts; Leviathan et al. 2023, eq. 1, with a rate per position).

The choice (:meth:`DraftLength.plan`): every candidate draft row ``(session, i)`` is worth ``prod_{j<=i}
a_j`` tokens; taking rows in order of worth, the round's time is ``verify_s(rows) + sum of the drafting
sessions' draft_s``, and the prefix with the most tokens a second wins, against the plain round (every
session one row, ``plain_s(L)``: the compiled plain rounds). So one session with a good drafter drafts its
whole block; a session whose drafts stop landing, or a batch whose plain rows are already cheap per token,
drafts less, down to none: that session rests (decodes plain rows, counted in ``demotions``) until its probe
round (:data:`PROBE_DRAFTS` drafts) after ``probe_rounds`` rounds, an interval that doubles after each probe
that does not bring it back (up to :data:`MAX_BACKOFF` times), or until the number of active sessions changes;
a probe's round is measured anew (the counts from before the rest are dropped; its first draft rejected, the
session rests again at once), and skipped when not even a round accepting every draft would beat the plain
round (a batch whose plain rows are cheap). That check runs between compiled plain calls too
(:meth:`DraftLength.rests`), so a skipped probe, or a session arriving or ending, costs a resting batch no
verify round.

Sessions that may not change their draft length keep it: ``rejection``-sampled ones (their stream depends
on the draws the walk makes, :meth:`~tandem.engine.session.SpecSession.demote_eligible`), and every session
when ``adaptive_draft`` is off; a session whose prompt's prefix capture waits for its drafter drafts its budget
in that round (the drafter takes the prompt in, and the prefix cache can publish it), and so does every session of
a spec no round has measured yet.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .. import schema
from ..schema import ServingConfig
from .round_costs import RoundCosts

#: weight kept by a session's older rounds at each new one (about a 10-round window)
DECAY = 0.9
#: rounds of its spec's acceptance a session's own counts start with
PRIOR_WEIGHT = 2.0
#: a spec's acceptance per position before any session of it drafted (optimistic: a new spec tries)
START_ACCEPT = 0.8
#: weight kept by a spec's older rounds (over every session) at each new one
SPEC_DECAY = 0.99
#: a resting session's probe interval grows to ``probe_rounds`` times this at most
MAX_BACKOFF = 8
#: drafts a probe round verifies (its first positions decide whether the session drafts again)
PROBE_DRAFTS = 2


@dataclasses.dataclass
class DraftState:
    """Per session: decayed counts per draft position (``hit[i]`` rounds that accepted draft ``i + 1`` of
    ``tried[i]`` that reached it); ``resting`` (drafting nothing
    since its last plan), ``since`` rounds at rest, ``backoff`` the probe interval's multiple, ``rest_load``
    the active sessions when it came to rest, ``probed`` whether its last drafting round was a probe."""

    hit: list[float] = dataclasses.field(default_factory=list)
    tried: list[float] = dataclasses.field(default_factory=list)
    resting: bool = False
    since: int = 0
    backoff: int = 1
    rest_load: int = 0
    probed: bool = False


class DraftLength:
    """The policy over :class:`~tandem.engine.session.SpecSession` objects (their ``drafting`` field).

    Args: ``config`` (``adaptive_draft``, ``probe_rounds``); ``costs`` the measured round costs (when they are
    not known yet, every session drafts its budget); ``stats`` gets ``demotions`` (a session came to rest) and
    ``promotions`` (a resting one drafts again) counted.
    """

    def __init__(self, config: ServingConfig, costs: RoundCosts, stats: dict) -> None:
        self.config, self.costs, self.stats = config, costs, stats
        stats.setdefault("demotions", 0)
        stats.setdefault("promotions", 0)
        #: per spec: decayed hit / tried counts per position over every session
        self.spec_counts: dict[str, tuple[list[float], list[float]]] = {}
        #: ``compiled(sessions)``: whether a round in which those sessions draft runs in a compiled call (the
        #: scheduler sets it: :meth:`~tandem.engine.compiled_rounds.CompiledRounds.drafter`), whose costs it weighs
        self.compiled: Callable[[list], bool] = lambda sessions: False

    # -- acceptance -----------------------------------------------------------------------------------
    def acceptance(self, s, k: int) -> list[float]:
        """Session ``s``'s estimated acceptance of drafts ``1 .. k`` (each given the ones before it accepted)."""
        st = s.drafting
        hit0, tried0 = self.spec_counts.get(s.spec, ([], []))
        out = []
        for i in range(k):
            p0 = (_at(hit0, i) + START_ACCEPT) / (_at(tried0, i) + 1.0)
            out.append((_at(st.hit, i) + PRIOR_WEIGHT * p0) / (_at(st.tried, i) + PRIOR_WEIGHT))
        return out

    def observe(self, s, accepted: int, drafts: int) -> None:
        """After a round of ``s`` that verified ``drafts`` drafts and accepted ``accepted``: its counts (and its
        spec's) for the positions the round reached (``1 .. min(accepted + 1, drafts)``)."""
        st = s.drafting
        spec = self.spec_counts.setdefault(s.spec, ([], []))
        reached = min(accepted + 1, drafts)
        for counts, decay in ((st, DECAY), (spec, SPEC_DECAY)):
            hit, tried = (counts.hit, counts.tried) if counts is st else counts
            while len(tried) < drafts:
                hit.append(0.0), tried.append(0.0)
            for i in range(reached):
                hit[i] = hit[i] * decay + (1.0 if i < accepted else 0.0)
                tried[i] = tried[i] * decay + 1.0

    # -- the plan --------------------------------------------------------------------------------------
    def plan(self, act: list, plain_ok: bool = True) -> dict[int, int]:
        """Drafts per session of ``act`` (the active sessions) for this round: ``{sid: k}``, 0 for a plain row.
        ``plain_ok``: a round without drafts would run as compiled plain rounds (else it is a verify round of
        one row each). Moves the sessions' rest and probe clocks."""
        L, c = len(act), self.config
        compiled = self.compiled(act)
        ks: dict[int, int] = {}
        fixed, cands = [], []
        for s in act:
            k = s.draft_budget() if s.spec != schema.OFF and not s.degraded else 0
            st = s.drafting
            if k == 0:
                ks[s.sid] = 0
            elif not c.adaptive_draft or not s.demote_eligible() or _capture_waits(s) or s.spec not in self.spec_counts:
                ks[s.sid] = k
                fixed.append((s, k))
            elif st.resting and not self._probe_due(st) and st.rest_load == L:
                ks[s.sid] = 0
                st.since += 1
            elif st.resting and not self._could_pay(s, k, L, plain_ok, compiled):  # not even were every draft accepted
                ks[s.sid], st.since, st.rest_load = 0, 0, L
                st.backoff = min(2 * st.backoff, MAX_BACKOFF)
            elif st.resting:  # its probe: a few drafts, measured anew
                k = min(k, PROBE_DRAFTS)
                ks[s.sid] = k
                fixed.append((s, k))
                st.resting, st.probed, st.hit, st.tried = False, True, [], []
            elif st.probed and not _at(st.hit, 0):  # its probe's first draft was rejected: back to rest, longer
                ks[s.sid] = 0
                st.resting, st.since, st.rest_load, st.probed = True, 0, L, False
                st.backoff = min(2 * st.backoff, MAX_BACKOFF)
            else:
                cands.append((s, k))
        if not cands:
            return ks
        if not self.costs.known({s.spec for s, _ in cands + fixed}, compiled):
            ks.update({s.sid: k for s, k in cands})
            return ks
        chosen = self._allocate(L, fixed, cands, plain_ok, compiled)
        for s, _ in cands:
            k, st = chosen.get(s.sid, 0), s.drafting
            ks[s.sid] = k
            if k == 0:
                if not st.resting and not st.probed:  # (after a probe it only goes back to rest)
                    self.stats["demotions"] += 1
                if st.probed:  # a probe that did not bring it back: wait longer before the next one
                    st.backoff = min(2 * st.backoff, MAX_BACKOFF)
                st.resting, st.since, st.rest_load, st.probed = True, 0, L, False
            else:
                if st.probed or st.resting:
                    self.stats["promotions"] += 1
                st.resting, st.probed, st.backoff = False, False, 1
        return ks

    def _allocate(self, L: int, fixed: list, cands: list, plain_ok: bool, compiled: bool) -> dict[int, int]:
        """The goodput-best drafts per candidate (see the module text): ``{sid: k}`` (absent: 0). A round's time
        is its ``L`` anchor rows' (a verify round's, never taken below the plain round's), the draft rows' on the
        verify line, and the drafting sessions' draft rounds (a ``compiled`` call's costs when it runs in one)."""
        costs = self.costs
        plain, base = self._plain_and_base(L, plain_ok, compiled)
        rows, tokens, draft = L, float(L), 0.0
        for s, k in fixed:
            rows += k
            tokens += _expected(self.acceptance(s, k))
            draft += costs.draft_s(s.spec, k, compiled)
        best_rate = tokens / (base + costs.verify_s(rows, compiled) + draft) if fixed else L / plain
        best_m = 0
        items = []
        for s, k in cands:
            v = 1.0
            for i, a in enumerate(self.acceptance(s, k), 1):
                v *= a
                items.append((-v, i, s.sid, s.spec))
        items.sort()
        for m, (neg_v, i, _, spec) in enumerate(items, 1):
            rows += 1
            tokens -= neg_v
            draft += costs.draft_s(spec, i, compiled) - (costs.draft_s(spec, i - 1, compiled) if i > 1 else 0.0)
            rate = tokens / (base + costs.verify_s(rows, compiled) + draft)
            if rate > best_rate:
                best_rate, best_m = rate, m
        out: dict[int, int] = {}
        for _, i, sid, _ in items[:best_m]:
            out[sid] = max(out.get(sid, 0), i)
        return out

    def _could_pay(self, s, k: int, load: int, plain_ok: bool, compiled: bool) -> bool:
        """Whether a round in which session ``s`` drafts ``k`` and every draft is accepted would give ``load``
        sessions more tokens a second than a plain round (else its probe is skipped: no acceptance could pay)."""
        c = self.costs
        if not c.known({s.spec}, compiled):
            return True
        plain, base = self._plain_and_base(load, plain_ok, compiled)
        rate = (load + k) / (base + c.verify_s(load + k, compiled) + c.draft_s(s.spec, k, compiled))
        return rate > load / plain

    def _plain_and_base(self, load: int, plain_ok: bool, compiled: bool) -> tuple[float, float]:
        """Seconds of a round without drafts of ``load`` sessions (compiled plain rounds when ``plain_ok``, else a
        verify round of one row each), and what a verify round's time (a ``compiled`` call's round's) adds over
        the verify line so that its ``load`` anchor rows never cost less than that round."""
        c = self.costs
        plain = c.plain_s(load) if plain_ok else c.verify_s(load)
        return plain, max(plain, c.verify_s(load, compiled)) - c.verify_s(load, compiled)

    def _probe_due(self, st: DraftState) -> bool:
        return st.since >= max(1, self.config.probe_rounds) * st.backoff

    # -- plain rounds in one call ---------------------------------------------------------------------
    def rests(self, s, load: int) -> int:
        """Rounds (0 or more) over which session ``s`` surely drafts nothing, ``load`` sessions active: any for
        a session without drafts (spec ``off``, degraded) or a resting one while the load stays (its probe, once
        due, waits for the first round after the plain call: a call is not cut short for it), else 0 (its next
        plan decides). A resting session whose probe is due, or at a new load, is decided here as :meth:`plan`
        would: when not even a round accepting every draft would pay at that load, it rests on (its clocks
        moved as the plan moves them), so neither its skipped probe nor a session arriving or ending costs the
        batch a verify round in place of its compiled plain rounds."""
        st = s.drafting
        if s.spec == schema.OFF or s.degraded:
            return 1 << 30
        if not self.config.adaptive_draft or not s.demote_eligible() or not st.resting:
            return 0
        if st.rest_load != load or self._probe_due(st):
            if self._could_pay(s, s.draft_budget(), load, True, self.compiled([s])):
                return 0
            st.since, st.rest_load, st.backoff = 0, load, min(2 * st.backoff, MAX_BACKOFF)
        return 1 << 30

    def ran_plain(self, s, rounds: int) -> None:
        """Session ``s`` decoded ``rounds`` plain rounds in one call (within what :meth:`rests` gave): a resting
        one's probe clock moves as that many plans would have moved it."""
        if s.drafting.resting and s.spec != schema.OFF and not s.degraded:
            s.drafting.since += rounds


def _capture_waits(s) -> bool:
    """Whether ``s``'s prompt-boundary prefix capture waits for its drafter to take in the prompt (a drafting
    round does that: :meth:`~tandem.engine.session.SpecSession.prefix_capture_ready`)."""
    return s.prefix_capture is not None and not s.prefix_capture_ready()


def _at(xs: list[float], i: int) -> float:
    return xs[i] if i < len(xs) else 0.0


def _expected(acc: list[float]) -> float:
    """Expected accepted drafts (the bonus token not counted) of drafts with acceptance ``acc`` per position."""
    tot, v = 0.0, 1.0
    for a in acc:
        v *= a
        tot += v
    return tot
