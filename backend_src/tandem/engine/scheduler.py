"""The scheduler: the engine core's facade. It admits turns, runs every active session in bursts of
rounds, and publishes one receipt per session per burst. Synchronous: in-process it is driven directly,
behind Triton by the worker thread of :mod:`tandem.serving.engine_core`.

Each responsibility is a class of its own, wired here and talking through public methods:

- :class:`~tandem.engine.stage_set.StageSet`: the trunk and drafters, their availability, drafter failures;
- :class:`~tandem.engine.session_table.SessionTable`: sessions and running turns; close, expiry, cancellation;
- :class:`~tandem.engine.admission.Admission`: validation, waiting turns, admission by count and bytes;
- :class:`~tandem.engine.prefill.PrefillPlanner`: chunked prefill under the burst's budget;
- :class:`~tandem.engine.plain_rounds.PlainRounds`: a burst's plain greedy rounds in one trunk call;
- :class:`~tandem.engine.spec_round.SpecRound`: the verify round (draft, verify, accept walk, commit);
- :class:`~tandem.engine.compiled_rounds.CompiledRounds`: a burst's speculative rounds in one trunk call;
- :class:`~tandem.engine.publication.PrefixPublisher`: prefix lookup, capture and publication.

The scheduler sequences them: a turn's prime and first token, a burst's rounds, each receipt's emission.
"""

from __future__ import annotations

import time
from typing import Callable

from .. import schema
from ..schema import ServingConfig
from .admission import Admission
from .draft_length import DraftLength
from .session_table import SessionTable
from .plain_rounds import PlainRounds
from .compiled_rounds import CompiledRounds
from .prefill import PrefillPlanner
from .prefix import PrefixIndex
from .protocols import Commit, DrafterAPI, Rows, TrunkAPI, VerifyOut
from .publication import PrefixPublisher
from .round_costs import RoundCosts
from .session import Receipt, SpecSession, Turn, finish
from .spec_round import SpecRound, plain_ok
from .stage_set import StageSet
from .state_size import StateSize
from .structured import Grammars


class Scheduler:
    """Sessions by sequence id, and the admission and burst loop over them.

    Args: ``trunk`` — a :class:`~tandem.engine.protocols.TrunkAPI`; ``drafters`` — spec ->
    :class:`~tandem.engine.protocols.DrafterAPI` (specs not listed are refused; one stage may serve
    several specs, and gets one call per round for all of them); ``config`` — defaults and limits;
    ``stop_ids`` — tokens that end a turn; ``decode`` — ``list[int] -> str`` for stop strings (None: refused);
    ``state_size`` — the session state estimate admission by bytes uses (``max_state_mb``; None: none);
    ``costs`` — the measured round costs the draft-length policy weighs (shared with the engine core's
    calibration; None: a new, empty one); ``grammars`` — the structured-output engine
    (:class:`~tandem.engine.structured.Grammars`; None: ``RESPONSE_FORMAT`` is refused).
    :meth:`request_cancel`, :meth:`refuse_overdue` and :meth:`compile_format` may be called from any thread;
    everything else from one thread.
    """

    def __init__(
        self,
        trunk: TrunkAPI,
        drafters: dict[str, DrafterAPI] | None = None,
        config: ServingConfig = schema.DEFAULTS,
        stop_ids: tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        state_size: StateSize | None = None,
        costs: RoundCosts | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.config = config
        self.stats = {
            "sessions_opened": 0,
            "sessions_expired": 0,
            "cancelled": 0,
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "accept_walks": 0,
            "compiled_rounds": 0,
        }
        #: wall seconds per stage of a round (summed; a batched round counts once); reset it in place
        self.timing = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0, "rounds": 0}
        self.stages = StageSet(trunk, dict(drafters or {}), self.stats)
        self.trunk, self.drafters = self.stages.trunk, self.stages.drafters
        self.table = SessionTable(self.stages, config, self.stats)
        #: the open sessions and the running turns by sequence id (read-only here: :attr:`table` changes them)
        self.sessions, self.turns = self.table.sessions, self.table.turns
        index = PrefixIndex(config.prefix_cache_mb << 20) if config.prefix_cache_mb > 0 else None
        self.publisher = PrefixPublisher(index, self.stages, self.table)
        self.admission = Admission(
            config, self.table, self.stages, self.publisher, self.stats, stop_ids, decode, state_size, grammars
        )
        self.prefill = PrefillPlanner(config, self.table, self.trunk)
        #: drafts per session and round (counts ``demotions`` / ``promotions`` in stats: to rest and back)
        self.draft_length = DraftLength(config, costs if costs is not None else RoundCosts(), self.stats)
        self.plain = PlainRounds(self.trunk, self.draft_length, self.stats, self.timing)
        self.speculative = SpecRound(self.stages, self.draft_length, self.stats, self.timing)
        self.compiled = CompiledRounds(
            self.stages, self.draft_length, self.stats, self.timing, config.compiled_spec_rounds
        )
        self.draft_length.compiled = lambda sessions: self.compiled.drafter(sessions) is not None
        #: the turns whose admission calls are running (read by a watchdog thread)
        self.admitting: list[Turn] = []
        #: ``failure_text(exception)``: the message for turns a failed stage call ends (None: the default)
        self.failure_text: Callable[[Exception], str | None] = lambda e: None

    # -- settings the serving side sets -----------------------------------------------------------
    @property
    def prefix(self) -> PrefixIndex | None:
        """The prefix cache's index (None when ``config.prefix_cache_mb`` is 0); may be replaced."""
        return self.publisher.index

    @prefix.setter
    def prefix(self, index: PrefixIndex | None) -> None:
        self.publisher.index = index

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end every turn (a turn's own ``stop_token_ids`` add to them); may be replaced."""
        return self.admission.stop_ids

    @stop_ids.setter
    def stop_ids(self, ids: tuple[int, ...]) -> None:
        self.admission.stop_ids = tuple(ids)

    @property
    def unavailable(self) -> frozenset[str]:
        """Model names of stages that must not be called (their process died; being restarted)."""
        return self.stages.unavailable

    @unavailable.setter
    def unavailable(self, models: frozenset[str]) -> None:
        self.stages.unavailable = models

    @property
    def on_event(self) -> Callable[[str], None]:
        """``on_event(message)``: notable events without a request to answer (a drafter failed)."""
        return self.stages.on_event

    @on_event.setter
    def on_event(self, fn: Callable[[str], None]) -> None:
        self.stages.on_event = fn

    @property
    def on_stage_dead(self) -> Callable[[str, str], None]:
        """``on_stage_dead(model, reason)``: a stage call found the stage's process dead."""
        return self.stages.on_stage_dead

    @on_stage_dead.setter
    def on_stage_dead(self, fn: Callable[[str, str], None]) -> None:
        self.stages.on_stage_dead = fn

    # -- admission --------------------------------------------------------------------------------
    def validate(self, t: Turn) -> str | None:
        """The one validation of a turn (:meth:`Admission.validate`): error text, or None."""
        return self.admission.validate(t)

    def compile_format(self, t: Turn) -> str | None:
        """Thread-safe: compile ``t``'s response format now (:meth:`Admission.compile_format`): error text, or None."""
        return self.admission.compile_format(t)

    def default_spec(self) -> str:
        """The spec of a new sequence that names none (:meth:`Admission.default_spec`)."""
        return self.admission.default_spec()

    def waiting(self) -> int:
        """Turns waiting for a free session slot (or room, or their sequence's running turn to end)."""
        return self.admission.waiting()

    def refuse_overdue(self, now: float | None = None) -> int:
        """Thread-safe: refuse the waiting turns past ``admission_wait_s`` (:meth:`Admission.refuse_overdue`)."""
        return self.admission.refuse_overdue(now)

    def no_free_session(self, t: Turn) -> str:
        """The refusal of a new sequence finding every session slot taken (counted in stats)."""
        return self.admission.no_free_session(t)

    def state_bytes(self) -> int:
        """Estimated bytes of state the open sessions hold at their contexts now (0 without ``state_size``)."""
        return self.admission.state_bytes()

    def state_room(self) -> int | None:
        """Bytes of session state that may still be admitted (None: no limit)."""
        return self.admission.state_room()

    def state_need(self, t: Turn) -> tuple[int, int, str | None]:
        """``(need, total, error)`` of a valid turn (:meth:`Admission.state_need`)."""
        return self.admission.state_need(t)

    def admit(self, turns: list[Turn]) -> None:
        """Sort the waiting turns and ``turns`` into admitted, waiting and refused (:meth:`Admission.sort`),
        open the new sessions' stage state (one call per stage), prime every admitted turn's first piece
        (:meth:`PrefillPlanner.chunk`) in one trunk call, and emit the first token of each turn primed
        whole. A failed trunk call fails the turns being admitted; running sessions go on."""
        ok = self.admission.sort(turns)
        self.table.flush_closes()
        if not ok:
            return
        ok = self.prefill.chunk(ok)  # each prime item cut to the piece the prefill budget gives it now
        new = [s for _, s, _ in ok if s.sid not in self.sessions]
        self.table.add(new)
        self.stats["sessions_opened"] += len(new)
        self.admitting = [t for t, _, _ in ok]  # a watchdog may answer them while a call hangs
        try:
            if new:
                self.trunk.open([s.sid for s in new])
                warm = {s.sid: (s.spec, r.prefix) for _, s, r in ok if r.prefix and s.spec in schema.DFLASH_SPECS}
                self.stages.open_drafters(new, warm)
            outs = self.trunk.prime([rows for _, _, rows in ok])
        except Exception as e:  # noqa: BLE001 - the turns being admitted fail; running sessions go on
            if getattr(e, "dead", False):  # the trunk's process died: every session's state is gone
                self.stages.on_stage_dead(self.stages.name(self.trunk), str(e))
            reason = self.failure_text(e) or f"admission failed: {type(e).__name__}: {e}"
            for t, s, _ in ok:
                self.table.close(s.sid)
                t.emit(None, reason, True)
            self.table.flush_closes()
            return
        finally:
            self.admitting = []
        for (t, s, rows), out in zip(ok, outs):
            self.table.begin(t)
            self._primed(s, rows, out)  # (a turn primed in pieces goes on, one piece per burst)
        self.publisher.drop_captures()
        self.table.flush_closes()

    def _primed(self, s: SpecSession, item: Rows, out: VerifyOut) -> None:
        """After a prime call of ``s``'s piece ``item``: once its prompt is primed whole, its first token."""
        whole = self.prefill.primed(s, item, out)
        if whole is not None and (r := self._after_prime(s, *whole)) is not None:
            self._publish(s, r)

    def _after_prime(self, s: SpecSession, item: Rows, out: VerifyOut, max_tokens: int) -> Receipt | None:
        """A turn's prime is complete (``out``: its rows' outputs): commit its rows and return the receipt
        of its first token. A turn its client cancelled meanwhile ends here instead (None: nothing to
        send, nothing published); one that ends at its first token publishes its prompt's blocks now
        (it reaches no burst)."""
        t = self.turns[s.sid]
        if self.table.cancelled_by_client([t], sync=True):
            self.table.end_cancelled(t)
            return None
        rows = item.tokens
        if item.prefix:  # the restored rows are the first turn's leading tokens
            s.committed.extend(t.tokens[: s.warm_rows])
        s.committed.extend(rows)
        tok = int(out.argmax[-1])
        if s.constraint is not None:
            s.constraint.advance([tok])
        s.anchor, s.turn_remaining, s.finish_reason, s.turn_done = tok, max_tokens - 1, None, False
        s.queue_for_drafter(out, rows[1:] + [tok])  # (after the previous turn's rows the drafter has not taken in)
        s.last_active = time.monotonic()
        r = Receipt(tokens=[tok], top2_gaps=[float(out.top2_gap[-1])], accepted_at=[0] * len(s.accepted_at))
        hit = s.stop_text is not None and s.stop_text.scan([tok]) is not None  # always pushed: hold_back needs it
        stop = hit or tok in s.stop_ids
        finish(s, r, "stop" if stop else ("length" if s.turn_remaining <= 0 else None))
        if r.finish_reason is not None:
            self.publisher.publish([s])
        return r

    # -- rounds -----------------------------------------------------------------------------------
    def active(self) -> list[SpecSession]:
        """Sessions with a turn that still generates (primed: not :meth:`prefilling`)."""
        return self.table.active()

    def prefilling(self) -> list[SpecSession]:
        """Sessions whose turn is still being primed in pieces."""
        return self.table.prefilling()

    def busy(self) -> bool:
        """Whether :meth:`burst` has work: a turn generating or being primed in chunks."""
        return self.table.busy()

    def round(self, receipts: dict[int, Receipt]) -> None:
        """One verify round over every active session (:meth:`SpecRound.run`); each session's receipt in
        ``receipts`` (made when missing) gets it."""
        act = self.table.active()
        if act:
            self.speculative.run(act, receipts)

    def settle(self) -> None:
        """Apply every session's deferred commit now, in one trunk call: afterwards each trunk cache
        holds exactly ``committed`` (the session contract's state). Serving never needs it (the next
        prime / verify carries the commit); tests and in-process inspection do."""
        pend = [s for s in self.sessions.values() if s.trunk_commit]
        if pend:
            self.trunk.commit([Commit(s.sid, s.trunk_commit) for s in pend])
            for s in pend:
                s.trunk_commit = 0

    def burst(self) -> None:
        """Close the turns cancelled since the last burst (asking each turn's client, see
        :attr:`Turn.cancelled`; a turn being primed in chunks is asked before each chunk), prime this
        burst's prefill pieces, run up to ``burst_rounds`` rounds (ending at the first round boundary after
        ``burst_ms`` of rounds), then publish each session's receipt (a burst boundary). A turn that
        finished in the burst is asked once more before its final response: cancelled, it ends as
        cancelled and publishes nothing."""
        table = self.table
        turns = list(self.turns.values())
        for sync in (False, True):  # a turn in chunked prefill has sent nothing yet: asked now
            for t in table.cancelled_by_client(
                [t for t in turns if (self.sessions[t.sid].prefill is not None) == sync], sync
            ):
                table.request_cancel(t.sid, t)
        table.apply_cancels()
        for s, item, out in self.prefill.step():
            self._primed(s, item, out)
        receipts: dict[int, Receipt] = {}
        deadline = time.perf_counter() + self.config.burst_ms / 1e3 if self.config.burst_ms > 0 else None
        self._rounds(receipts, deadline)
        ending = [t for sid, r in receipts.items() if r.finish_reason and (t := self.turns.get(sid)) is not None]
        for t in table.cancelled_by_client(ending, True):
            del receipts[t.sid]
            table.end_cancelled(t)
        self.publisher.publish([self.sessions[sid] for sid in receipts])
        for sid, r in receipts.items():
            self._publish(self.sessions[sid], r)
        self.publisher.drop_captures()
        table.flush_closes()

    def _rounds(self, receipts: dict[int, Receipt], deadline: float | None) -> None:
        """Up to ``burst_rounds`` rounds (a :class:`SpecRound`, or several in one :class:`PlainRounds`
        call), ending at the first round boundary after ``deadline``, or after a plain call that ran the
        rounds the deadline gave it at the last call's pace (a call's fixed cost is in that pace: a
        second call for the rounds left would be a short one, mostly that cost)."""
        n, most = 0, self.config.burst_rounds
        while n < most and (act := self.table.active()):
            if deadline is not None and receipts and time.perf_counter() >= deadline:
                break
            k, paced = self.plain.run(act, receipts, most - n, deadline)
            if not k:
                ks = self.draft_length.plan(act, plain_ok(act))
                k, paced = self.compiled.run(act, receipts, ks, most - n, deadline)
                if not k:
                    self.speculative.run(act, receipts, ks)
            n += k or 1
            if paced:
                break

    def _publish(self, s: SpecSession, r: Receipt) -> None:
        """Emit ``s``'s receipt ``r`` (a turn's last one ends the turn, and with ``END`` its sequence)."""
        t = self.turns[s.sid]
        if s.stop_text is not None:  # tokens that may begin a stop string wait for the next burst
            r.tokens, r.top2_gaps = s.stop_text.hold_back(r.tokens, r.top2_gaps, r.finish_reason is not None)
        self.stats["drafted"] += r.drafted
        self.stats["accepted"] += r.accepted
        if r.finish_reason is None:
            t.emit(r, None, False)
            return
        self.table.end_turn(s.sid)
        t.emit(r, None, True)
        if t.end:
            self.table.close(s.sid)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self, sid: int) -> None:
        """Forget ``sid``; its stage state is dropped with the next batched close (:meth:`flush_closes`)."""
        self.table.close(sid)

    def flush_closes(self) -> None:
        """Drop the stage state of the sessions closed since the last call (one call per stage)."""
        self.table.flush_closes()

    def cancel(self, sid: int, reason: str = "cancelled", last: Receipt | None = None) -> None:
        """Abort a sequence's turn and close it; the turn gets one final error ``reason``, or with
        ``last`` that normal last response instead."""
        self.table.cancel(sid, reason, last)

    def request_cancel(self, sid: int, turn: Turn | None = None, reason: str | None = None) -> bool:
        """Thread-safe: cancel ``sid``'s turn at the next burst boundary (:meth:`SessionTable.request_cancel`)."""
        return self.table.request_cancel(sid, turn, reason)

    def expire_idle(self, now: float | None = None) -> list[int]:
        """Close sessions with no turn in progress and no activity for ``idle_timeout_s``."""
        return self.table.expire_idle(now)

    def stage_name(self, stage) -> str:
        """A stage's name (:meth:`StageSet.name`)."""
        return self.stages.name(stage)

    def in_flight(self) -> list[Turn]:
        """The turns running, being admitted and waiting (a copy; another thread may get a ``RuntimeError``
        while the engine core's thread changes them, and try again)."""
        return list(self.turns.values()) + list(self.admitting) + self.admission.waiting_turns()

    def forget_all(self, reason: str) -> None:
        """Every running and waiting turn gets one final ``reason``; every session is forgotten, its
        state closed in each stage still usable (best effort: a failure is only reported)."""
        turns = list(self.turns.values()) + list(self.admitting) + self.admission.drop_waiting()
        gone = self.table.forget()
        for t in turns:
            t.emit(None, reason, True)
        self.stages.close_quietly(gone)

    def drop_all(self) -> list[Turn]:
        """Forget every session, running turn and waiting turn without a stage call or a response (at
        shutdown the stage models may be gone already); returns the turns, for their caller to answer."""
        turns = list(self.turns.values()) + self.admission.drop_waiting()
        self.table.forget()
        return turns

    def gauges(self) -> dict[str, float]:
        """The scheduler's gauges: ``sessions_open``, ``session_slots_free`` (``max_sessions`` minus
        open), ``turns_running``, ``turns_waiting`` (new sequences waiting for a slot),
        ``cache_rows`` (trunk cache rows the open sessions hold: their committed tokens),
        ``prefix_cache_blocks`` (published prompt blocks of 64 tokens held by the prefix cache) and
        ``state_bytes`` (the estimated bytes of the open sessions' state, :meth:`state_bytes`)."""
        return {
            "sessions_open": len(self.sessions),
            "session_slots_free": self.config.max_sessions - len(self.sessions),
            "turns_running": len(self.turns),
            "turns_waiting": self.admission.waiting(),
            "cache_rows": sum(len(s.committed) for s in self.sessions.values()),
            "prefix_cache_blocks": self.prefix.stats["blocks"] if self.prefix is not None else 0,
            "state_bytes": self.state_bytes(),
        }
