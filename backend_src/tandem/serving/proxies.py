"""The drafter proxies of the engine core (``colocate`` off): transports (BLS inside Triton, local in
tests) and the :class:`~tandem.engine.protocols.DrafterAPI` implementations that reach the ``drafter_mtp``
and ``drafter_dflash`` models, one call per batched op.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol

import numpy as np

from .. import schema
from ..engine.protocols import DraftRequest
from ..schema import Arrays, WireError
from .. import internal_key
from .stage_io import tensors_by_name
from .telemetry import CallStats


# -- transports ---------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A stage call failed; ``model`` and ``op`` say which, the message carries the remote error.
    ``dead``: the stage's process is gone (the Python backend answers "Stub process ... is not
    healthy" about a second after it died); ``timed_out``: it did not answer within the deadline."""

    def __init__(self, model: str, op: str, message: str, timed_out: bool = False) -> None:
        super().__init__(f"{model}.{op}: {message}")
        self.model, self.op = model, op
        self.dead = "is not healthy" in message
        self.timed_out = timed_out


class WatchedTransport:
    """A :class:`Transport` whose calls a watchdog can time out: :meth:`overdue` says which call has
    run past ``timeout_s`` seconds (the watchdog then fails the turns waiting on it) and marks it, and
    when that call returns at last it raises :class:`StageError` (``timed_out``) instead of returning.
    A call that never returns keeps its thread; the watchdog answers everything else meanwhile."""

    def __init__(self, inner: Transport, timeout_s: float) -> None:
        self.inner, self.timeout_s = inner, timeout_s
        self.stats = getattr(inner, "stats", None)
        #: the calls running, by thread:
        #: [model, op, monotonic start, fired]
        self._calls: dict[int, list] = {}

    def __call__(self, model: schema.ModelWire, op: str, arrays: Arrays) -> Arrays:
        key = threading.get_ident()
        self._calls[key] = call = [model.name, op, time.monotonic(), False]
        try:
            out = self.inner(model, op, arrays)
        finally:
            self._calls.pop(key, None)
        if call[3]:
            raise StageError(
                model.name, op, f"did not answer within {self.timeout_s:g} s (stage_timeout_s)", timed_out=True
            )
        return out

    def overdue(self, now: float | None = None) -> StageError | None:
        """A running call's error once it has run past the deadline (first time only), else None."""
        now = time.monotonic() if now is None else now
        for call in list(self._calls.values()):
            if not call[3] and now - call[2] > self.timeout_s:
                call[3] = True
                return StageError(
                    call[0], call[1], f"did not answer within {self.timeout_s:g} s (stage_timeout_s)", timed_out=True
                )
        return None

    @property
    def stalled(self) -> str | None:
        """The model whose overdue call has not returned yet (None when none)."""
        return next((c[0] for c in list(self._calls.values()) if c[3]), None)


class Transport(Protocol):
    """``transport(model, op, arrays) -> outputs``: one call of a stage model. Raises :class:`StageError`."""

    def __call__(self, model: schema.ModelWire, op: str, arrays: Arrays) -> Arrays: ...


class LocalTransport:
    """Calls stages' wire form (``handle``) in this process, copying arrays both ways as a server
    would. ``stages``: model name -> stage. Wire errors become :class:`StageError`."""

    def __init__(self, stages: dict[str, Any]) -> None:
        self.stages = stages
        self.stats = CallStats()
        self._lock = threading.Lock()  # one call at a time

    def __call__(self, model: schema.ModelWire, op: str, arrays: Arrays) -> Arrays:
        with self._lock:
            return self._call(model, op, arrays)

    def _call(self, model: schema.ModelWire, op: str, arrays: Arrays) -> Arrays:
        t0 = time.perf_counter()
        try:
            out = self.stages[model.name].handle(
                {"OP": schema.string_array(op), **{k: np.array(v, copy=True) for k, v in arrays.items()}}
            )
        except WireError as e:
            raise StageError(model.name, op, str(e)) from None
        finally:
            self.stats.add(f"{model.name}.{op}", time.perf_counter() - t0)
        return {k: np.array(out[k], copy=True) for k in model.output_names}


class BLSTransport:
    """One ``pb_utils.InferenceRequest(...).exec()`` per call, from any thread of the engine core.
    ``pb_utils``: the ``triton_python_backend_utils`` module, passed in. Raises :class:`StageError`."""

    def __init__(self, pb_utils, timeout_us: int = 0) -> None:
        self.pb = pb_utils
        self.timeout_us = timeout_us
        self.auth = internal_key.key_array(internal_key.server_key())  # every stage call carries the server's key
        self.stats = CallStats()

    def __call__(self, model: schema.ModelWire, op: str, arrays: Arrays) -> Arrays:
        t0 = time.perf_counter()
        resp = self._request(model, op, arrays).exec()
        self.stats.add(f"{model.name}.{op}", time.perf_counter() - t0)
        if resp is None:
            raise StageError(model.name, op, "the call ended without a response")
        if resp.has_error():
            raise StageError(model.name, op, resp.error().message())
        got = tensors_by_name(resp.output_tensors(), model.output_names)
        if (missing := next((n for n in model.output_names if n not in got), None)) is not None:
            raise StageError(model.name, op, f"response lacks output {missing}")
        return {k: np.array(v, copy=True) for k, v in got.items()}  # own the bytes: the response's buffer dies with it

    def _request(self, model: schema.ModelWire, op: str, arrays: Arrays):
        pb = self.pb
        tensors = [pb.Tensor("OP", schema.string_array(op)), pb.Tensor(internal_key.AUTH, self.auth)]
        tensors += [pb.Tensor(k, np.ascontiguousarray(v)) for k, v in arrays.items()]
        kw = {"timeout": self.timeout_us} if self.timeout_us else {}
        return pb.InferenceRequest(
            model_name=model.name, inputs=tensors, requested_output_names=list(model.output_names), **kw
        )


# -- stage proxies ------------------------------------------------------------------------------------
def _rows_of(items: list[DraftRequest], field: str) -> np.ndarray:
    """The items' per-row tensors ``field`` (``hidden`` or ``features``) stacked ``[sum n, width]`` fp32."""
    return np.ascontiguousarray(
        np.concatenate([getattr(it, field).detach().float().reshape(len(it.next_tokens), -1).numpy() for it in items]),
        dtype=np.float32,
    )


class _Proxy:
    def __init__(self, transport: Transport, wire: schema.ModelWire, on_error: Callable[[str], None] | None) -> None:
        self.t, self.wire, self.on_error = transport, wire, on_error
        #: the model this proxy's calls reach
        self.model_name = getattr(transport, "model_name", None) or wire.name

    def _drafts(self, items: list[DraftRequest], arrays) -> list[list[int]]:
        """One ``draft`` call: ``arrays(items)`` packs the model-specific inputs; SIDS and
        NUM_DRAFT_TOKENS are added here. Returns the drafts per item."""
        if not items:
            return []
        out = self.t(
            self.wire,
            "draft",
            {
                "SIDS": schema.sids_to_wire([it.sid for it in items]),
                schema.NUM_DRAFT_TOKENS: np.array([it.num_draft_tokens for it in items], np.int32),
                **arrays(items),
            },
        )
        return [d.tolist() for d in schema.split_rows(out["DRAFTS"], out["DRAFT_LENGTHS"])]

    def open(self, sids: list[int]) -> None:
        """Create empty state for ``sids`` (replacing any). Raises :class:`StageError`."""
        self.t(self.wire, "open", {"SIDS": schema.sids_to_wire(sids)})

    def probe(self) -> None:
        """A no-op call (``close`` of no sequence) that raises :class:`StageError` when the stage's
        process is dead or does not answer (health checks)."""
        self.t(self.wire, "close", {"SIDS": np.zeros(0, np.int64)})

    def close(self, sids: list[int]) -> None:
        """Drop state (best effort: a failure goes to ``on_error``, never raised)."""
        try:
            self.t(self.wire, "close", {"SIDS": schema.sids_to_wire(sids)})
        except Exception as e:  # noqa: BLE001 - cleanup must not take the worker down
            if self.on_error is not None:
                self.on_error(f"{self.wire.name} close {sids}: {e}")


class _PrefixStoreProxy(_Proxy):
    """The prefix-store ops of the ``drafter_dflash`` model."""

    def publish(self, items: list[tuple[int, list[int]]]) -> list[int]:
        """One ``publish`` call: ``(sid, chain keys)`` per sequence -> bytes newly stored per sequence."""
        if not items:
            return []
        out = self.t(
            self.wire,
            "publish",
            {"SIDS": schema.sids_to_wire([s for s, _ in items]), **schema.prefixes_to_wire([k for _, k in items])},
        )
        return [int(x) for x in out["NBYTES"]]

    def evict(self, keys: list[int]) -> None:
        """One ``evict`` call (keys in one PREFIX_LENGTHS entry, no SIDS)."""
        if keys:
            self.t(self.wire, "evict", {"SIDS": np.zeros(0, np.int64), **schema.prefixes_to_wire([list(keys)])})


class DrafterProxy(_Proxy):
    """:class:`~tandem.engine.protocols.DrafterAPI` over a transport. Raises :class:`StageError`."""

    def __init__(self, transport: Transport, on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(transport, schema.DRAFTER_MTP, on_error)

    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        return self._drafts(
            items,
            lambda its: {
                "HIDDEN": _rows_of(its, "hidden"),
                "NEXT_TOKENS": np.array([t for it in its for t in it.next_tokens], np.int64),
                "LENGTHS": np.array([len(it.next_tokens) for it in its], np.int32),
            },
        )


class DFlashProxy(_PrefixStoreProxy):
    """:class:`~tandem.engine.protocols.DrafterAPI` for the DFlash specs over a transport (model
    ``drafter_dflash``): each row's target-layer features and each sequence's anchor go out, the
    drafts come back. Raises :class:`StageError`."""

    def __init__(self, transport: Transport, on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(transport, schema.DRAFTER_DFLASH, on_error)

    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        return self._drafts(
            items,
            lambda its: {
                "FEATURES": _rows_of(its, "features"),
                "LENGTHS": np.array([len(it.next_tokens) for it in its], np.int32),
                "ANCHORS": np.array([it.next_tokens[-1] for it in its], np.int64),
                schema.SPEC: np.array([it.spec.encode() for it in its], dtype=np.object_),
            },
        )

    def open(self, sids: list[int], prefixes: list[tuple[str, list[int]] | None] | None = None) -> None:
        """Fresh drafter state; sequences with a prefix ``(spec, keys)`` start from its published tails."""
        if not prefixes or not any(prefixes):
            return super().open(sids)
        self.t(
            self.wire,
            "open",
            {
                "SIDS": schema.sids_to_wire(sids),
                schema.SPEC: np.array(
                    [(p or next(filter(None, prefixes)))[0].encode() for p in prefixes], dtype=np.object_
                ),
                **schema.prefixes_to_wire([p[1] if p else None for p in prefixes]),
            },
        )
