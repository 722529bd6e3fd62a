"""The engine core's threads in the ``tandem`` model's process: the worker thread that owns every session
by running a :class:`~tandem.engine.scheduler.Scheduler`, the admission clock, the watchdog of drafter
models, stage restarts, the exit probe and gauges. Request parsing and response packing live in :mod:`tandem.serving.turns`, the stage proxies
in :mod:`tandem.serving.proxies`.

Triton-free: ``model_repository/tandem/1/model.py`` converts ``pb_utils`` tensors to numpy and back;
:class:`BLSTransport` gets ``pb_utils`` passed in. The trunk stage runs in this process; the drafters too
(``colocate``), or in their models over BLS (with :class:`LocalTransport` in tests).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable

from .. import schema
from ..engine.round_costs import RoundCosts
from ..engine.scheduler import Scheduler, Turn
from ..schema import Arrays, ServingConfig
from .process import set_thread_nice
from .memory import Trimmer
from .telemetry import Telemetry
from .proxies import StageError, WatchedTransport
from .turns import Usage, receipt_outputs

#: ``send(outputs, error, final)``: one streamed response (``outputs`` None when ``error`` is set).
Send = Callable[[Arrays | None, str | None, bool], None]


# -- the worker ---------------------------------------------------------------------------------------
SHUTTING_DOWN = f"server shutting down {schema.SESSION_LOST_MARKER}"
#: seconds between probes of the stage processes while no turn runs
PROBE_S = 2.0
#: seconds without a turn before a probe (a probe round is a BLS call per stage model, ~1 ms each:
#: a request arriving meanwhile waits, so back-to-back turns are never probed between)
PROBE_IDLE_S = 0.5
#: seconds between gauge updates while turns run (a changed gauge is an IPC to the server; idle: every loop)
GAUGES_S = 0.25
#: seconds between looks of the admission clock (:meth:`EngineCore._refuse_overdue`): a refusal comes at most
#: this late after ``admission_wait_s``
ADMISSION_TICK_S = 0.05
#: seconds between looks, while turns run, at whether the server has begun to exit (``exit_probe``)
EXIT_PROBE_S = 0.5
#: seconds :meth:`EngineCore.stop` waits for the worker (the model's ``finalize``, whose whole stop must
#: stay well inside the server's exit timeout, ``serve --exit-timeout-secs`` 10 s): a worker still in a
#: stage call by then is left behind (a daemon thread) and its stack logged
STOP_JOIN_S = 3.0


def server_exiting(e: BaseException) -> bool:
    """Whether a stage call failed because the Triton server is shutting down (BLS answers
    "Server not ready" once the server has begun to exit)."""
    return isinstance(e, StageError) and "not ready" in str(e).lower()


class EngineCore:
    """Sessions of the ``tandem`` model: a :class:`Scheduler` on a daemon worker thread, and a
    watchdog thread.

    Args: ``trunk`` — the trunk stage or proxy; ``drafters`` — spec -> drafter stage or proxy (specs
    not listed are refused); ``stop_ids``; ``decode`` (``list[int] -> str``, for stop strings); ``config``; ``log(message)`` for errors that have no
    request; ``info(message)`` for notable events (a client cancelled a turn); ``watch`` — the
    :class:`~tandem.serving.proxies.WatchedTransport` under the proxies (None: no stage deadline);
    ``restart(model)`` — called (on a thread of its own) when a stage's process died, to bring it
    back; it returns when the model is loaded again (or raises); ``gauges(values)`` — called with
    :meth:`gauge_values` whenever they may have changed; ``exit_probe()`` — whether the server has begun to exit (asked every
    :data:`EXIT_PROBE_S` while turns run, on a thread of its own: once it has, every turn ends with one
    "server shutting down" instead of running into the server's exit timeout; None: never asked); ``nice`` —
    the worker thread's nice value (``compute_nice``; 0: left as it
    is; :attr:`priority` says what it got); ``state_size`` — the
    session state estimate admission by bytes uses (:class:`~tandem.engine.state_size.StateSize`; None: by count
    alone); ``costs`` — the measured round costs (:func:`tandem.engine.calibration.calibrate`'s; None: measured
    from the first rounds); ``grammars`` — the structured-output engine
    (:class:`~tandem.engine.structured.Grammars`; None: ``RESPONSE_FORMAT`` refused). A clock thread refuses turns past ``admission_wait_s`` while the worker is busy
    (:meth:`_refuse_overdue`).

    Emits happen on the worker thread (the watchdog's while the worker waits on a stage call past
    ``config.stage_timeout_s``); an exception inside a burst fails only the turns in flight, with
    one final error each; a stage that died fails every turn (its state is gone) and is restarted.
    """

    def __init__(
        self,
        trunk,
        drafters: dict,
        stop_ids: tuple[int, ...],
        config: ServingConfig = schema.DEFAULTS,
        log: Callable[[str], None] | None = None,
        info: Callable[[str], None] | None = None,
        poll_s: float = 0.005,
        watch: WatchedTransport | None = None,
        restart: Callable[[str], None] | None = None,
        gauges: Callable[[dict[str, float]], None] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        state_size=None,
        nice: int = 0,
        exit_probe: Callable[[], bool] | None = None,
        costs: RoundCosts | None = None,
        grammars=None,
    ) -> None:
        self.log = log or (lambda msg: None)
        self.info = info or (lambda msg: None)
        self.sched = Scheduler(
            trunk,
            drafters,
            config,
            stop_ids=stop_ids,
            decode=decode,
            state_size=state_size,
            costs=costs,
            grammars=grammars,
        )
        self.sched.failure_text = lambda e: SHUTTING_DOWN if server_exiting(e) else None
        self.sched.on_event = self.log
        self.sched.on_stage_dead = self._stage_dead
        self.q: queue.Queue[Turn] = queue.Queue()
        self.poll_s = poll_s
        self.watch, self.restart, self.on_gauges = watch, restart, gauges
        #: request metrics (counters, histogram samples) until a publisher drains them
        self.telemetry = Telemetry()
        #: gives the memory of closed sessions back to the system (:mod:`tandem.serving.memory`)
        self.trimmer = Trimmer()
        self._stat_seen: dict[str, int] = {}
        #: turn numbers (``TURN``): 1, 2, ... over the process's life
        self._numbers = itertools.count(1)
        #: set once the server is shutting down (a stage answered "not ready", or :meth:`stop`)
        self.exiting = False
        self._emit_lock = threading.Lock()
        self._stop = threading.Event()
        self._nice = nice
        #: what the worker thread's nice value became (:func:`~tandem.serving.process.set_thread_nice`)
        self.priority = ""
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-worker", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch_loop, name="tandem-watchdog", daemon=True)
        if watch is not None:
            self._watchdog.start()
        self._admission = threading.Thread(target=self._admission_loop, name="tandem-admission", daemon=True)
        self._admission.start()
        self.exit_probe = exit_probe
        if exit_probe is not None:
            threading.Thread(target=self._exit_watch_loop, name="tandem-exit-watch", daemon=True).start()

    def submit(self, req: Turn, send: Send, is_cancelled: Callable[[bool], bool] | None = None) -> None:
        """Queue one turn (a :func:`~tandem.serving.turns.parse_turn` result; its ``emit``, ``number``
        and ``cancelled`` are set here). ``send`` is called once per burst and once with ``final=True`` (an
        error response is always final; a turn with ``stream`` False: once, its bursts merged); it must
        not block for long. ``is_cancelled(sync)``: whether the client has cancelled the request
        (:attr:`~tandem.engine.session.Turn.cancelled`); a cancelled turn ends with a normal last response,
        finish reason ``cancelled``. Exceptions from ``send`` / ``is_cancelled`` are logged and never reach
        other sessions. Metrics follow the turn as its tokens are produced, streamed or not: time to the
        first token, the gaps between bursts, one count per ending (:class:`~tandem.serving.telemetry.TurnClock`)."""
        state: dict[str, Any] = {"done": False, "turn": None, "sent": False, "tail": [], "held": None}
        clock, usage, number = self.telemetry.turn(), Usage(), next(self._numbers)

        def cancelled(sync: bool) -> bool:
            try:
                if is_cancelled is None or not is_cancelled(sync):
                    return False
            except Exception as e:  # noqa: BLE001 - a broken client must not fail the burst
                self.log(f"sequence {req.sid}: could not ask whether the client cancelled: {type(e).__name__}: {e}")
                return False
            self.info(f"sequence {req.sid}: turn {number} cancelled by the client")
            return True

        def emit(receipt, error, final):
            with self._emit_lock:  # the watchdog may answer a turn while the worker is stuck
                if state["done"]:
                    return
                try:
                    if error is not None:
                        state["done"] = True
                        clock.error()
                        send(None, error, True)
                        return
                    state["done"] = final
                    if not state["sent"]:  # after the prime: the session's committed rows are the context
                        state["sent"] = True
                        self.telemetry.count("prompt_tokens_total", len(req.tokens))
                        s = self.sched.sessions.get(req.sid)
                        usage.prompt_tokens = len(s.committed) if s is not None else len(req.tokens)
                    clock.response(receipt, receipt.spec_rounds)  # as produced, whether sent now or merged
                    usage.add(receipt)
                    if not req.stream:  # one response: the bursts merged
                        if state["held"] is not None:
                            state["held"].merge(receipt)
                            receipt = state["held"]
                        if not final:
                            state["held"] = receipt
                            return
                    send(receipt_outputs(receipt, usage, state["tail"], req.sid, number), None, final)
                    state["tail"] = (state["tail"] + receipt.tokens)[-schema.DETOKENIZE_WINDOW :]
                except Exception as e:  # noqa: BLE001 - a broken client must not fail the burst
                    self.log(f"sequence {req.sid}: could not send a response: {type(e).__name__}: {e}")
                    if not final:
                        state["done"] = True
                        self.sched.request_cancel(req.sid, state["turn"])

        state["turn"] = dataclasses.replace(
            req, emit=emit, number=number, cancelled=cancelled, arrived=time.monotonic()
        )
        if (err := self.sched.compile_format(state["turn"])) is not None:  # here, not on the worker's thread
            emit(None, err, True)
            return
        self.q.put(state["turn"])

    def cancel_session(self, sid: int, send: Send, number: int | None = None) -> None:
        """A ``CANCEL`` request: the running turn of ``sid`` (only when its number is ``number``,
        ``CANCEL_TURN``; None: whichever runs) ends at the next burst boundary, counted as a client's
        cancel, as a cancelled connection is; a sequence with no such turn running: nothing happens, and
        no later turn is touched. Answered at once with an empty final response."""
        t = self.sched.turns.get(sid)
        if t is not None and (number is None or t.number == number) and self.sched.request_cancel(sid, t):
            self.info(f"sequence {sid}: turn {t.number} cancelled (CANCEL request: its client left the ensemble)")
        try:
            send({}, None, True)
        except Exception as e:  # noqa: BLE001
            self.log(f"could not answer a CANCEL request: {type(e).__name__}: {e}")

    def reject(self, send: Send, error: str) -> None:
        """Answer a request that could not be parsed (on the caller's thread; counted in ``request_errors_total``)."""
        self.telemetry.count("request_errors_total")
        try:
            send(None, error, True)
        except Exception as e:  # noqa: BLE001
            self.log(f"could not send an error response: {type(e).__name__}: {e}")

    def gauge_values(self) -> dict[str, float]:
        """The scheduler's gauges (:meth:`~tandem.engine.scheduler.Scheduler.gauges`) and its
        lifecycle counters (``sessions_opened``, ``sessions_expired``, ``cancelled``, ...)."""
        st = self.sched.stats
        trunk = {"trunk_sequences": len(getattr(self.sched.trunk, "states", ()))}
        out = {**self.sched.gauges(), **trunk, **{k: st.get(k, 0) for k in COUNTERS}}
        assert tuple(out) == tuple(GAUGES)
        return out

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
        self.priority = set_thread_nice(self._nice)
        self._started.set()
        last_expire = last_probe = last_gauges = last_busy = time.monotonic()
        while not self._stop.is_set():
            sched = self.sched
            held = len(sched.sessions)
            if sched.turns:
                last_busy = time.monotonic()
            new = self._drain(block=not sched.busy())  # waiting turns retry every poll_s
            if new:
                last_busy = time.monotonic()
            if self.exiting:  # the server is shutting down: end and refuse every turn, call no stage
                for t in new:
                    t.emit(None, SHUTTING_DOWN, True)
                if sched.turns or sched.waiting():
                    self._fail_all(SHUTTING_DOWN)
                continue
            try:
                if new or sched.waiting():
                    sched.admit(new)
                if sched.busy():
                    sched.burst()
                if self._stop.is_set():  # stopping: no idle stage call (the stage models are unloading)
                    break
                if time.monotonic() - last_expire > 1.0:
                    sched.expire_idle()
                    last_expire = time.monotonic()
                now = time.monotonic()
                if not sched.turns and now - last_probe > PROBE_S and now - last_busy > PROBE_IDLE_S:
                    last_probe = now
                    self._probe()
            except Exception as e:  # noqa: BLE001 - fail the in-flight turns, keep serving
                self.log(f"worker: {type(e).__name__}: {e}")
                self._failed(e)
            self._count_stats()
            if len(sched.sessions) < held:  # sessions closed: their memory goes back to the system (memory.py)
                self.trimmer.closed()
            self.trimmer.after_request()
            if self.on_gauges is not None and (not sched.busy() or time.monotonic() - last_gauges >= GAUGES_S):
                last_gauges = time.monotonic()
                try:
                    self.on_gauges(self.gauge_values())
                except Exception as e:  # noqa: BLE001 - metrics must not stop sessions
                    self.log(f"gauges: {type(e).__name__}: {e}")

    def _count_stats(self) -> None:
        """The scheduler's draft-length (rests and returns) and prefix-cache counts since the last call, into
        :attr:`telemetry`."""
        sched = self.sched
        now = {
            "demotions_total": sched.stats.get("demotions", 0),
            "promotions_total": sched.stats.get("promotions", 0),
            "accept_walks_total": sched.stats.get("accept_walks", 0),
            "compiled_spec_rounds_total": sched.stats.get("compiled_rounds", 0),
        }
        if sched.prefix is not None:
            now.update(
                prefix_cache_hits_total=sched.prefix.stats["hits"],
                prefix_cache_misses_total=sched.prefix.stats["misses"],
            )
        for k, v in now.items():
            if v != self._stat_seen.get(k, 0):
                self.telemetry.count(k, v - self._stat_seen.get(k, 0))
                self._stat_seen[k] = v

    def _probe(self) -> None:
        """While no turn runs: find stages whose process died (and restart them) before a turn needs them."""
        sched = self.sched
        for stage in dict.fromkeys([sched.trunk, *sched.drafters.values()]):
            if self._stop.is_set():
                return
            if hasattr(stage, "probe") and sched.stage_name(stage) not in sched.unavailable:
                try:
                    stage.probe()
                except StageError as e:
                    if e.dead:
                        self._stage_dead(e.model, str(e))

    def _failed(self, e: Exception) -> None:
        """After a failed stage call: the server exiting fails everything without further calls; a
        dead stage fails every turn (its state is gone) and is restarted; else the turns in flight fail.
        """
        if server_exiting(e):  # the stage models are going away: no further stage calls
            self.exiting = True
            self._fail_all(SHUTTING_DOWN)
            return
        if isinstance(e, StageError) and e.dead:
            self._stage_dead(e.model, str(e))
            return
        text = str(e) if isinstance(e, StageError) else f"internal error: {type(e).__name__}: {e}"
        for sid in list(self.sched.turns):
            self.sched.cancel(sid, text)

    def _stage_dead(self, model: str, reason: str) -> None:
        """``model``'s process died. The trunk's death loses every session's caches: each session is
        forgotten and its turn fails with ``reason``; a drafter's sessions went on plain already.
        ``restart`` runs on a thread of its own, and until it returns no call goes to ``model``."""
        sched = self.sched
        restart = self.restart is not None and model not in sched.unavailable
        if restart:
            sched.unavailable = sched.unavailable | {model}
        if model == sched.stage_name(sched.trunk):
            sched.forget_all(f"{reason} (every session's state was lost; restarting {model})")
        if not restart:
            return
        reason = f"{model}'s process died ({reason}); restarting it"
        sched.stats["stage_restarts"] = sched.stats.get("stage_restarts", 0) + 1
        self.log(reason)

        def run():
            try:
                self.restart(model)
                self.log(f"{model} is back")
            except Exception as e:  # noqa: BLE001 - stays unavailable; health reports it
                self.log(f"{model} could not be restarted: {type(e).__name__}: {e}")
                return
            sched.unavailable = sched.unavailable - {model}

        threading.Thread(target=run, name=f"tandem-restart-{model}", daemon=True).start()

    def _exit_watch_loop(self) -> None:
        """Every :data:`EXIT_PROBE_S` while turns run: once ``exit_probe`` says the server is exiting, set
        :attr:`exiting` (the worker then ends every turn with one "server shutting down")."""
        while not self._stop.wait(EXIT_PROBE_S):
            if not (self.sched.turns or self.sched.waiting()):
                continue
            try:
                if self.exit_probe():
                    self.exiting = True
                    return
            except Exception as e:  # noqa: BLE001 - the look must outlive any one failure
                self.log(f"exit probe: {type(e).__name__}: {e}")

    def _admission_loop(self) -> None:
        """Every :data:`ADMISSION_TICK_S`: refuse the turns whose ``admission_wait_s`` has passed without a
        session for them, whatever the worker is doing (a prime of many sessions, a long burst)."""
        while not self._stop.wait(ADMISSION_TICK_S):
            try:
                self._refuse_overdue()
            except Exception as e:  # noqa: BLE001 - the admission clock must outlive any one failure
                self.log(f"admission: {type(e).__name__}: {e}")

    def _refuse_overdue(self, now: float | None = None) -> int:
        """Refuse the waiting turns past their deadline (:meth:`Scheduler.refuse_overdue`) and the queued
        turns of new sequences the worker has not reached by theirs while every session slot is taken
        (those beyond the free slots, in arrival order). Returns how many were refused."""
        sched, now = self.sched, time.monotonic() if now is None else now
        n = sched.refuse_overdue(now)
        free = sched.config.max_sessions - len(sched.sessions) - sched.waiting()
        late = []
        with self.q.mutex:  # (the worker drains the queue under the same lock: a turn is refused or drained)
            for t in list(self.q.queue):
                if not t.start or t.sid in sched.sessions:  # (only a new sequence needs a slot)
                    continue
                if free > 0:
                    free -= 1
                elif t.arrived and now - t.arrived >= sched.config.admission_wait_s:
                    late.append(t)
            for t in late:
                self.q.queue.remove(t)
        for t in late:
            t.emit(None, sched.no_free_session(t), True)
        return n + len(late)

    def _watch_loop(self) -> None:
        """While a stage call runs past ``stage_timeout_s``: its turns get one final error naming the
        stage, and every turn arriving until it returns is refused with the same (the worker is stuck)."""
        assert self.watch is not None
        while not self._stop.wait(min(0.1, self.sched.config.stage_timeout_s / 4)):
            try:
                self._watch_once()
            except Exception as e:  # noqa: BLE001 - the watchdog must outlive any one failure
                self.log(f"watchdog: {type(e).__name__}: {e}")

    def _watch_once(self) -> None:
        """One look of :meth:`_watch_loop`."""
        err = self.watch.overdue()
        if err is not None:
            self.log(f"watchdog: {err}")
            sched = self.sched
            for _ in range(3):  # the worker may wake up meanwhile and change the dicts
                try:
                    turns = sched.in_flight()
                    break
                except RuntimeError:
                    turns = []
            for t in turns:
                t.emit(None, str(err), True)
                sched.request_cancel(t.sid, t, str(err))  # closed once the worker is back
        if self.watch.stalled is not None:
            for t in self._drain(block=False):
                t.emit(
                    None,
                    f"{self.watch.stalled} is not answering (a call has run past "
                    f"{self.watch.timeout_s:g} s, stage_timeout_s); retry later",
                    True,
                )

    def _fail_all(self, reason: str) -> None:
        """Every turn in flight or queued gets one final ``reason``; sessions are forgotten without
        stage calls (at shutdown the stage models may be gone already, and their state dies with them)."""
        for t in self.sched.drop_all() + self._drain(block=False):
            t.emit(None, reason, True)

    def stop(self, timeout_s: float = STOP_JOIN_S) -> bool:
        """Stop the worker and fail the turns in flight (see :meth:`_fail_all`). Waits ``timeout_s``
        seconds for the worker; one still inside a stage call then is left behind, its stack logged.
        Returns whether the worker stopped."""
        self.exiting = True
        self._stop.set()
        self._thread.join(timeout_s)
        stopped = not self._thread.is_alive()
        if not stopped:
            frame = sys._current_frames().get(self._thread.ident)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
            self.log(f"worker did not stop within {timeout_s:g} s; left behind in:\n{where.rstrip()}")
        self._fail_all(SHUTTING_DOWN)
        return stopped


#: the ``tandem`` model's gauges (metric ``tandem_<name>``, :meth:`EngineCore.gauge_values`): the
#: scheduler's (:meth:`~tandem.engine.scheduler.Scheduler.gauges`), then its lifecycle counters
GAUGES = {
    "sessions_open": "open sessions (sequences with state in the stages)",
    "session_slots_free": "sessions that may still open (max_sessions minus open)",
    "turns_running": "turns being generated",
    "turns_waiting": "turns of new sequences waiting for a free session slot",
    "cache_rows": "trunk cache rows (tokens) held by the open sessions",
    "prefix_cache_blocks": "prompt blocks (64 tokens each) held by the prefix cache",
    "state_bytes": "estimated bytes of state (trunk caches, drafter KV) the open sessions hold at their contexts",
    "trunk_sequences": "sequences whose trunk cache the engine core's trunk stage holds",
    "sessions_opened": "sessions opened since the server started",
    "sessions_expired": "sessions closed for idling past idle_timeout_s",
    "sessions_refused_full": "new sequences refused after waiting admission_wait_s for a slot",
    "sessions_refused_memory": "turns refused after waiting admission_wait_s for room within max_state_mb",
    "cancelled": "turns cancelled by their client (stop_stream, a dropped connection)",
    "degraded_sessions": "sessions moved to plain decoding because their drafter failed",
    "stage_restarts": "stage models restarted after their process died",
}
COUNTERS = tuple(GAUGES)[8:]
