"""The engine core's session table: every open session and running turn by sequence id, and their
lifecycle: closing (batched, one call per stage), idle expiry, and cancellation (requested from any
thread, applied at a burst boundary)."""

from __future__ import annotations

import threading
import time

from .. import schema
from ..schema import ServingConfig
from .session import Receipt, SpecSession, Turn
from .stage_set import StageSet


class SessionTable:
    """Sessions and running turns by sequence id.

    ``sessions`` and ``turns`` are read by everyone; they change only through this class's methods
    (and the session objects through the rounds that own them). :meth:`request_cancel` may be called from
    any thread; everything else from the engine core's thread.

    Args: ``stages`` — whose state :meth:`flush_closes` drops; ``config`` — ``idle_timeout_s``;
    ``stats`` — the engine core's counters (this class counts ``sessions_expired`` and ``cancelled``).
    """

    def __init__(self, stages: StageSet, config: ServingConfig, stats: dict) -> None:
        self.stages, self.config, self.stats = stages, config, stats
        self.sessions: dict[int, SpecSession] = {}
        self.turns: dict[int, Turn] = {}
        self._to_close: list[SpecSession] = []
        self._cancel_lock = threading.Lock()
        self._to_cancel: dict[int, tuple[Turn | None, str | None]] = {}

    # -- queries ----------------------------------------------------------------------------------
    def active(self) -> list[SpecSession]:
        """Sessions with a turn that still generates (primed: not :meth:`prefilling`)."""
        return [s for sid in self.turns if not (s := self.sessions[sid]).turn_done and s.prefill is None]

    def prefilling(self) -> list[SpecSession]:
        """Sessions whose turn is still being primed in pieces."""
        return [self.sessions[sid] for sid in self.turns if self.sessions[sid].prefill is not None]

    def busy(self) -> bool:
        """Whether a burst has work: a turn generating or being primed in pieces."""
        return bool(self.active() or self.prefilling())

    # -- opening and ending -----------------------------------------------------------------------
    def add(self, sessions: list[SpecSession]) -> None:
        """Hold the newly opened ``sessions`` (their stage state is opened by the caller)."""
        for s in sessions:
            self.sessions[s.sid] = s

    def begin(self, t: Turn) -> None:
        """``t`` runs now on its (held) session."""
        self.turns[t.sid] = t

    def end_turn(self, sid: int) -> Turn:
        """``sid``'s turn has sent its final response: it runs no more (its session stays open). Returns it."""
        return self.turns.pop(sid)

    def close(self, sid: int) -> None:
        """Forget ``sid``; its stage state is dropped with the next :meth:`flush_closes`."""
        s = self.sessions.pop(sid, None)
        self.turns.pop(sid, None)
        if s is not None:
            self._to_close.append(s)

    def flush_closes(self) -> None:
        """Drop the stage state of the sessions closed since the last call (one call per stage)."""
        gone, self._to_close = self._to_close, []
        if gone:
            self.stages.close(gone)

    def expire_idle(self, now: float | None = None) -> list[int]:
        """Close sessions with no turn in progress and no activity for ``idle_timeout_s``."""
        now = time.monotonic() if now is None else now
        gone = [
            sid
            for sid, s in self.sessions.items()
            if sid not in self.turns and now - s.last_active > self.config.idle_timeout_s
        ]
        for sid in gone:
            self.close(sid)
        self.flush_closes()
        self.stats["sessions_expired"] += len(gone)
        return gone

    def forget(self) -> list[SpecSession]:
        """Forget every session and turn at once, without stage calls; returns the sessions forgotten."""
        gone = list(self.sessions.values())
        self.turns.clear()
        self.sessions.clear()
        return gone

    # -- cancellation -----------------------------------------------------------------------------
    def cancel(self, sid: int, reason: str = "cancelled", last: Receipt | None = None) -> None:
        """Abort a sequence's turn and close it; the turn gets one final error ``reason``, or with
        ``last`` that normal last response instead."""
        t = self.turns.get(sid)
        self.close(sid)
        self.flush_closes()
        if t is not None:
            t.emit(last, None if last is not None else reason, True)

    def request_cancel(self, sid: int, turn: Turn | None = None, reason: str | None = None) -> bool:
        """Thread-safe: cancel ``sid``'s turn at the next burst boundary (:meth:`apply_cancels`): ``turn``,
        or (None) the turn running now, never a later turn of the same sequence. ``reason``: None for a
        client's cancel (counted in ``stats["cancelled"]``; the turn's last response is a normal one, no
        tokens, finish reason :data:`~tandem.schema.CANCELLED`: an error answer to a step of Triton 2.51's
        ensemble while another of its steps is in flight leaves the ensemble request in flight for good,
        fixed upstream in triton-inference-server/core#466), else the failure that already answered the
        turn. Returns False (nothing to do) when ``turn`` is None and the sequence has no turn running."""
        if turn is None and (turn := self.turns.get(sid)) is None:
            return False
        with self._cancel_lock:
            self._to_cancel[sid] = (turn, reason)
        return True

    def apply_cancels(self) -> None:
        """End the turns :meth:`request_cancel` named since the last call, those still running."""
        with self._cancel_lock:
            gone, self._to_cancel = self._to_cancel, {}
        for sid, (turn, reason) in gone.items():
            if self.turns.get(sid) is turn:  # a client's cancel is no failure: a last response (see request_cancel)
                if reason is None:
                    self.end_cancelled(turn)
                else:
                    self.cancel(sid, reason)

    def end_cancelled(self, t: Turn) -> None:
        """End turn ``t``, which its client cancelled, now: its last response carries no tokens and finish
        reason :data:`~tandem.schema.CANCELLED`, its sequence is closed, ``stats["cancelled"]`` counts it.
        Every way a client cancels (its connection, a ``CANCEL`` request) ends here, once."""
        self.cancel(t.sid, "cancelled", Receipt(tokens=[], finish_reason=schema.CANCELLED))
        self.stats["cancelled"] += 1

    def cancelled_by_client(self, turns: list[Turn], sync: bool) -> list[Turn]:
        """The running turns among ``turns`` whose client has cancelled them (:attr:`Turn.cancelled`,
        asked with ``sync``)."""
        return [t for t in turns if t.cancelled is not None and self.turns.get(t.sid) is t and t.cancelled(sync)]

    def ending(self, sid: int) -> bool:
        """Whether ``sid`` has a turn running that is cancelled (by a ``CANCEL`` or its client) and ends at
        the next burst boundary: a new turn of the sequence (a client that cancelled and goes on, or
        reuses its id) waits for it instead of being refused as a second turn at once."""
        running = self.turns.get(sid)
        if running is None:
            return False
        with self._cancel_lock:
            if sid in self._to_cancel:
                return True
        try:
            return running.cancelled is not None and bool(running.cancelled(False))
        except Exception:  # noqa: BLE001 - a broken client counts as not cancelled here; the burst checks again
            return False
