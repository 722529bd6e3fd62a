"""The burst worker: admits turns, runs every active session in bursts of verify rounds (all
sessions' draft work batched into one drafter call per round, all verify work into one trunk
call, all commits into one), and publishes one receipt per session per burst.

:class:`Scheduler` is the synchronous core (used in-process and by tests); :class:`Worker` runs a
scheduler on a thread behind a request queue (used by the Triton ``tandem`` model).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

from .session import Receipt, SpecSession

Emit = Callable[[Receipt | None, str | None, bool], None]


@dataclasses.dataclass
class Turn:
    """One request in a sequence: append ``tokens`` and generate up to ``max_tokens``.

    ``spec``: ``"mtp"`` or ``"off"``; ``start``/``end``: Triton sequence flags; ``emit(receipt,
    error, final)`` is called once per burst and once with ``final=True``.
    """

    sid: int
    tokens: list[int]
    max_tokens: int
    emit: Emit
    spec: str = "mtp"
    start: bool = True
    end: bool = True
    k: int | None = None
    t_arrival: float = dataclasses.field(default_factory=time.monotonic)


class Scheduler:
    """Sessions by sequence id, and the round/burst loop over them.

    ``trunk``: a :class:`~tandem.stages.TrunkStage` (or its BLS proxy); ``drafter``: an
    :class:`~tandem.stages.MTPStage` (or proxy) or None; ``k``: default drafts per round;
    ``burst_rounds``: verify rounds per burst; ``idle_timeout_s``: sessions idle longer are closed.
    """

    SPECS = ("mtp", "off")

    def __init__(self, trunk, drafter=None, k: int = 3, burst_rounds: int = 4, max_ctx: int = 4096,
                 stop_ids: tuple[int, ...] = (), idle_timeout_s: float = 600.0, max_k: int = 8) -> None:
        self.trunk, self.drafter = trunk, drafter
        self.k, self.max_k = k, max_k
        self.burst_rounds = burst_rounds
        self.max_ctx = max_ctx
        self.stop_ids = tuple(stop_ids)
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[int, SpecSession] = {}
        self.turns: dict[int, Turn] = {}
        self.stats = {"sessions_opened": 0, "sessions_expired": 0, "rounds": 0, "drafted": 0, "accepted": 0}
        #: wall seconds spent per stage of :meth:`round` (summed over rounds; batched rounds count once)
        self.timing = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0, "commit_s": 0.0, "rounds": 0}

    # -- admission --------------------------------------------------------------------------------
    def validate(self, t: Turn) -> str | None:
        """Error text for a bad turn (naming the field and the limit), or None."""
        if t.spec not in self.SPECS:
            return f"spec must be one of {self.SPECS}, got {t.spec!r}"
        if t.spec == "mtp" and self.drafter is None:
            return "spec 'mtp' needs the drafter_mtp model, which is not loaded"
        if t.k is not None and not 1 <= t.k <= self.max_k:
            return f"num_draft_tokens must be in [1, {self.max_k}], got {t.k}"
        if t.max_tokens < 1:
            return f"max_tokens must be >= 1, got {t.max_tokens}"
        vocab = getattr(self.trunk, "vocab_size", None)
        if vocab is not None and any(not 0 <= x < vocab for x in t.tokens):
            return f"input_ids must be in [0, {vocab}), got a token outside it"
        if not t.start and t.sid not in self.sessions:
            return f"unknown sequence id {t.sid} (send START with the first turn)"
        if t.sid in self.turns:
            return f"sequence id {t.sid} already has a turn in progress"
        return None

    def admit(self, turns: list[Turn]) -> None:
        """Validate, open sessions, prime all admitted turns in one trunk call, emit first tokens."""
        ok: list[tuple[Turn, SpecSession, list[int]]] = []
        for t in turns:
            err = self.validate(t)
            if err is None and t.start and t.sid in self.sessions:
                self.close(t.sid)
            if err is None and t.sid not in self.sessions:
                spec_drafter = self.drafter if t.spec == "mtp" else None
                self.sessions[t.sid] = SpecSession(t.sid, self.trunk, spec_drafter, k=t.k or self.k,
                                                   max_ctx=self.max_ctx, stop_ids=self.stop_ids)
                self.stats["sessions_opened"] += 1
            if err is None:
                s = self.sessions[t.sid]
                try:
                    s.check_turn(t.tokens, t.max_tokens)
                except ValueError as e:
                    err = str(e)
            if err is not None:
                if t.start and t.sid in self.sessions and not self.sessions[t.sid].committed:
                    self.close(t.sid)
                t.emit(None, err, True)
                continue
            ok.append((t, s, s.prime_items(t.tokens)))
        if not ok:
            return
        outs = self.trunk.prime([(s.sid, rows) for _, s, rows in ok])
        for (t, s, rows), out in zip(ok, outs):
            r = s.after_prime(rows, out, t.max_tokens)
            self.turns[s.sid] = t
            self._publish(s, r)

    # -- rounds -----------------------------------------------------------------------------------
    def active(self) -> list[SpecSession]:
        return [self.sessions[sid] for sid in self.turns if not self.sessions[sid].turn_done]

    def round(self, receipts: dict[int, Receipt]) -> None:
        """One verify round over every active session (one call per stage)."""
        act = self.active()
        if not act:
            return
        clock = time.perf_counter
        t0 = clock()
        spec = [s for s in act if s.drafter is not None]
        drafts: dict[int, list[int]] = {s.sid: [] for s in act}
        if spec:
            res = self.drafter.draft([s.draft_item() for s in spec])
            for s, d in zip(spec, res):
                drafts[s.sid] = d
        t1 = clock()
        outs = self.trunk.verify([(s.sid, [s.anchor] + drafts[s.sid]) for s in act])
        t2 = clock()
        commits = []
        for s, out in zip(act, outs):
            r = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * max(s.k, 1)))
            commits.append((s.sid, s.after_verify(drafts[s.sid], out, r)))
        t3 = clock()
        self.trunk.commit(commits)
        t4 = clock()
        self.stats["rounds"] += len(act)
        tm = self.timing
        tm["draft_s"] += t1 - t0
        tm["verify_s"] += t2 - t1
        tm["accept_s"] += t3 - t2
        tm["commit_s"] += t4 - t3
        tm["rounds"] += 1

    def burst(self) -> None:
        """Run up to ``burst_rounds`` rounds, then publish each session's receipt (burst boundary)."""
        receipts: dict[int, Receipt] = {}
        for _ in range(self.burst_rounds):
            if not self.active():
                break
            self.round(receipts)
        for sid, r in receipts.items():
            self._publish(self.sessions[sid], r)

    def _publish(self, s: SpecSession, r: Receipt) -> None:
        t = self.turns.get(s.sid)
        self.stats["drafted"] += r.drafted
        self.stats["accepted"] += r.accepted
        if r.finish_reason is None:
            t.emit(r, None, False)
            return
        t.emit(r, None, True)
        del self.turns[s.sid]
        if t.end:
            self.close(s.sid)

    def close(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        self.turns.pop(sid, None)
        if s is not None:
            s.close()

    def expire_idle(self, now: float | None = None) -> list[int]:
        """Close sessions with no turn in progress and no activity for ``idle_timeout_s``."""
        now = time.monotonic() if now is None else now
        gone = [sid for sid, s in self.sessions.items()
                if sid not in self.turns and now - s.last_active > self.idle_timeout_s]
        for sid in gone:
            self.close(sid)
        self.stats["sessions_expired"] += len(gone)
        return gone

    def cancel(self, sid: int, reason: str = "cancelled") -> None:
        """Abort a sequence's turn and close it (client gone)."""
        t = self.turns.get(sid)
        self.close(sid)
        if t is not None:
            t.emit(None, reason, True)


class Worker:
    """A :class:`Scheduler` on a daemon thread. ``submit`` is thread-safe; emits happen on the
    worker thread. Exceptions inside a burst fail only the turns of that burst."""

    def __init__(self, scheduler: Scheduler, poll_s: float = 0.005) -> None:
        self.sched = scheduler
        self.q: queue.Queue[Turn] = queue.Queue()
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-worker", daemon=True)
        self._thread.start()

    def submit(self, turn: Turn) -> None:
        self.q.put(turn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _drain(self, block: bool) -> list[Turn]:
        out = []
        try:
            out.append(self.q.get(timeout=self.poll_s) if block else self.q.get_nowait())
            while True:
                out.append(self.q.get_nowait())
        except queue.Empty:
            pass
        return out

    def _loop(self) -> None:
        last_expire = time.monotonic()
        while not self._stop.is_set():
            new = self._drain(block=not self.sched.active())
            try:
                if new:
                    self.sched.admit(new)
                if self.sched.active():
                    self.sched.burst()
            except Exception as e:  # fail the in-flight turns, keep serving
                for sid in list(self.sched.turns):
                    self.sched.cancel(sid, f"internal error: {type(e).__name__}: {e}")
            if time.monotonic() - last_expire > 1.0:
                self.sched.expire_idle()
                last_expire = time.monotonic()
