"""The ``tandem`` model's engine side: a :class:`~tandem.worker.Scheduler` over stage proxies on a
:class:`~tandem.worker.Worker` thread, fed parsed requests, answering through callbacks.

``model_repository/tandem/1/model.py`` only converts ``pb_utils`` requests to
:class:`~tandem.bls.TurnRequest` s and arrays to responses; this class runs in-process too (with
:class:`~tandem.bls.LocalTransport` or the in-process stages), which is how it is unit-tested.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from .bls import TurnRequest, receipt_outputs
from .worker import Scheduler, Turn, Worker

#: ``send(outputs, error, final)``: one streamed response (``outputs`` None when ``error`` is set).
Send = Callable[[dict[str, np.ndarray] | None, str | None, bool], None]


class ServingScheduler(Scheduler):
    """A :class:`Scheduler` that also closes turns whose client went away (reported from any
    thread via :meth:`request_cancel`) at the next burst boundary."""

    def __init__(self, *args, on_cancel: Callable[[int], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_cancel = on_cancel
        self._cancel_lock = threading.Lock()
        self._to_cancel: dict[int, Turn | None] = {}
        self.stats["cancelled"] = 0

    def request_cancel(self, sid: int, turn: Turn | None = None) -> None:
        """Ask for ``sid``'s turn to be cancelled at the next burst boundary (thread-safe). With
        ``turn``, only that turn is cancelled (not a later turn of the same sequence)."""
        with self._cancel_lock:
            self._to_cancel[sid] = turn

    def burst(self) -> None:
        """Close the turns reported cancelled, then run one :meth:`Scheduler.burst`."""
        with self._cancel_lock:
            gone, self._to_cancel = self._to_cancel, {}
        for sid, turn in gone.items():
            if sid in self.turns and (turn is None or self.turns[sid] is turn):
                self.cancel(sid, "cancelled by the client")
                self.stats["cancelled"] += 1
                if self.on_cancel is not None:
                    self.on_cancel(sid)
        super().burst()


class TandemFront:
    """Sessions of the ``tandem`` model.

    Args: ``trunk`` / ``drafter`` — stages or their BLS proxies (``drafter`` None disables
    ``spec="mtp"``); ``stop_ids`` — tokenizer stop ids; ``max_ctx`` — tokens per session;
    ``k`` — default drafts per round (``max_k`` its limit); ``burst_rounds`` — rounds per streamed
    response; ``idle_timeout_s`` — sessions idle longer are closed (match the sequence batcher's
    ``max_sequence_idle_microseconds``); ``log`` — ``log(message)`` for errors that have no request;
    ``info`` — ``info(message)`` for notable events (a client cancelled a turn).
    """

    def __init__(self, trunk, drafter, stop_ids: tuple[int, ...], max_ctx: int = 4096, k: int = 3,
                 burst_rounds: int = 4, max_k: int = 8, idle_timeout_s: float = 600.0,
                 log: Callable[[str], None] | None = None, info: Callable[[str], None] | None = None) -> None:
        self.log = log or (lambda msg: None)
        self.info = info or (lambda msg: None)
        self.sched = ServingScheduler(trunk, drafter, k=k, burst_rounds=burst_rounds, max_ctx=max_ctx,
                                      stop_ids=stop_ids, idle_timeout_s=idle_timeout_s, max_k=max_k,
                                      on_cancel=lambda sid: self.info(f"sequence {sid}: turn cancelled by the client"))
        self.max_ctx = max_ctx
        self.worker = Worker(self.sched)

    def submit(self, req: TurnRequest, send: Send, is_cancelled: Callable[[], bool] | None = None) -> None:
        """Queue one turn. ``send`` is called on the worker thread once per burst and once with
        ``final=True`` (an error response is always final); it must not block for long. Exceptions
        from ``send`` / ``is_cancelled`` are logged and never reach other sessions."""
        sid = req.sid
        state = {"done": False, "turn": None}

        def emit(receipt, error, final):
            if state["done"]:
                return
            try:
                if error is not None:
                    state["done"] = True
                    send(None, error, True)
                    return
                if not final and is_cancelled is not None and is_cancelled():
                    self.sched.request_cancel(sid, state["turn"])
                    state["done"] = True
                    send(None, "cancelled by the client", True)  # close the response stream
                    return
                state["done"] = final
                send(receipt_outputs(receipt), None, final)
            except Exception as e:  # noqa: BLE001 - a broken client must not fail the burst
                self.log(f"sequence {sid}: could not send a response: {type(e).__name__}: {e}")
                if not final:
                    state["done"] = True
                    self.sched.request_cancel(sid, state["turn"])

        state["turn"] = Turn(sid, req.tokens, req.max_tokens, emit, spec=req.spec, start=req.start, end=req.end,
                             k=req.k)
        self.worker.submit(state["turn"])

    def reject(self, send: Send, error: str) -> None:
        """Answer a request that could not be parsed (on the caller's thread)."""
        try:
            send(None, error, True)
        except Exception as e:  # noqa: BLE001
            self.log(f"could not send an error response: {type(e).__name__}: {e}")

    def stop(self) -> None:
        """Stop the worker thread and fail the turns still in flight (no stage calls: at shutdown
        the stage models may already be gone, and their state dies with them)."""
        self.worker.stop()
        for t in list(self.sched.turns.values()):
            t.emit(None, "server shutting down", True)
        self.sched.turns.clear()
