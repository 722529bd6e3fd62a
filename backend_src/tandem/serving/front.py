"""Everything that runs inside the ``tandem`` Triton model (besides the engine it drives): request
parsing and the worker thread that runs a :class:`~tandem.engine.scheduler.Scheduler`; the stage
proxies it drives live in :mod:`tandem.serving.proxies` (re-exported here).

Triton-free: ``model_repository/tandem/1/model.py`` converts ``pb_utils`` tensors to numpy and back;
:class:`BLSTransport` gets ``pb_utils`` passed in. With :class:`LocalTransport` the same code runs
in-process over the stages' wire form (``handle``), which is how it is unit-tested.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import schema
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Scheduler, Turn
from ..schema import Arrays, ServingConfig, WireError
from .proxies import (BLSTransport, CallStats, DFlashProxy, DrafterProxy, LocalTransport, StageError,  # noqa: F401
                      Transport, TrunkProxy)

#: ``send(outputs, error, final)``: one streamed response (``outputs`` None when ``error`` is set).
Send = Callable[[Arrays | None, str | None, bool], None]


# -- requests in, receipts out ------------------------------------------------------------------------
@dataclasses.dataclass
class TurnRequest:
    """A decoded ``tandem`` request: a :class:`~tandem.engine.scheduler.Turn` without its ``emit``."""

    sid: int
    tokens: list[int]
    max_tokens: int
    spec: str | None = None
    start: bool = True
    end: bool = True
    num_draft_tokens: int | None = None
    sampling: SamplingParams | None = None


def parse_sampling(arrays: Arrays) -> SamplingParams | None:
    """The turn's sampling inputs (None when it sends none: greedy). Raises
    :class:`~tandem.schema.WireError` naming a field of the wrong shape or out of range."""
    specs = {t.name: t for t in schema.SAMPLING_INPUTS}
    if not any(n in arrays for n in specs):
        return None
    kw = {n: schema.get_scalar(arrays, t) for n, t in specs.items() if n != schema.SAMPLING}
    mode = schema.get_string(arrays, specs[schema.SAMPLING]).strip().lower()
    return SamplingParams.create(kw[schema.TEMPERATURE], kw[schema.TOP_K], kw[schema.TOP_P], kw[schema.SEED], mode)


def parse_turn(arrays: Arrays, correlation_id: int | None = None) -> TurnRequest:
    """Decode a ``tandem`` request's tensors (absent optional inputs left out of ``arrays``).

    ``CORRID`` / ``START`` / ``END`` come from the sequence batcher's control inputs (falling back
    to ``correlation_id`` and START+END when absent). Value ranges are checked once, by
    :meth:`Scheduler.validate`. Raises :class:`~tandem.schema.WireError` naming the field when a
    tensor has the wrong shape or a required one is missing.
    """
    spec = schema.TANDEM
    corr = arrays.get(schema.CORRID)
    if corr is not None and np.asarray(corr).size:
        sid = int(np.asarray(corr).reshape(-1).astype(np.uint64)[0])
    elif correlation_id is not None:
        sid = int(correlation_id)
    else:
        raise WireError(f"{schema.CORRID}: the request carries no sequence id")
    flag = schema.TensorSpec("", "TYPE_INT32", (1,), optional=True, default=1)
    start = bool(schema.get_scalar(arrays, dataclasses.replace(flag, name=schema.START)))
    end = bool(schema.get_scalar(arrays, dataclasses.replace(flag, name=schema.END)))
    ids = arrays.get(schema.INPUT_IDS)
    if ids is not None and np.asarray(ids).ndim != 1:
        raise WireError(f"{schema.INPUT_IDS} must be 1-D, got shape {list(np.asarray(ids).shape)}")
    tokens = [] if ids is None else np.asarray(ids).astype(np.int64).tolist()
    arm = None if schema.SPEC not in arrays else schema.get_string(arrays, spec.input(schema.SPEC)).strip().lower()
    return TurnRequest(sid, tokens, schema.get_scalar(arrays, spec.input(schema.MAX_TOKENS)), arm or None, start, end,
                       None if schema.NUM_DRAFT_TOKENS not in arrays
                       else schema.get_scalar(arrays, spec.input(schema.NUM_DRAFT_TOKENS)), parse_sampling(arrays))


def receipt_outputs(receipt) -> Arrays:
    """One streamed ``tandem`` response (:data:`tandem.schema.TANDEM` outputs) from a
    :class:`~tandem.engine.session.Receipt`: ``OUTPUT_IDS [n]`` int32, ``ROUNDS`` / ``DRAFTED`` /
    ``ACCEPTED [1]`` int32 (deltas for this burst), ``FINISH_REASON [1]`` ("" while streaming)."""
    out = {schema.OUTPUT_IDS: np.array(receipt.tokens, dtype=np.int32),
           schema.ROUNDS: np.array([receipt.rounds], dtype=np.int32),
           schema.DRAFTED: np.array([receipt.drafted], dtype=np.int32),
           schema.ACCEPTED: np.array([receipt.accepted], dtype=np.int32),
           schema.FINISH_REASON: schema.string_array(receipt.finish_reason or "")}
    assert tuple(out) == schema.TANDEM.output_names
    return out


# -- the worker ---------------------------------------------------------------------------------------
SHUTTING_DOWN = "server shutting down"


def server_exiting(e: BaseException) -> bool:
    """Whether a stage call failed because the Triton server is shutting down (BLS answers
    "Server not ready" once the server has begun to exit)."""
    return isinstance(e, StageError) and "not ready" in str(e).lower()


class TandemFront:
    """Sessions of the ``tandem`` model: a :class:`Scheduler` on a daemon worker thread.

    Args: ``trunk`` — the trunk stage or proxy; ``drafters`` — arm -> drafter stage or proxy (arms
    not listed are refused); ``stop_ids``; ``config``; ``log(message)`` for errors that have no request; ``info(message)``
    for notable events (a client cancelled a turn). Emits happen on the worker thread; an exception
    inside a burst fails only the turns in flight, with one final error each.
    """

    def __init__(self, trunk, drafters: dict, stop_ids: tuple[int, ...], config: ServingConfig = schema.DEFAULTS,
                 log: Callable[[str], None] | None = None, info: Callable[[str], None] | None = None,
                 poll_s: float = 0.005) -> None:
        self.log = log or (lambda msg: None)
        self.info = info or (lambda msg: None)
        self.sched = Scheduler(trunk, drafters, config, stop_ids=stop_ids)
        self.sched.failure_text = lambda e: SHUTTING_DOWN if server_exiting(e) else None
        self.sched.on_event = self.log
        self.q: queue.Queue[Turn] = queue.Queue()
        self.poll_s = poll_s
        #: set once the server is shutting down (a stage answered "not ready", or :meth:`stop`)
        self.exiting = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-worker", daemon=True)
        self._thread.start()

    def submit(self, req: TurnRequest, send: Send, is_cancelled: Callable[[], bool] | None = None) -> None:
        """Queue one turn. ``send`` is called once per burst and once with ``final=True`` (an error
        response is always final); it must not block for long. Exceptions from ``send`` /
        ``is_cancelled`` are logged and never reach other sessions."""
        state: dict[str, Any] = {"done": False, "turn": None}

        def emit(receipt, error, final):
            if state["done"]:
                return
            try:
                if error is not None:
                    state["done"] = True
                    send(None, error, True)
                    return
                if not final and is_cancelled is not None and is_cancelled():
                    self.sched.request_cancel(req.sid, state["turn"])
                    self.info(f"sequence {req.sid}: turn cancelled by the client")
                    state["done"] = True
                    send(None, "cancelled by the client", True)  # closes the response stream
                    return
                state["done"] = final
                send(receipt_outputs(receipt), None, final)
            except Exception as e:  # noqa: BLE001 - a broken client must not fail the burst
                self.log(f"sequence {req.sid}: could not send a response: {type(e).__name__}: {e}")
                if not final:
                    state["done"] = True
                    self.sched.request_cancel(req.sid, state["turn"])

        state["turn"] = Turn(req.sid, req.tokens, req.max_tokens, emit, spec=req.spec, start=req.start, end=req.end,
                             num_draft_tokens=req.num_draft_tokens, sampling=req.sampling)
        self.q.put(state["turn"])

    def reject(self, send: Send, error: str) -> None:
        """Answer a request that could not be parsed (on the caller's thread)."""
        try:
            send(None, error, True)
        except Exception as e:  # noqa: BLE001
            self.log(f"could not send an error response: {type(e).__name__}: {e}")

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
            if self.exiting:  # the server is shutting down: refuse, call no stage
                for t in new:
                    t.emit(None, SHUTTING_DOWN, True)
                continue
            try:
                if new:
                    self.sched.admit(new)
                if self.sched.active():
                    self.sched.burst()
            except Exception as e:  # noqa: BLE001 - fail the in-flight turns, keep serving
                self.log(f"worker: {type(e).__name__}: {e}")
                if server_exiting(e):  # the stage models are going away: no further stage calls
                    self.exiting = True
                    self._fail_all(SHUTTING_DOWN)
                    continue
                for sid in list(self.sched.turns):
                    self.sched.cancel(sid, f"internal error: {type(e).__name__}: {e}")
            if time.monotonic() - last_expire > 1.0:
                self.sched.expire_idle()
                last_expire = time.monotonic()

    def _fail_all(self, reason: str) -> None:
        """Every turn in flight or queued gets one final ``reason``; sessions are forgotten without
        stage calls (at shutdown the stage models may be gone already, and their state dies with them)."""
        for t in list(self.sched.turns.values()) + self._drain(block=False):
            t.emit(None, reason, True)
        self.sched.turns.clear()
        self.sched.sessions.clear()

    def stop(self) -> None:
        """Stop the worker and fail the turns in flight (see :meth:`_fail_all`)."""
        self.exiting = True
        self._stop.set()
        self._thread.join(timeout=10)
        self._fail_all(SHUTTING_DOWN)
