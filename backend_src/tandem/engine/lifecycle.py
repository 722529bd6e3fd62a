"""Session lifecycle of the :class:`~tandem.engine.scheduler.Scheduler`: closing (batched), idle
expiry, cancellation, and drafter failures. A drafter stage that fails (an error, an unloaded
``drafter_*`` model) degrades its sessions to plain decoding, which gives the same greedy output:
they are counted (``stats["degraded_sessions"]``), reported through ``on_event``, and their
drafter state is dropped; sessions admitted later use the drafter again once it answers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .scheduler import Turn


class Lifecycle:
    """Mixed into :class:`~tandem.engine.scheduler.Scheduler` (whose ``sessions``, ``turns``,
    ``trunk``, ``config``, ``stats`` and ``_by_drafter`` it uses)."""

    #: ``on_event(message)``: notable events without a request to answer (a drafter failed)
    on_event: Callable[[str], None] = staticmethod(lambda msg: None)

    def _degrade(self, group: list, e: Exception) -> None:
        """Sessions ``group`` decode plain from now on; their drafter state is dropped (best effort)."""
        self.stats["degraded_sessions"] = self.stats.get("degraded_sessions", 0) + len(group)
        sids, arm = [s.sid for s in group], group[0].arm
        for s in group:
            s.degraded = True
        self.on_event(f"drafter {arm} failed ({type(e).__name__}: {e}); sequences {sids} continue by plain decoding")
        try:
            self.drafters[arm].close(sids)
        except Exception:  # noqa: BLE001 - the stage is failing already
            pass

    def _open_drafters(self, new: list, warm: dict) -> None:
        """Open the new sessions' drafter state, one call per stage; a stage that fails degrades its group."""
        for stage, group in self._by_drafter(new):
            try:
                if any(s.sid in warm for s in group):  # a DFlash drafter starts from published tails
                    stage.open([s.sid for s in group], [warm.get(s.sid) for s in group])
                else:
                    stage.open([s.sid for s in group])
            except Exception as e:  # noqa: BLE001 - plain decoding instead
                self._degrade(group, e)

    def _draft(self, stage, group: list, reqs: list) -> list[list[int]]:
        """One drafter call; on failure the group is degraded and drafts nothing (its rows are plain)."""
        try:
            return stage.draft(reqs)
        except Exception as e:  # noqa: BLE001 - plain decoding instead
            self._degrade(group, e)
            return []

    def close(self, sid: int) -> None:
        """Forget ``sid``; its stage state is dropped with the next batched close."""
        s = self.sessions.pop(sid, None)
        self.turns.pop(sid, None)
        if s is not None:
            self._to_close.append(s)

    def _flush_closes(self) -> None:
        gone, self._to_close = self._to_close, []
        if gone:
            self.trunk.close([s.sid for s in gone])
            for stage, group in self._by_drafter(gone):
                stage.close([s.sid for s in group])

    def expire_idle(self, now: float | None = None) -> list[int]:
        """Close sessions with no turn in progress and no activity for ``idle_timeout_s``."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, s in self.sessions.items()
                if sid not in self.turns and now - s.last_active > self.config.idle_timeout_s]
        for sid in gone:
            self.close(sid)
        self._flush_closes()
        self.stats["sessions_expired"] += len(gone)
        return gone

    def cancel(self, sid: int, reason: str = "cancelled") -> None:
        """Abort a sequence's turn and close it; the turn gets one final error."""
        t = self.turns.get(sid)
        self.close(sid)
        self._flush_closes()
        if t is not None:
            t.emit(None, reason, True)

    def request_cancel(self, sid: int, turn: Turn | None = None) -> None:
        """Thread-safe: cancel ``sid``'s turn at the next burst boundary (only ``turn``, when given,
        not a later turn of the same sequence)."""
        with self._cancel_lock:
            self._to_cancel[sid] = turn

    def _apply_cancels(self) -> None:
        with self._cancel_lock:
            gone, self._to_cancel = self._to_cancel, {}
        for sid, turn in gone.items():
            if sid in self.turns and (turn is None or self.turns[sid] is turn):
                self.cancel(sid, "cancelled by the client")
                self.stats["cancelled"] += 1
