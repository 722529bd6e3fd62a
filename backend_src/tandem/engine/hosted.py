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

import torch

from .. import schema
from .protocols import DecodedRounds, RoundsPlan, Rows, VerifyOut
from .session import Receipt, SpecSession


class HostedRounds:
    """Mixed into :class:`~tandem.engine.scheduler.Scheduler` (whose ``trunk``, ``config``,
    ``demotion``, ``stats``, ``timing``, ``active`` and ``_after_verify`` it uses)."""

    def _hosted_burst(self, receipts: dict[int, Receipt], deadline: float | None = None) -> None:
        """``burst_rounds`` rounds for every active session in as few calls as can be (sessions with
        stop strings take one round a call), ending at the first round boundary after ``deadline``
        (``time.perf_counter()`` seconds; each call is told the time left, ``BURST_MS``). With a
        pipelined call in flight (:mod:`tandem.engine.pipeline`) the burst is that call: the one after
        it is sent first when it may be (:meth:`_may_chain`), then it is replayed. A call the trunk ended
        by the clock (a session ran fewer rounds than it was given, its turn going on) ends the burst:
        the trunk ends a call at the first round boundary after ``BURST_MS`` or after a decode call that
        ran the rounds the time left gave it at its pace, so what is left is less than a call's worth."""
        n = self.config.burst_rounds
        burst = [s.sid for s in self.active()]
        left, ended = dict.fromkeys(burst, n), {}  # ended: sid -> the burst round its turn ended in

        def load(t: int) -> int:  # sessions active in burst round t, as round() counts them
            return sum(1 for sid in burst if ended.get(sid, n) >= t)

        pipe = getattr(self.trunk, "pipeline", None)
        if pipe is not None and pipe.queued is not None:
            q, now = pipe.queued, set(burst)
            act = [s for sid in q.sids if (s := self.sessions.get(sid)) is q.owners[sid] and sid in now]
            assert q.number == pipe.numbered, (q.number, pipe.numbered)  # the last call sent
            chained = (
                not q.followed and self._may_chain(act) and self._launch(pipe, q.number, act, q.plan, q.most, q.sids)
            )
            self._take_queued(pipe, receipts, left, ended)
            if (
                chained and pipe.queued is not None
            ):  # the call after it is queued: nothing else may reach the trunk first
                return
        while act := [s for s in self.active() if left.get(s.sid, 0) > 0]:
            ms = None if deadline is None else max(0.0, (deadline - time.perf_counter()) * 1e3)
            if receipts and ms == 0.0:
                break
            for sid, ran in self._hosted_call(act, receipts, left, len(burst), load, ended, ms, chain=True).items():
                left[sid] -= ran
            if (pipe is not None and pipe.queued is not None) or (ms is not None and self._clock_cut):
                break

    #: whether the last :meth:`_hosted_call` was ended by the trunk's clock (a session ran fewer rounds
    #: than its plan gave it, its turn going on)
    _clock_cut = False

    def _pipeline_idle(self) -> None:
        """With no session generating, the pipelined calls left in flight (their turns ended: they ran
        no round, or rounds of a session closed since) are taken, so none outlives the burst."""
        pipe = getattr(self.trunk, "pipeline", None)
        while pipe is not None and pipe.queued is not None and not self.active():
            self._take_queued(pipe, {}, {}, {})

    def _may_chain(self, act: list[SpecSession]) -> bool:
        """Whether a pipelined call may follow the next one over ``act``: nothing can need the trunk
        before it (no turn waiting or arriving, no chunked prime, no cancel, no prefix capture to
        publish) and only the trunk's walk decides (no stop strings: only this side can cut them)."""
        return (
            bool(act)
            and not self._waiting
            and not self._to_cancel
            and not self.prefilling()
            and self.quiet()
            and all(s.stop_text is None and s.prefix_capture is None for s in act)
            and {s.sid for s in act} == {s.sid for s in self.active()}
        )  # (else the others would wait for the chain)

    def _chain_prime(self, ok: list) -> int | None:
        """Before the admission's prime (``ok``: its ``(turn, session, prime item)``): when one turn is
        admitted with no other session generating and a pipelined call may follow it (:meth:`_may_chain`'s
        conditions; the prime whole and not from the prefix cache; a second token to make), send the
        turn's first burst call now, a ``draft_verify_next`` continuing the prime from its first token
        (:mod:`tandem.engine.pipeline`), so the trunk starts the burst the moment the prime is done instead
        of after the first token's trip to this process and the call's trip back (~2.4 ms here). Returns
        the number to give the prime (None: no call sent; the prime goes unnumbered)."""
        pipe = getattr(self.trunk, "pipeline", None)
        if pipe is None or len(ok) != 1 or self.active() or self._waiting or self._to_cancel or not self.quiet():
            return None
        t, s, item = ok[0]
        room = s.max_ctx - len(s.committed) - len(item.tokens)  # after the prime
        if (
            s.prefill is not None
            or s.stop_text is not None
            or s.prefix_capture is not None
            or item.prefix
            or t.max_tokens < 2
            or room < 2
            or pipe.queued is not None
        ):
            return None
        b = self.config.burst_rounds
        d, k = self.demotion.steady(s, 2 * b, 1, s.num_draft_tokens)  # as _hosted_call plans a chained first call
        if k < 2:
            return None
        rounds = _first_share(b, k)
        plan = RoundsPlan(s.arm if d else None, s.num_draft_tokens, rounds, t.max_tokens - 1, s.stop_ids, room)
        ms, number, sid = self._next_ms(), pipe.number(), s.sid
        nxt = pipe.number()
        pipe.launch(
            nxt,
            [sid],
            {sid: (d, rounds)},
            1,
            {sid: s},
            lambda: self.trunk.draft_verify_next(nxt, [sid], [rounds], ms, plans=[plan]),
        )
        return number

    def _next_ms(self) -> float | None:
        """A pipelined call's ``BURST_MS``: a whole burst's (None: bursts by rounds only)."""
        return self.config.burst_ms if self.config.burst_ms > 0 else None

    def _launch(
        self, pipe, after: int, act: list[SpecSession], plan: dict[int, tuple[bool, int]], most: int, sids: list[int]
    ) -> bool:
        """Send call ``after + 1`` continuing call ``after`` over ``sids`` (in its order) when every session
        of ``act`` keeps its plan ``plan[sid] = (drafts?, rounds)`` of call ``after`` for at least one
        round after that call's rounds (:meth:`Demotion.steady` over both calls, at load ``most``) and
        one turn at least may outlast call ``after`` (its rounds fewer than the tokens the turn may
        still emit: a round emits one at least; else call ``after + 1`` would run no round and only
        hold the trunk and the worker for a round trip); returns whether it was sent."""
        if all(plan[s.sid][1] >= s.turn_remaining for s in act):
            return False
        b, nxt = self.config.burst_rounds, {}
        for s in act:
            d, r = plan[s.sid]
            d2, k = self.demotion.steady(s, r + b, most, s.num_draft_tokens)
            if d2 != d or k <= r:
                return False
            nxt[s.sid] = (d, min(b, k - r))
        rounds = [nxt[sid][1] if sid in nxt else 1 for sid in sids]  # (a turn that ended: the trunk runs none)
        ms, number = self._next_ms(), pipe.number()
        assert number == after + 1, (number, after)  # (its predecessor is the last call sent)
        owners = {sid: self.sessions.get(sid) for sid in sids}
        pipe.launch(number, sids, nxt, most, owners, lambda: self.trunk.draft_verify_next(number, sids, rounds, ms))
        return True

    def _take_queued(self, pipe, receipts: dict[int, Receipt], left: dict[int, int], ended: dict[int, int]) -> None:
        """Wait for the pipelined call and replay it (a refused one ran nothing); a session closed since
        (cancelled; or its sequence id opened again: another session) is skipped. The demotion policy sees the call's own sessions as its load."""
        clock = time.perf_counter
        t0 = clock()
        q, per = pipe.take()
        t1 = clock()
        if per is None:  # refused (it reached the trunk before the call it continues, or after another op)
            pipe.drop()  # the calls chained on it will be refused too: forget them (numbers only grow)
        else:
            now = {s.sid for s in self.active()}
            live = [
                (s, x) for sid, x in zip(q.sids, per) if x and sid in now and (s := self.sessions[sid]) is q.owners[sid]
            ]
            n = self.config.burst_rounds
            for sid, ran in self._replay(
                live, q.plan, receipts, left, ended, lambda t: sum(1 for s, _ in live if ended.get(s.sid, n) >= t)
            ).items():
                left[sid] -= ran
        self.timing["verify_s"] += t1 - t0
        self.timing["accept_s"] += clock() - t1

    def _hosted_call(
        self,
        act: list[SpecSession],
        receipts: dict[int, Receipt],
        left: dict[int, int],
        most: int,
        load: Callable[[int], int],
        ended: dict[int, int],
        ms: float | None = None,
        chain: bool = False,
    ) -> dict[int, int]:
        """One ``draft_verify`` call of a trunk that hosts the drafters, up to ``left[sid]`` rounds per
        session (one for a session with stop strings: only this side can cut them; fewer where the
        demotion policy could change its plan, :meth:`Demotion.steady`), then each round replayed in
        order exactly as :meth:`round` would apply it (:meth:`_replay`). ``chain`` (a burst's last call)
        with a pipeline: the call after it is sent first when it may be (:meth:`_may_chain`, :meth:`_launch`).
        ``left[sid]`` counts down the burst's ``burst_rounds``, so a replayed round's burst round is
        known, and the demotion policy sees ``load(burst round)`` active sessions (``most`` at most, the
        bound its plan assumes), as per-round calls would; ``ended`` records where turns end.
        ``ms``: the call ends at the first round boundary after that many milliseconds (None: no limit).
        Returns rounds run per session. The call's time counts as verify, the replay as accept."""
        clock = time.perf_counter
        t0 = clock()
        pipe = getattr(self.trunk, "pipeline", None)
        assert pipe is None or pipe.queued is None, "a pipelined call is not replayed yet"
        chain = chain and pipe is not None and self._may_chain(act)

        def plan_over(b: int) -> dict[int, tuple[bool, int]]:  # (drafts?, rounds) per session, b rounds after
            return {
                s.sid: self.demotion.steady(
                    s, 1 if s.stop_text is not None else max(1, left[s.sid]) + b, most, s.num_draft_tokens
                )
                for s in act
            }

        plan = plan_over(self.config.burst_rounds if chain else 0)  # a pipelined call after it: over both calls
        if chain and min(k for _, k in plan.values()) < 2:  # a plan that may change after one round: no next call
            chain, plan = False, plan_over(0)
        if chain:  # rounds beyond this burst's go to the next call; the policy's steady rounds are split between them
            plan = {sid: (d, _first_share(left[sid], k)) for sid, (d, k) in plan.items()}
        plans = [
            RoundsPlan(
                s.arm if plan[s.sid][0] else None,
                s.num_draft_tokens,
                plan[s.sid][1],
                s.turn_remaining,
                s.stop_ids,
                s.max_ctx - len(s.committed),
            )
            for s in act
        ]
        items = [Rows(s.sid, [s.anchor], commit=s.trunk_commit) for s in act]
        if pipe is None:
            per = self.trunk.draft_verify_rounds(items, plans, ms)
        else:
            number = pipe.number()
            if chain:  # sent delay_s from now (after this call) when the plan holds into it
                self._launch(pipe, number, act, plan, most, [s.sid for s in act])
            try:
                per = self.trunk.draft_verify_rounds(items, plans, ms, number)
            except Exception:
                pipe.drop()
                raise
        t1 = clock()
        ran = self._replay(list(zip(act, per)), plan, receipts, left, ended, load)
        self._clock_cut = any(ran[s.sid] < plan[s.sid][1] and not s.turn_done for s in act)
        self.timing["verify_s"] += t1 - t0
        self.timing["accept_s"] += clock() - t1
        return ran

    def _replay(
        self,
        live: list[tuple[SpecSession, list]],
        plan: dict[int, tuple[bool, int]],
        receipts: dict[int, Receipt],
        left: dict[int, int],
        ended: dict[int, int],
        load: Callable[[int], int],
    ) -> dict[int, int]:
        """Each round of a call's answer (``live``: per session, ``(anchor, drafts, verify output)`` per
        round) applied in order exactly as :meth:`round` would apply it (the accept walk, receipts, the
        policy asked round by round), checking that the trunk's walk chose the same anchors and the
        plan held; a plain session's rounds (arm ``off``, no stop strings) at once (:meth:`_after_plain`).
        Returns rounds run per session."""
        rest = []
        for s, x in live:
            if s.arm != schema.OFF or s.stop_text is not None:
                rest.append((s, x))
                continue
            if not isinstance(x, DecodedRounds):  # (rounds a round at a time: as one)
                x = DecodedRounds(
                    [a for a, _, _ in x],
                    VerifyOut(
                        *(
                            torch.cat([getattr(o, f) for _, _, o in x])
                            for f in ("argmax", "hidden", "top2_gap", "features")
                        )
                    ),
                )
                assert not plan[s.sid][0] and x.out.argmax.shape[0] == len(x), (s.sid, plan[s.sid])  # no drafts
            assert x.anchors == [s.anchor] + x.targets[:-1], (s.sid, s.anchor)  # the walks replay exactly
            rc = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
            s.trunk_commit = self._after_plain(s, x.targets, x.out.top2_gap.tolist(), x.out.rows_at(len(x) - 1), rc)
            if s.turn_done:
                ended[s.sid] = self.config.burst_rounds - left[s.sid] + len(x) - 1
            self.stats["rounds"] += len(x)
        self.timing["rounds"] += max((len(x) for _, x in live), default=0)
        for r in range(max((len(x) for _, x in rest), default=0)):
            now = [(s, x[r]) for s, x in rest if r < len(x)]
            spec = {s.sid for s, _ in now if self.demotion.speculates(s)}  # as round() asks, round by round
            for s, (anchor, drafts, out) in now:
                assert s.anchor == anchor and not s.turn_done, (s.sid, s.anchor, anchor, r)  # the walks replay exactly
                assert (s.sid in spec) == plan[s.sid][0], (s.sid, r)  # the plan held (Demotion.steady)
                if s.sid in spec:
                    s.drafter_rows, s.ingest = len(s.committed), None
                rc = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
                t = self.config.burst_rounds - left[s.sid] + r
                s.trunk_commit = self._after_verify(s, drafts, out, rc, load(t) if s.sid in spec else None)
                if s.turn_done:
                    ended[s.sid] = t
            self.stats["rounds"] += len(now)
        return {s.sid: len(x) for s, x in live}


def _first_share(left: int, k: int) -> int:
    """The rounds of a call with a pipelined call after it, when the demotion policy's plan holds ``k``
    rounds over both (:meth:`Demotion.steady`) and this call may run ``left``: all of ``left`` when
    the plan outlasts it, else half of ``k`` (one at least), so the next call keeps a share."""
    return min(left, k if k > left else max(1, k // 2))
