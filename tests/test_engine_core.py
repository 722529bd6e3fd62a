"""The serving layer without Triton: the drafter models' wire form, their BLS proxies over an in-process
transport, request parsing, the engine core (worker thread), and the client's incremental decoder."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tandem import schema
from tandem.engine.mtp_stage import MTPStage
from tandem.engine.protocols import Commit, DraftRequest, Rows
from tandem.engine.scheduler import Scheduler, Turn
from tandem.engine.trunk_stage import TrunkStage
from tandem.serving import engine_core as fr
from tandem.serving import proxies
from tandem.serving import turns
from tandem_client.client import IncrementalDecoder

from conftest import make_tiny_trunk


@pytest.fixture(scope="module")
def model():
    return make_tiny_trunk()


def local(model):
    return proxies.LocalTransport({"drafter_mtp": MTPStage(model)})


def test_sid_wire_roundtrip():
    sids = [0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
    w = schema.sids_to_wire(sids)
    assert w.dtype == np.int64 and schema.sids_from_wire(w) == sids
    assert w.tolist()[-1] == -1
    with pytest.raises(OverflowError):
        schema.sids_to_wire([2**64])


def test_proxy_equals_stage(model):
    """draft through the drafter model's wire form gives the in-process stage's drafts; the trunk stage
    folds a round's commit into the next verify or prime."""
    tr = local(model)
    drafter, trunk = proxies.DrafterProxy(tr), TrunkStage(model)
    ref_d = MTPStage(model)
    items = [Rows(1, [5, 6, 7, 8, 9]), Rows(2**63 + 7, [10, 11])]
    for st in (trunk, drafter, ref_d):
        st.open([it.sid for it in items])
    ref = trunk.prime(items)
    d_items = [DraftRequest(it.sid, o.hidden, it.tokens[1:] + [int(o.argmax[-1])], 3) for it, o in zip(items, ref)]
    drafts = drafter.draft(d_items)
    assert drafts == ref_d.draft(d_items) and [len(d) for d in drafts] == [3, 3]
    trunk.verify([Rows(1, [3, 4, 5]), Rows(2**63 + 7, [6])])
    trunk.commit([Commit(1, 2), Commit(2**63 + 7, 1)])
    assert trunk.caches[1].pos == 7
    trunk.verify([Rows(1, [8, 9]), Rows(2**63 + 7, [4, 2])])
    trunk.verify([Rows(1, [1], commit=2), Rows(2**63 + 7, [3, 3], commit=1)])  # the commits folded in
    assert trunk.caches[1].pos == 9 and trunk.caches[2**63 + 7].pending_rows == 2
    trunk.prime([Rows(1, [4, 4], commit=1)])  # a new turn's prime carries the last commit too
    assert trunk.caches[1].pos == 12 and trunk.caches[1].pending is None
    trunk.close([1, 2**63 + 7])
    drafter.close([1, 2**63 + 7])
    assert not trunk.caches and not tr.stages["drafter_mtp"].states


def test_service_errors_name_the_field(model):
    tr = local(model)
    stage = tr.stages["drafter_mtp"]
    with pytest.raises(schema.WireError, match="OP must be one of"):
        stage.handle({"OP": schema.string_array("train"), "SIDS": np.array([9])})
    with pytest.raises(schema.WireError, match="SIDS: a sequence id appears twice"):
        stage.handle({"OP": schema.string_array("close"), "SIDS": np.array([9, 9])})
    drafter = proxies.DrafterProxy(tr)
    drafter.close([12345])  # closing an unknown sequence is a no-op
    with pytest.raises(proxies.StageError, match="SIDS: unknown sequence id 4"):
        drafter.draft([DraftRequest(4, torch.zeros(1, model.cfg.hidden_size), [1], 2)])
    drafter.open([4])
    with pytest.raises(proxies.StageError, match=r"NUM_DRAFT_TOKENS must be in \[0, 8\], got 9"):
        drafter.draft([DraftRequest(4, torch.zeros(1, model.cfg.hidden_size), [1], 9)])
    with pytest.raises(proxies.StageError, match="LENGTHS sum to 3 but NEXT_TOKENS has 1 rows"):
        tr(
            schema.DRAFTER_MTP,
            "draft",
            {
                "SIDS": schema.sids_to_wire([4]),
                "HIDDEN": np.zeros((1, model.cfg.hidden_size), np.float32),
                "NEXT_TOKENS": np.array([1], np.int64),
                "LENGTHS": np.array([3], np.int32),
                "NUM_DRAFT_TOKENS": np.array([2], np.int32),
            },
        )


def test_parse_turn():
    t = turns.parse_turn(
        {
            "INPUT_IDS": np.array([1, 2], np.int32),
            "MAX_TOKENS": np.array([5], np.int32),
            "SPEC": np.array([b"OFF"], object),
        },
        2**63 - 2,
        schema.FLAG_START,
    )
    assert (t.sid, t.tokens, t.max_tokens, t.spec, t.start, t.end, t.num_draft_tokens, t.stream, t.stop) == (
        2**63 - 2,
        [1, 2],
        5,
        "off",
        True,
        False,
        None,
        True,
        (),
    )
    t = turns.parse_turn(
        {"MAX_TOKENS": np.array([1]), "NUM_DRAFT_TOKENS": np.array([2]), "STOP_TOKEN_IDS": np.array([7, 9], np.int32)},
        7,
        schema.FLAG_START | schema.FLAG_END,
    )
    assert (t.tokens, t.spec, t.num_draft_tokens, t.start, t.end, t.stop_token_ids) == ([], None, 2, True, True, (7, 9))
    assert (
        turns.parse_turn({"MAX_TOKENS": np.array([1])}, 7, 0).start,
        turns.parse_turn({"MAX_TOKENS": np.array([1])}, 7, schema.FLAG_END).end,
    ) == (False, True)
    # no sequence id (HTTP generate): a one-turn session of its own, ids from 2**63 up with 63 random bits (a
    # CANCEL names the id, so one turn's id must not tell another's)
    a, b = (
        turns.parse_turn(
            {
                "MAX_TOKENS": np.array([1]),
                "STREAM": np.array([False]),
                "STOP": np.array([b"\n\n", "é".encode()], object),
            },
            0,
            0,
        )
        for _ in range(2)
    )
    assert (
        a.sid >= 2**63 and b.sid >= 2**63 and (a.start, a.end, a.stream, a.stop) == (True, True, False, ("\n\n", "é"))
    )
    ids = [turns.parse_turn({"MAX_TOKENS": np.array([1])}, 0, 0).sid - 2**63 for _ in range(200)]
    assert len(set(ids)) == 200 and max(abs(x - y) for x, y in zip(ids, ids[1:])) > 2**40
    assert 0.4 < np.mean([bin(x).count("1") / 63 for x in ids]) < 0.6  # the low 63 bits are random
    for inputs, corr, msg in [
        ({"MAX_TOKENS": np.array([1])}, 2**63, r"sequence_id must be below 2\*\*63 .*one-turn"),
        (
            {"MAX_TOKENS": np.array([1])},
            "chat-1",
            "sequence_id: sequence ids are unsigned integers, got the string 'chat-1'",
        ),
        ({"MAX_TOKENS": np.array([1]), "STOP": np.array([[b"a"]], object)}, 1, "STOP must be 1-D"),
        ({"MAX_TOKENS": np.array([1]), "STOP": np.array([b"\xff"], object)}, 1, "STOP must be UTF-8"),
        ({}, 1, "MAX_TOKENS is required"),
        ({"MAX_TOKENS": np.array([1]), "INPUT_IDS": np.zeros((2, 2))}, 1, "INPUT_IDS must be 1-D"),
        ({"MAX_TOKENS": np.array([1]), "STOP_TOKEN_IDS": np.zeros((1, 2))}, 1, "STOP_TOKEN_IDS must be 1-D"),
        (
            {"MAX_TOKENS": np.array([1]), "NUM_DRAFT_TOKENS": np.array([1, 2])},
            1,
            "NUM_DRAFT_TOKENS must hold exactly 1 value",
        ),
        # sizes are refused before anything is decoded, naming the field and the limit
        (
            {"MAX_TOKENS": np.array([1]), "INPUT_IDS": np.zeros(4097, np.int32)},
            1,
            "INPUT_IDS has 4097 elements, over the limit of 4096",
        ),
        (
            {"MAX_TOKENS": np.array([1]), "STOP": np.array([b"a"] * 9, object)},
            1,
            "STOP has 9 elements, over the limit of 8",
        ),
        (
            {"MAX_TOKENS": np.array([1]), "STOP": np.array([b"a" * 257], object)},
            1,
            "STOP: a string of 257 bytes is over the limit of 256 bytes",
        ),
        (
            {"MAX_TOKENS": np.array([1]), "SPEC": np.array([b"x" * 10**6], object)},
            1,
            "SPEC: a string of 1000000 bytes is over the limit of 256 bytes",
        ),
        (
            {"MAX_TOKENS": np.array([1]), "STOP_TOKEN_IDS": np.zeros(17, np.int32)},
            1,
            "STOP_TOKEN_IDS has 17 elements, over the limit of 16",
        ),
    ]:
        with pytest.raises(schema.WireError, match=msg):
            turns.parse_turn(inputs, corr, schema.FLAG_START | schema.FLAG_END)
    with pytest.raises(
        schema.WireError, match="INPUT_IDS has 65 elements, over the limit of 64"
    ):  # the server's max_ctx
        turns.parse_turn({"MAX_TOKENS": np.array([1]), "INPUT_IDS": np.zeros(65, np.int32)}, 1, 0, max_ctx=64)


def _run(front, req):
    done, out = threading.Event(), {"ids": [], "rounds": 0, "drafted": 0, "accepted": 0, "bursts": 0, "err": None}

    def send(arrays, err, final):
        if err is not None:
            out["err"] = err
        else:
            out["ids"] += arrays["OUTPUT_IDS"].tolist()
            for k in ("rounds", "drafted", "accepted"):
                out[k] += int(arrays[k.upper()][0])
            out["bursts"] += 1
            out["finish"] = arrays[schema.FINISH_REASON][0].decode()
        if final:
            done.set()

    front.submit(req, send)
    assert done.wait(60)
    return out


def test_front_over_proxies_equals_in_process(model):
    """The engine core with its drafter over a BLS-shaped proxy streams what the in-process scheduler produces."""
    tr = local(model)
    cfg = schema.ServingConfig(max_ctx=64)
    core_trunk = TrunkStage(model)
    front = fr.EngineCore(core_trunk, {"mtp": proxies.DrafterProxy(tr)}, stop_ids=(), config=cfg)
    try:
        ref_s = Scheduler(TrunkStage(model), {"mtp": MTPStage(model)}, cfg)
        for spec in ("mtp", "off"):
            ref = {"ids": [], "rounds": 0}

            def emit(r, err, final, ref=ref):
                assert err is None
                ref["ids"] += r.tokens
                ref["rounds"] += r.rounds

            ref_s.admit([Turn(5, [1, 2, 3, 4], 12, emit, spec=spec)])
            while 5 in ref_s.turns:
                ref_s.burst()
            got = _run(front, turns.TurnRequest(2**64 - 5, [1, 2, 3, 4], 12, spec))
            assert got["err"] is None and got["ids"] == ref["ids"] and got["rounds"] == ref["rounds"]
            assert got["finish"] == "length" and got["bursts"] >= 2
        bad = _run(front, turns.TurnRequest(6, [1] * 70, 4))
        assert bad["err"].startswith("INPUT_IDS: 0 context + 70 new tokens") and "64" in bad["err"]
        lost = _run(front, turns.TurnRequest(7, [1], 4, start=False))["err"]
        assert lost.startswith(
            "sequence_id: unknown sequence id 7: this server holds no such session (set "
            "sequence_start on the first turn; behind a proxy, send the x-tandem-session header"
        )
        assert lost.endswith(" [tandem: session lost]")
        assert not front.sched.sessions and not core_trunk.caches and not tr.stages["drafter_mtp"].states
    finally:
        front.stop()


def test_front_survives_a_broken_client(model):
    tr = local(model)
    front = fr.EngineCore(
        TrunkStage(model),
        {"mtp": proxies.DrafterProxy(tr)},
        stop_ids=(),
        config=schema.ServingConfig(max_ctx=64, burst_rounds=1),
    )
    logs = []
    front.log = logs.append
    try:

        def broken(arrays, err, final):
            raise ConnectionError("client gone")

        front.submit(turns.TurnRequest(1, [1, 2], 30), broken)
        ok = _run(front, turns.TurnRequest(2, [1, 2], 6))
        assert ok["err"] is None and len(ok["ids"]) == 6
        for _ in range(200):
            if 1 not in front.sched.sessions:
                break
            threading.Event().wait(0.01)
        assert 1 not in front.sched.sessions and any("client gone" in m for m in logs)
    finally:
        front.stop()


def test_incremental_decoder_keeps_multibyte_whole():
    dec = IncrementalDecoder(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    b = "héllo €".encode()
    pieces = [dec.push([x]) for x in b]
    assert "".join(pieces) + dec.flush() == "héllo €"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"


def test_client_never_sends_a_wrapped_int32():
    from tandem_client.client import TandemClientError, generate

    with pytest.raises(TandemClientError, match=r"MAX_TOKENS must fit in an int32 .* got 4294967301"):
        generate([1, 2], max_tokens=2**32 + 5, url="127.0.0.1:1")
    with pytest.raises(TandemClientError, match=r"NUM_DRAFT_TOKENS must fit in an int32"):
        generate([1, 2], max_tokens=4, num_draft_tokens=2**32 + 1, url="127.0.0.1:1")


class _Exiting:
    """A transport whose stage calls start failing as Triton's do once the server exits."""

    def __init__(self, inner, ops) -> None:
        self.inner, self.ops, self.exiting = inner, ops, False

    def __call__(self, model, op, arrays):
        if self.exiting and op in self.ops:
            raise proxies.StageError(model.name, op, "Server not ready")
        return self.inner(model, op, arrays)


def test_shutdown_ends_turns_with_one_clear_error(model):
    """The model stopping (``finalize``) ends a streaming turn with one final "server shutting down", not an
    internal error. (A drafter model that answers "Server not ready" meanwhile only moves its sessions to
    plain decoding, as any drafter failure does.)"""
    tr = _Exiting(local(model), {"draft"})
    front = fr.EngineCore(
        TrunkStage(model, 256),
        {"mtp": proxies.DrafterProxy(tr)},
        stop_ids=(),
        config=schema.ServingConfig(max_ctx=256, burst_rounds=1),
    )
    got: list = []
    started = threading.Event()

    def send(arrays, err, final):
        got.append((err, final))
        started.set()

    try:
        front.submit(turns.TurnRequest(1, [1, 2], 200, "mtp"), send)
        assert started.wait(30)
        tr.exiting = True
        front.stop()
        assert got[-1] == (fr.SHUTTING_DOWN, True) and sum(f for _, f in got) == 1
    finally:
        front.stop()
