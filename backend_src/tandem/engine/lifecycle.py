"""Session lifecycle of the :class:`~tandem.engine.scheduler.Scheduler`: closing (batched), idle
expiry, cancellation, and drafter failures. A drafter stage that fails (an error, an unloaded
``drafter_*`` model) degrades its sessions to plain decoding, which gives the same greedy output:
they are counted (``stats["degraded_sessions"]``), reported through ``on_event``, and their
drafter state is dropped; sessions admitted later use the drafter again once it answers.

A stage whose process died (or is being restarted) is named in ``unavailable``: no call goes to it;
without the trunk, turns are refused; without a drafter, sessions decode plain.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from .. import schema
from .session import Receipt

if TYPE_CHECKING:
    from .session import Turn


class Lifecycle:
    """Mixed into :class:`~tandem.engine.scheduler.Scheduler` (whose ``sessions``, ``turns``,
    ``trunk``, ``config``, ``stats`` and ``_by_drafter`` it uses)."""

    #: ``on_event(message)``: notable events without a request to answer (a drafter failed)
    on_event: Callable[[str], None] = staticmethod(lambda msg: None)
    #: model names of stages that must not be called (their process died; being restarted)
    unavailable: frozenset[str] = frozenset()
    #: ``on_stage_dead(model, reason)``: a stage call found the stage's process dead (a drafter's
    #: sessions have gone on plain; a trunk's turns fail)
    on_stage_dead: Callable[[str, str], None] = staticmethod(lambda model, reason: None)

    def stage_name(self, stage) -> str:
        """A stage's name: the model a proxy calls (:data:`tandem.schema.MODELS`), else ``"trunk"`` for the
        trunk stage and the stage's ``spec`` name (a drafter in this process)."""
        if (name := getattr(stage, "model_name", None)) is not None:
            return name
        spec = getattr(stage, "spec", None)
        return "trunk" if stage is self.trunk else (spec.name if spec is not None else type(stage).__name__)

    def _usable(self, stage) -> bool:
        return self.stage_name(stage) not in self.unavailable

    def forget_all(self, reason: str) -> None:
        """Every running and waiting turn gets one final ``reason``; every session is forgotten, its
        state closed in each stage still usable (best effort: a failure is only reported)."""
        turns = list(self.turns.values()) + list(getattr(self, "admitting", [])) + [t for _, t in self._waiting]
        self._waiting = []
        gone = list(self.sessions.values())
        self.turns.clear()
        self.sessions.clear()
        for t in turns:
            t.emit(None, reason, True)
        stages = [(self.trunk, gone)] + self._by_drafter(gone)
        for stage, group in stages:
            if group and self._usable(stage):
                try:
                    stage.close([s.sid for s in group])
                except Exception as e:  # noqa: BLE001
                    self.on_event(f"{self.stage_name(stage)} close failed: {type(e).__name__}: {e}")

    def _degrade(self, group: list, e: Exception) -> None:
        """Sessions ``group`` decode plain from now on; their drafter state is dropped (best effort)."""
        self.stats["degraded_sessions"] = self.stats.get("degraded_sessions", 0) + len(group)
        sids, arm = [s.sid for s in group], group[0].arm
        for s in group:
            s.degraded = True
        if getattr(e, "dead", False):
            self.on_stage_dead(self.stage_name(self.drafters[arm]), str(e))
        self.on_event(f"drafter {arm} failed ({type(e).__name__}: {e}); sequences {sids} continue by plain decoding")
        try:
            if self._usable(self.drafters[arm]):
                self.drafters[arm].close(sids)
        except Exception:  # noqa: BLE001 - the stage is failing already
            pass

    def _open_drafters(self, new: list, warm: dict) -> None:
        """Open the new sessions' drafter state, one call per stage; a stage that fails degrades its group."""
        for stage, group in self._by_drafter(new):
            if not self._usable(stage):
                self._degrade(group, RuntimeError(f"{self.stage_name(stage)} is unavailable"))
                continue
            try:
                if any(s.sid in warm for s in group):  # a DFlash drafter starts from published tails
                    stage.open([s.sid for s in group], [warm.get(s.sid) for s in group])
                else:
                    stage.open([s.sid for s in group])
            except Exception as e:  # noqa: BLE001 - plain decoding instead
                self._degrade(group, e)

    def _draft(self, stage, group: list, reqs: list) -> list[list[int]]:
        """One drafter call; on failure the group is degraded and drafts nothing (its rows are plain)."""
        if not self._usable(stage):
            self._degrade(group, RuntimeError(f"{self.stage_name(stage)} is unavailable"))
            return []
        try:
            return stage.draft(reqs)
        except Exception as e:  # noqa: BLE001 - plain decoding instead
            self._degrade(group, e)
            return []

    def _no_free_session(self, t: Turn) -> str:
        self.stats["sessions_refused_full"] = self.stats.get("sessions_refused_full", 0) + 1
        cfg = self.config
        return (
            f"{schema.SEQUENCE_ID}: no free session for {schema.sequence_name(t.sid)}: all {cfg.max_sessions} sessions are open "
            f"(max_sessions) and none closed within {cfg.admission_wait_s:g} s (admission_wait_s); end finished "
            f"sequences with {schema.SEQUENCE_END}, or retry later {schema.AT_CAPACITY_MARKER}"
        )

    def waiting(self) -> int:
        """Turns of new sequences waiting for a free session slot."""
        return len(self._waiting)

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
            "turns_waiting": len(self._waiting),
            "cache_rows": sum(len(s.committed) for s in self.sessions.values()),
            "prefix_cache_blocks": self.prefix.stats["blocks"] if self.prefix is not None else 0,
            "state_bytes": self.state_bytes(),
        }

    def close(self, sid: int) -> None:
        """Forget ``sid``; its stage state is dropped with the next batched close."""
        s = self.sessions.pop(sid, None)
        self.turns.pop(sid, None)
        if s is not None:
            self._to_close.append(s)

    def _flush_closes(self) -> None:
        gone, self._to_close = self._to_close, []
        if gone:
            for stage, group in [(self.trunk, gone)] + self._by_drafter(gone):
                if self._usable(stage):
                    stage.close([s.sid for s in group])

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
        self._flush_closes()
        self.stats["sessions_expired"] += len(gone)
        return gone

    def cancel(self, sid: int, reason: str = "cancelled", last: Receipt | None = None) -> None:
        """Abort a sequence's turn and close it; the turn gets one final error ``reason``, or with
        ``last`` that normal last response instead."""
        t = self.turns.get(sid)
        self.close(sid)
        self._flush_closes()
        if t is not None:
            t.emit(last, None if last is not None else reason, True)

    def request_cancel(self, sid: int, turn: Turn | None = None, reason: str | None = None) -> bool:
        """Thread-safe: cancel ``sid``'s turn at the next burst boundary: ``turn``, or (None) the turn
        running now, never a later turn of the same sequence. ``reason``: None for a client's cancel
        (counted in ``stats["cancelled"]``; the turn's last response is a normal one, no tokens, finish
        reason :data:`~tandem.schema.CANCELLED`: an error answer to a step of Triton 2.51's ensemble
        while another of its steps is in flight leaves the ensemble request in flight for good, fixed
        upstream in triton-inference-server/core#466), else the failure that already answered the turn. Returns
        False (nothing to do) when ``turn`` is None and the sequence has no turn running."""
        if turn is None and (turn := self.turns.get(sid)) is None:
            return False
        with self._cancel_lock:
            self._to_cancel[sid] = (turn, reason)
        return True

    def _apply_cancels(self) -> None:
        with self._cancel_lock:
            gone, self._to_cancel = self._to_cancel, {}
        for sid, (turn, reason) in gone.items():
            if self.turns.get(sid) is turn:  # a client's cancel is no failure: a last response (see request_cancel)
                if reason is None:
                    self._end_cancelled(turn)
                else:
                    self.cancel(sid, reason)

    def _end_cancelled(self, t: Turn) -> None:
        """End turn ``t``, which its client cancelled, now: its last response carries no tokens and finish
        reason :data:`~tandem.schema.CANCELLED`, its sequence is closed, ``stats["cancelled"]`` counts it.
        Every way a client cancels (its connection, a ``CANCEL`` request) ends here, once."""
        self.cancel(t.sid, "cancelled", Receipt(tokens=[], finish_reason=schema.CANCELLED))
        self.stats["cancelled"] += 1

    def _cancelled_by_client(self, turns: list, sync: bool) -> list:
        """The running turns among ``turns`` whose client has cancelled them (:attr:`Turn.cancelled`,
        asked with ``sync``)."""
        return [t for t in turns if t.cancelled is not None and self.turns.get(t.sid) is t and t.cancelled(sync)]
