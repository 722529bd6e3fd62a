"""A hostile client against a real tritonserver: the internal models answer only tandem itself, a
CANCEL reaches only the turn whose id its sender holds, and oversize inputs are refused before any
work, naming the field and the limit, without delaying other requests."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from tandem import schema, schema_text  # noqa: E402
from tandem.launch.observe import tandem_metrics  # noqa: E402
from tandem_client.client import stage_infer  # noqa: E402

from conftest import long_turn_prompt, settled  # noqa: E402

pytestmark = pytest.mark.integration

STAGES = ("drafter_mtp", "drafter_dflash")
#: every op of every internal model, with inputs that would act if they were let through
_I64, _I32 = (lambda *v: np.array(v, np.int64)), (lambda *v: np.array(v, np.int32))


def _tensors(arrays: dict) -> list:
    import tritonclient.grpc as grpcclient

    out = []
    for name, a in arrays.items():
        a = np.asarray(a)
        dt = (
            "BYTES"
            if a.dtype == object
            else {"int64": "INT64", "int32": "INT32", "float32": "FP32", "bool": "BOOL"}[str(a.dtype)]
        )
        x = grpcclient.InferInput(name, list(a.shape), dt)
        x.set_data_from_numpy(a)
        out.append(x)
    return out


def _op(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=object)


def _stage_call(server, model: str, arrays: dict, timeout_s: float = 10.0):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return stage_infer(c, schema.MODELS[model], _tensors(arrays), timeout_s)
    finally:
        c.close()


class Turn:
    """One ``tandem`` turn on a gRPC stream of its own; ``tokens()`` waits for the final response."""

    def __init__(self, server, ids, max_tokens: int, sequence_id: int = 0, spec: str = "off") -> None:
        import tritonclient.grpc as grpcclient

        self.c = grpcclient.InferenceServerClient(server.grpc_url)
        self.q: queue.Queue = queue.Queue()
        self.c.start_stream(callback=lambda result, error: self.q.put((result, error)))
        ins = _tensors(
            {schema.INPUT_IDS: np.array(ids, np.int32), schema.MAX_TOKENS: _I32(max_tokens), schema.SPEC: _op(spec)}
        )
        kw = dict(sequence_id=sequence_id, sequence_start=True, sequence_end=True) if sequence_id else {}
        self.t0 = time.monotonic()
        self.c.async_stream_infer(schema.TANDEM.name, ins, **kw)
        self.got: list[int] = []
        self.session_id: int | None = None
        self.finish = ""

    def next(self, timeout_s: float = 60.0) -> bool:
        """Take one response; False once the turn is over."""
        r, e = self.q.get(timeout=timeout_s)
        assert e is None, e
        self.got += r.as_numpy(schema.OUTPUT_IDS).tolist()
        self.session_id = schema.sids_from_wire(r.as_numpy(schema.SESSION_ID))[0]
        self.finish = r.as_numpy(schema.FINISH_REASON)[0].decode()
        return not self.finish

    def tokens(self, timeout_s: float = 60.0) -> list[int]:
        while self.next(timeout_s):
            pass
        self.c.stop_stream()
        self.c.close()
        return self.got


def _cancel_requests(sids: list[int]):
    """CANCEL requests naming ``sids``, as raw protobuf: Triton reads the sequence id from ``int64_param``
    as the same 64 bits, so a one-turn id (2**63 and up) travels as a negative number."""
    from tritonclient.grpc import service_pb2

    for sid in sids:
        r = service_pb2.ModelInferRequest(model_name=schema.TANDEM.name)
        r.parameters["sequence_id"].int64_param = int(schema.sids_to_wire([sid])[0])
        for name, dt, raw in ((schema.CANCEL, "BOOL", b"\x01"), (schema.MAX_TOKENS, "INT32", _I32(1).tobytes())):
            r.inputs.add(name=name, datatype=dt, shape=[1])
            r.raw_input_contents.append(raw)
        yield r


def _cancel_all(server, sids: list[int]) -> list[str]:
    """Send a CANCEL for each of ``sids`` on one gRPC stream; the error messages of the answers."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(server.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        answers = list(stub.ModelStreamInfer(_cancel_requests(sids), timeout=60))
    assert len(answers) == len(sids)
    return [a.error_message for a in answers if a.error_message]


def _stage_sequences(server) -> dict[str, float]:
    m = tandem_metrics(server.metrics_port)
    return {s: m.get(s, {}).get("stage_sequences", 0.0) for s in STAGES}


def _outside_calls(victim: int) -> list[tuple[str, dict]]:
    """Requests an outside client could send to the internal models: each op, naming the victim's
    sequence and 300 guessed ids, or prefix keys."""
    sids = np.array([victim] + list(range(1, 300)), np.uint64).view(np.int64)
    keys = {"PREFIX_KEYS": _I64(1, 2, 3), "PREFIX_LENGTHS": _I32(3)}
    return [
        ("drafter_mtp", {"OP": _op("close"), "SIDS": sids}),
        (
            "drafter_mtp",
            {
                "OP": _op("draft"),
                "SIDS": sids[:1],
                "HIDDEN": np.zeros((1, 8), np.float32),
                "NEXT_TOKENS": _I64(1),
                "LENGTHS": _I32(1),
                "NUM_DRAFT_TOKENS": _I32(2),
            },
        ),
        ("drafter_dflash", {"OP": _op("open"), "SIDS": _I64(*range(10**6, 10**6 + 300))}),
        ("drafter_dflash", {"OP": _op("evict"), "SIDS": _I64(), **keys}),
        ("drafter_dflash", {"OP": _op("draft"), "SIDS": sids[:1], "ANCHORS": _I64(1), "NUM_DRAFT_TOKENS": _I32(2)}),
    ]


def test_internal_models_refuse_outside_requests(drafter_server):
    """Every op of every internal model (the drafter models, loaded with ``colocate`` off), sent by an outside
    client (no key, or a wrong one), is refused before it changes anything: the stages hold the same sequences,
    and turns streaming meanwhile give exactly the tokens they give alone. With the server's key the same ops
    are answered."""
    from tritonclient.utils import InferenceServerException

    server = drafter_server
    ids, victim = list(long_turn_prompt(160)), (1 << 40) + 12345
    alone = {spec: Turn(server, ids, 160, spec=spec).tokens() for spec in ("mtp", "dflash2")}
    before = settled(lambda: _stage_sequences(server))  # (the turns above: their sequences closed)
    turns = {spec: Turn(server, ids, 160, sequence_id=victim + i, spec=spec) for i, spec in enumerate(alone)}
    for t in turns.values():
        assert t.next()  # streaming: its sequence is open in its drafter model
    for model, arrays in _outside_calls(victim):
        for auth in (None, b"0" * 64):
            sent = dict(arrays, **({} if auth is None else {"AUTH": np.array([auth], dtype=object)}))
            with pytest.raises(InferenceServerException, match=f"model '{model}' is internal"):
                _stage_call(server, model, sent)
    assert {spec: t.tokens() for spec, t in turns.items()} == alone
    assert settled(lambda: _stage_sequences(server)) == before  # nothing opened or left open by the calls
    # the same kind of call with the key is let through (and answered by the stage itself)
    key = np.array([server.internal_key], dtype=object)
    with pytest.raises(InferenceServerException, match="SIDS: unknown sequence id 424242"):
        _stage_call(
            server,
            "drafter_mtp",
            {
                "OP": _op("draft"),
                "SIDS": _I64(424242),
                "HIDDEN": np.zeros((1, 8), np.float32),
                "NEXT_TOKENS": _I64(1),
                "LENGTHS": _I32(1),
                "NUM_DRAFT_TOKENS": _I32(2),
                "AUTH": key,
            },
        )


def test_cancels_reach_only_the_turn_whose_id_they_hold(server):
    """One-turn sessions get 63 random bits: 1,000 CANCELs over the ids around an attacker's own
    one-turn id leave a running one-turn stream untouched; its owner's CANCEL (the SESSION_ID its own
    responses carry) ends it within 1 s."""
    ids = list(long_turn_prompt(400))
    alone = Turn(server, ids, 160).tokens()
    probe = Turn(server, ids, 1)
    probe.tokens()
    victim = Turn(server, ids, 160)  # sent right after the probe: a counter would give it probe's id + 1
    assert victim.next()
    assert victim.session_id >= schema.ONE_TURN_SEQUENCE_IDS and probe.session_id >= schema.ONE_TURN_SEQUENCE_IDS
    near = [probe.session_id + d for d in range(-500, 501) if d and probe.session_id + d < 1 << 64]
    assert _cancel_all(server, near[:1000]) == []  # each CANCEL is answered (an empty final response)
    assert victim.tokens() == alone and victim.finish == "length"

    owner = Turn(server, ids, 3000)
    assert owner.next()
    t0 = time.monotonic()
    assert _cancel_all(server, [owner.session_id]) == []
    owner.tokens()
    took = time.monotonic() - t0
    assert owner.finish == schema.CANCELLED and took < 1.0, (owner.finish, took)


def test_oversize_text_is_refused_at_once_and_delays_no_one(server):
    """A 12 MB text_input over gRPC to the ensemble is refused within 0.5 s, naming the field and the
    limit, before it is tokenized; a small request sent at the same time completes within 0.5 s."""
    import tritonclient.grpc as grpcclient

    def infer(text: bytes, out: dict) -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        q: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: q.put(error))
        ins = _tensors({schema_text.TEXT_INPUT: np.array([text], dtype=object), schema_text.MAX_TOKENS_IN: _I32(4)})
        t0 = time.monotonic()
        c.async_stream_infer(schema_text.ENSEMBLE.name, ins)
        error = q.get(timeout=30)  # the answer (stream false: the whole turn) or the refusal
        out["s"] = time.monotonic() - t0
        out["error"] = None if error is None else error.message()
        c.stop_stream()
        c.close()

    small: dict = {}
    infer(b"hi", small)  # warm: the ensemble's steps are loaded and answering
    big: dict = {}
    threads = [
        threading.Thread(target=infer, args=("字".encode() * 4_000_000, big)),
        threading.Thread(target=infer, args=(b"hi", small)),
    ]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    assert big["error"] and "text_input: 12000000 bytes is over the limit of" in big["error"], big
    assert big["s"] < 0.5 and small["error"] is None and small["s"] < 0.5, (big, small)


def test_oversize_tandem_inputs_are_refused_naming_the_field(server):
    """``tandem``'s own inputs: token ids beyond the context, and string fields beyond their byte limit,
    are refused before they are decoded, naming the field and the limit."""
    from tritonclient.utils import InferenceServerException
    import tritonclient.grpc as grpcclient

    cases = [
        ({schema.INPUT_IDS: np.ones(3_000_000, np.int32)}, "INPUT_IDS has 3000000 elements, over the limit of 4096"),
        ({schema.SPEC: np.array([b"x" * 5_000_000], object)}, "SPEC: a string of 5000000 bytes is over the limit"),
        ({schema.STOP: np.array([b"x"] * 100_000, object)}, "STOP has 100000 elements, over the limit of 8"),
    ]
    for arrays, msg in cases:
        q: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error: q.put(error))
        t0 = time.monotonic()
        c.async_stream_infer(schema.TANDEM.name, _tensors({schema.MAX_TOKENS: _I32(4), **arrays}))
        error = q.get(timeout=30)
        took = time.monotonic() - t0
        c.stop_stream()
        c.close()
        assert isinstance(error, InferenceServerException) and msg in error.message(), error
        assert took < 0.5, (msg, took)
