"""Everything that runs inside the ``tandem`` Triton model (besides the engine it drives): request
parsing, the worker thread that runs a :class:`~tandem.engine.scheduler.Scheduler`, and the stage
proxies that reach the ``trunk`` and ``drafter_mtp`` models, one BLS call per batched op.

Triton-free: ``model_repository/tandem/1/model.py`` converts ``pb_utils`` tensors to numpy and back;
:class:`BLSTransport` gets ``pb_utils`` passed in. With :class:`LocalTransport` the same code runs
in-process over the stages' wire form (``handle``), which is how it is unit-tested.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .. import schema
from ..engine.protocols import Commit, DraftRequest, Rows, VerifyOut
from ..engine.scheduler import Scheduler, Turn
from ..schema import Arrays, ServingConfig, WireError

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
                       else schema.get_scalar(arrays, spec.input(schema.NUM_DRAFT_TOKENS)))


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


# -- transports ---------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A stage call failed; ``model`` and ``op`` say which, the message carries the remote error."""

    def __init__(self, model: str, op: str, message: str) -> None:
        super().__init__(f"{model}.{op}: {message}")
        self.model, self.op = model, op


class Transport(Protocol):
    """``transport(model, op, arrays) -> outputs``: one call of a stage model. Raises :class:`StageError`."""

    def __call__(self, model: schema.ModelSpec, op: str, arrays: Arrays) -> Arrays: ...


@dataclasses.dataclass
class CallStats:
    """Per ``model.op``: number of calls and total seconds (BLS round-trip figures for the bench)."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, key: str, dt: float) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"model.op": {"calls": n, "mean_ms": ...}}``."""
        return {k: {"calls": n, "mean_ms": 1e3 * self.seconds[k] / n} for k, n in sorted(self.calls.items())}


class LocalTransport:
    """Calls stages' wire form (``handle``) in this process, copying arrays both ways as a server
    would. ``stages``: model name -> stage. Wire errors become :class:`StageError`."""

    def __init__(self, stages: dict[str, Any]) -> None:
        self.stages = stages
        self.stats = CallStats()

    def __call__(self, model: schema.ModelSpec, op: str, arrays: Arrays) -> Arrays:
        t0 = time.perf_counter()
        try:
            out = self.stages[model.name].handle({"OP": schema.string_array(op),
                                                  **{k: np.array(v, copy=True) for k, v in arrays.items()}})
        except WireError as e:
            raise StageError(model.name, op, str(e)) from None
        finally:
            self.stats.add(f"{model.name}.{op}", time.perf_counter() - t0)
        return {k: np.array(out[k], copy=True) for k in model.output_names}


class BLSTransport:
    """One ``pb_utils.InferenceRequest(...).exec()`` per call, from any thread of a decoupled model.
    ``pb_utils``: the ``triton_python_backend_utils`` module, passed in. Raises :class:`StageError`."""

    def __init__(self, pb_utils, timeout_us: int = 0) -> None:
        self.pb = pb_utils
        self.timeout_us = timeout_us
        self.stats = CallStats()

    def __call__(self, model: schema.ModelSpec, op: str, arrays: Arrays) -> Arrays:
        pb = self.pb
        tensors = [pb.Tensor("OP", schema.string_array(op))]
        tensors += [pb.Tensor(k, np.ascontiguousarray(v)) for k, v in arrays.items()]
        kw = {"timeout": self.timeout_us} if self.timeout_us else {}
        t0 = time.perf_counter()
        resp = pb.InferenceRequest(model_name=model.name, inputs=tensors,
                                   requested_output_names=list(model.output_names), **kw).exec()
        self.stats.add(f"{model.name}.{op}", time.perf_counter() - t0)
        if resp.has_error():
            raise StageError(model.name, op, resp.error().message())
        out = {}
        for name in model.output_names:
            t = pb.get_output_tensor_by_name(resp, name)
            if t is None:
                raise StageError(model.name, op, f"response lacks output {name}")
            out[name] = np.array(t.as_numpy(), copy=True)  # own the bytes: the response's buffer dies with it
        return out


# -- stage proxies ------------------------------------------------------------------------------------
def _rows_of(items: list[DraftRequest], field: str) -> np.ndarray:
    """The items' per-row tensors ``field`` (``hidden`` or ``features``) stacked ``[sum n, width]`` fp32."""
    return np.ascontiguousarray(np.concatenate(
        [getattr(it, field).detach().float().reshape(len(it.next_tokens), -1).numpy() for it in items]), dtype=np.float32)


class _Proxy:
    def __init__(self, transport: Transport, spec: schema.ModelSpec, on_error: Callable[[str], None] | None) -> None:
        self.t, self.spec, self.on_error = transport, spec, on_error

    def _drafts(self, items: list[DraftRequest], arrays) -> list[list[int]]:
        """One ``draft`` call: ``arrays(items)`` packs the model-specific inputs; SIDS and
        NUM_DRAFT_TOKENS are added here. Returns the drafts per item."""
        if not items:
            return []
        out = self.t(self.spec, "draft", {"SIDS": schema.sids_to_wire([it.sid for it in items]),
                                          schema.NUM_DRAFT_TOKENS: np.array([it.num_draft_tokens for it in items], np.int32),
                                          **arrays(items)})
        return [d.tolist() for d in schema.split_rows(out["DRAFTS"], out["DRAFT_LENGTHS"])]

    def open(self, sids: list[int]) -> None:
        """Create empty state for ``sids`` (replacing any). Raises :class:`StageError`."""
        self.t(self.spec, "open", {"SIDS": schema.sids_to_wire(sids)})

    def close(self, sids: list[int]) -> None:
        """Drop state (best effort: a failure goes to ``on_error``, never raised)."""
        try:
            self.t(self.spec, "close", {"SIDS": schema.sids_to_wire(sids)})
        except Exception as e:  # noqa: BLE001 - cleanup must not take the worker down
            if self.on_error is not None:
                self.on_error(f"{self.spec.name} close {sids}: {e}")


class TrunkProxy(_Proxy):
    """:class:`~tandem.engine.protocols.TrunkAPI` over a transport (``vocab_size`` lets the
    scheduler reject out-of-vocabulary prompts before any call). Raises :class:`StageError`."""

    def __init__(self, transport: Transport, vocab_size: int | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(transport, schema.TRUNK, on_error)
        self.vocab_size = vocab_size

    def _rows(self, op: str, items: list[Rows]) -> list[VerifyOut]:
        if not items:
            return []
        lens = [len(it.tokens) for it in items]
        out = self.t(self.spec, op, {"SIDS": schema.sids_to_wire([it.sid for it in items]),
                                     "TOKENS": np.array([x for it in items for x in it.tokens], np.int64),
                                     "LENGTHS": np.array(lens, np.int32)})
        cols = [schema.split_rows(torch.from_numpy(np.ascontiguousarray(out[n])), lens) for n in schema.TRUNK.output_names]
        return [VerifyOut(a.long(), h.float(), g.float(), f.float()) for a, h, g, f in zip(*cols)]

    def prime(self, items: list[Rows]) -> list[VerifyOut]:
        return self._rows("prime", items)

    def verify(self, items: list[Rows]) -> list[VerifyOut]:
        return self._rows("verify", items)

    def commit(self, items: list[Commit]) -> None:
        if items:
            self.t(self.spec, "commit", {"SIDS": schema.sids_to_wire([it.sid for it in items]),
                                         "N_ROWS": np.array([it.n_rows for it in items], np.int32)})


class DrafterProxy(_Proxy):
    """:class:`~tandem.engine.protocols.DrafterAPI` over a transport. Raises :class:`StageError`."""

    def __init__(self, transport: Transport, on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(transport, schema.DRAFTER_MTP, on_error)

    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        return self._drafts(items, lambda its: {
            "HIDDEN": _rows_of(its, "hidden"),
            "NEXT_TOKENS": np.array([t for it in its for t in it.next_tokens], np.int64),
            "LENGTHS": np.array([len(it.next_tokens) for it in its], np.int32)})


class DFlashProxy(_Proxy):
    """:class:`~tandem.engine.protocols.DrafterAPI` for the DFlash arms over a transport (model
    ``drafter_dflash``): each row's target-layer features and each sequence's anchor go out, the
    drafts come back. Raises :class:`StageError`."""

    def __init__(self, transport: Transport, on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(transport, schema.DRAFTER_DFLASH, on_error)

    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        return self._drafts(items, lambda its: {
            "FEATURES": _rows_of(its, "features"),
            "LENGTHS": np.array([len(it.next_tokens) for it in its], np.int32),
            "ANCHORS": np.array([it.next_tokens[-1] for it in its], np.int64),
            schema.SPEC: np.array([it.arm.encode() for it in its], dtype=np.object_)})


# -- the worker ---------------------------------------------------------------------------------------
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
        self.q: queue.Queue[Turn] = queue.Queue()
        self.poll_s = poll_s
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
                             num_draft_tokens=req.num_draft_tokens)
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
            try:
                if new:
                    self.sched.admit(new)
                if self.sched.active():
                    self.sched.burst()
            except Exception as e:  # noqa: BLE001 - fail the in-flight turns, keep serving
                self.log(f"worker: {type(e).__name__}: {e}")
                for sid in list(self.sched.turns):
                    self.sched.cancel(sid, f"internal error: {type(e).__name__}: {e}")
            if time.monotonic() - last_expire > 1.0:
                self.sched.expire_idle()
                last_expire = time.monotonic()

    def stop(self) -> None:
        """Stop the worker and fail the turns in flight (no stage calls: at shutdown the stage models
        may be gone already, and their state dies with them)."""
        self._stop.set()
        self._thread.join(timeout=10)
        for t in list(self.sched.turns.values()):
            t.emit(None, "server shutting down", True)
        self.sched.turns.clear()
