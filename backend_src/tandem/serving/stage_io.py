"""A stage model's ``execute`` (``drafter_mtp``, ``drafter_dflash``, ``preprocessing``, ``postprocessing``):
each request's tensors to its stage's ``handle`` and back as one response."""

from __future__ import annotations

import time

from .. import internal_key, schema
from .telemetry import CallStats
from .metrics import Gauges


def tensors_by_name(tensors, names) -> dict:
    """The arrays of the ``tensors`` (a request's ``inputs()`` or a response's ``output_tensors()``:
    objects with ``name()`` and ``as_numpy()``) whose names are in ``names``, in the order of
    ``names``; absent names are left out. One pass over the tensors: ``pb_utils``'
    ``get_input_tensor_by_name`` rebuilds the request's tensor list and scans it for every name (the
    trunk's schema has ~20 inputs, a ``draft_verify`` sends ~11)."""
    by = {t.name(): t for t in tensors}
    return {n: by[n].as_numpy() for n in names if n in by}


def stage_execute(
    pb_utils,
    wire: schema.ModelWire,
    stage,
    requests,
    gauges: Gauges | None = None,
    unavailable: str | None = None,
    with_sequence: bool = False,
    on_cancelled=None,
    stats: CallStats | None = None,
) -> list:
    """The ``execute`` of a stage model: one :func:`stage_response` per request, in order. Afterwards
    the ``stage_sequences`` gauge is set to ``len(stage.states)``."""
    responses = [
        stage_response(pb_utils, wire, stage, r, unavailable, with_sequence, on_cancelled, stats) for r in requests
    ]
    if gauges is not None and stage is not None:
        gauges.set({"stage_sequences": len(stage.states)})
    return responses


def stage_response(
    pb_utils,
    wire: schema.ModelWire,
    stage,
    r,
    unavailable: str | None = None,
    with_sequence: bool = False,
    on_cancelled=None,
    stats: CallStats | None = None,
    only_requested: bool = False,
):
    """One request of a stage model: its tensors -> ``stage.handle`` -> its response. A
    :class:`~tandem.schema.WireError` answers with its text (naming the field), anything else with
    ``internal error: ...``; ``unavailable`` (a reason) answers with it; ``with_sequence`` passes the
    request's correlation id and flags to ``handle`` too; ``on_cancelled(arrays)`` is called first for
    a request its client cancelled, which is then answered as usual (an ensemble step answered with an
    error when its ensemble request was cancelled leaves that ensemble request in flight in Triton
    2.51 for good: the server's exit then times out, measured). ``stats`` gets the seconds inside
    ``handle`` as ``<model>.<OP>`` (the bench subtracts them from ``tandem``'s BLS round trips).
    A model whose inputs include ``AUTH`` (the stage models) refuses a request without this server's key
    (:func:`tandem.internal_key.check`) before anything else.
    ``only_requested`` (a decoupled model's response, sent by ``ResponseSender.send``): leave out the
    outputs the caller did not request, since ``send`` would drop them itself, freeing their arrays
    without the GIL in Triton 2.51's Python backend (python_backend #390, fixed after 2.51)."""
    try:
        if unavailable is not None:
            raise schema.WireError(unavailable)
        arrays = tensors_by_name(r.inputs(), wire.input_names)
        if internal_key.AUTH in wire.input_names:  # an internal model: tandem's own calls only, checked first
            internal_key.check(arrays, wire.name, internal_key.server_key())
            del arrays[internal_key.AUTH]
        if on_cancelled is not None and r.is_cancelled():
            on_cancelled(arrays)
        t0 = time.perf_counter()
        out = stage.handle(arrays, r.correlation_id(), r.flags()) if with_sequence else stage.handle(arrays)
        if stats is not None:
            stats.add(f"{wire.name}.{schema.get_op(arrays, wire)}", time.perf_counter() - t0)
        if only_requested:
            out = requested_only(out, r.requested_output_names())
        return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()])
    except Exception as e:  # noqa: BLE001 - a wire error names its field; anything else is reported
        msg = (
            str(e)
            if isinstance(e, (schema.WireError, internal_key.Unauthorized))
            else f"internal error: {type(e).__name__}: {e}"
        )
        return pb_utils.InferenceResponse([], error=pb_utils.TritonError(msg))


def requested_only(arrays: dict, requested) -> dict:
    """``arrays`` restricted to the ``requested`` output names (none requested: all, as Triton reads it)."""
    names = set(requested)
    return {k: v for k, v in arrays.items() if k in names} if names else arrays
