"""Demotion: the scheduler moves a session to plain batched decoding when speculation stops paying
for it, and promotes it back when a probe shows it would pay again.

A session's estimated speedup over plain decoding is ``tau_ema / cost``: ``tau_ema`` the moving
average of its acceptance length (accepted drafts + 1 per speculative round, weight
:data:`EMA_WEIGHT` on the newest), ``cost`` its spec's verify round in plain decode steps
(``ServingConfig.round_cost_mtp`` at one draft + ``round_cost_mtp_draft`` per further one, each MTP
draft being a sequential forward; ``round_cost_dflash``, one block forward; measured by `make bench`) times
``1 + demote_load_slope * (active sessions - 1)`` (with load, batched plain rows get cheaper relative
to verify blocks). Below ``demote_below`` an eligible session
(:meth:`~tandem.engine.session.SpecSession.demote_eligible`) is demoted; while demoted it drafts
nothing (the drafter's pending rows accumulate) except one probe round every
``demote_probe_rounds`` rounds, and at ``promote_above`` it speculates again.
"""

from __future__ import annotations

import dataclasses

from .. import schema
from ..schema import ServingConfig

#: weight of the newest round in the moving-average acceptance length (about a 10-round window)
EMA_WEIGHT = 0.1
#: speculative rounds observed before a session may be demoted
MIN_ROUNDS = 8


@dataclasses.dataclass
class DemotionState:
    """Per session: ``tau_ema`` (None before its first speculative round), ``spec_rounds`` observed,
    ``demoted`` and ``since`` (rounds since demotion, the probe clock)."""

    tau_ema: float | None = None
    spec_rounds: int = 0
    demoted: bool = False
    since: int = 0


class Demotion:
    """The demotion policy over :class:`~tandem.engine.session.SpecSession` objects (their
    ``demotion`` field). ``stats`` gets ``demotions`` and ``promotions`` counted."""

    def __init__(self, config: ServingConfig, stats: dict) -> None:
        self.config, self.stats = config, stats
        stats.setdefault("demotions", 0)
        stats.setdefault("promotions", 0)

    def cost(self, spec: str, drafts: int, load: int) -> float:
        """A verify round of ``spec`` with ``drafts`` drafts in plain decode steps, ``load`` sessions active."""
        c = self.config
        base = (
            c.round_cost_mtp + c.round_cost_mtp_draft * max(0, drafts - 1)
            if spec == schema.MTP
            else c.round_cost_dflash
        )
        return base * (1.0 + c.demote_load_slope * max(0, load - 1))

    def speculates(self, s) -> bool:
        """Whether session ``s`` drafts this round: it has a drafter and is not demoted, or its probe
        round is due. A demoted session that is no longer eligible (a later turn samples in
        ``rejection`` mode) is promoted at once."""
        st = s.demotion
        if s.spec == schema.OFF or s.degraded:
            return False
        if st.demoted and not s.demote_eligible():
            self._promote(st)
        if not st.demoted:
            return True
        st.since += 1
        return st.since % max(1, self.config.demote_probe_rounds) == 0

    def steady(self, s, rounds: int, load: int, drafts: int) -> tuple[bool, int]:
        """What :meth:`speculates` will answer for session ``s`` over its next rounds, without changing
        anything: ``(drafts?, n)`` with ``1 <= n <= rounds`` rounds over which the answer stays the same
        whatever those rounds accept (plain rounds in one trunk call, :mod:`tandem.engine.plain_rounds`). An
        undemoted session keeps drafting while even rounds accepting nothing (tau 1) could not
        demote it at ``load`` active sessions (fewer later) and ``drafts`` drafts a round (at most);
        a demoted one decodes plain until its next probe round, which is a call of its own (its
        :meth:`observe` may promote it)."""
        st, c = s.demotion, self.config
        if s.spec == schema.OFF or s.degraded:
            return False, rounds
        if not st.demoted or not s.demote_eligible():  # (an ineligible demoted session is promoted at once)
            n = 1
            while n < rounds and not self._may_demote(s, n, load, drafts):
                n += 1
            return True, n
        every = max(1, c.demote_probe_rounds)
        probe = every - st.since % every  # rounds until the probe round (1: the next one)
        return (True, 1) if probe == 1 else (False, min(rounds, probe - 1))

    def ran_plain(self, s, rounds: int) -> None:
        """Session ``s`` decoded ``rounds`` plain rounds in one call (the steady rounds :meth:`steady` gave)
        without asking :meth:`speculates` a round: a demoted one's probe clock moves as those answers would
        have moved it."""
        if s.demotion.demoted and s.spec != schema.OFF and not s.degraded:
            s.demotion.since += rounds

    def _may_demote(self, s, n: int, load: int, drafts: int) -> bool:
        """Whether :meth:`observe` could demote ``s`` after its next ``n`` speculative rounds."""
        st, c = s.demotion, self.config
        if not c.demote_probe_rounds or not s.demote_eligible() or st.spec_rounds + n < MIN_ROUNDS:
            return False
        keep = (1 - EMA_WEIGHT) ** n
        worst = 1.0 if st.tau_ema is None else keep * st.tau_ema + (1 - keep) * 1.0
        # a hair above the bar: the closed form may round a few ulps away from observe()'s steps
        return worst / self.cost(s.spec, max(drafts, 1), load) < c.demote_below * (1 + 1e-6)

    def observe(self, s, accepted: int, drafts: int, load: int) -> None:
        """After a speculative round of ``s`` that accepted ``accepted`` of ``drafts`` drafts with
        ``load`` active sessions: update its average, then demote or promote it."""
        st, c = s.demotion, self.config
        tau = accepted + 1.0
        st.tau_ema = tau if st.tau_ema is None else EMA_WEIGHT * tau + (1 - EMA_WEIGHT) * st.tau_ema
        st.spec_rounds += 1
        speedup = st.tau_ema / self.cost(s.spec, max(drafts, 1), load)
        if st.demoted:
            if speedup >= c.promote_above:
                self._promote(st)
        elif (
            c.demote_probe_rounds and st.spec_rounds >= MIN_ROUNDS and speedup < c.demote_below and s.demote_eligible()
        ):
            st.demoted, st.since = True, 0
            self.stats["demotions"] += 1

    def _promote(self, st: DemotionState) -> None:
        st.demoted = False
        self.stats["promotions"] += 1
