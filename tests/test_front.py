"""The serving layer without Triton: the stages' wire form, the BLS proxies over an in-process
transport, request parsing, the tandem front (worker thread), and the client's incremental decoder."""

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
from tandem.serving import front as fr
from tandem_client.client import IncrementalDecoder

from conftest import make_tiny_trunk


@pytest.fixture(scope="module")
def model():
    return make_tiny_trunk()


def local(model, max_ctx=None):
    return fr.LocalTransport({"trunk": TrunkStage(model, max_ctx), "drafter_mtp": MTPStage(model)})


def test_sid_wire_roundtrip():
    sids = [0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
    w = schema.sids_to_wire(sids)
    assert w.dtype == np.int64 and schema.sids_from_wire(w) == sids
    assert w.tolist()[-1] == -1
    with pytest.raises(OverflowError):
        schema.sids_to_wire([2**64])


def test_proxy_equals_stage(model):
    """prime / verify / commit / draft through the wire format give the in-process stages' results."""
    tr = local(model)
    trunk, drafter = fr.TrunkProxy(tr), fr.DrafterProxy(tr)
    ref_t, ref_d = TrunkStage(model), MTPStage(model)
    items = [Rows(1, [5, 6, 7, 8, 9]), Rows(2**63 + 7, [10, 11])]
    for st in (trunk, ref_t, drafter, ref_d):
        st.open([it.sid for it in items])
    got, ref = trunk.prime(items), ref_t.prime(items)
    for g, r in zip(got, ref):
        assert torch.equal(g.argmax, r.argmax) and torch.equal(g.hidden, r.hidden)
        assert torch.equal(g.top2_gap.isnan(), r.top2_gap.isnan())  # a prime's rows before its last: NaN
        assert torch.equal(g.top2_gap.nan_to_num(), r.top2_gap.nan_to_num())
    d_items = [DraftRequest(it.sid, o.hidden, it.tokens[1:] + [int(o.argmax[-1])], 3) for it, o in zip(items, ref)]
    drafts = drafter.draft(d_items)
    assert drafts == ref_d.draft(d_items) and [len(d) for d in drafts] == [3, 3]
    v = [Rows(1, [3, 4, 5]), Rows(2**63 + 7, [6])]
    for g, r in zip(trunk.verify(v), ref_t.verify(v)):
        assert torch.equal(g.argmax, r.argmax) and torch.equal(g.hidden, r.hidden)
    trunk.commit([Commit(1, 2), Commit(2**63 + 7, 1)])
    ref_t.commit([Commit(1, 2), Commit(2**63 + 7, 1)])
    assert tr.stages["trunk"].caches[1].pos == ref_t.caches[1].pos == 7
    v = [Rows(1, [8, 9]), Rows(2**63 + 7, [4, 2])]
    trunk.verify(v), ref_t.verify(v)
    v = [Rows(1, [1], commit=2), Rows(2**63 + 7, [3, 3], commit=1)]  # the commits folded into the next verify
    for g, r in zip(trunk.verify(v), ref_t.verify(v)):
        assert torch.equal(g.argmax, r.argmax) and torch.equal(g.hidden, r.hidden)
    assert tr.stages["trunk"].caches[1].pos == ref_t.caches[1].pos == 9
    assert tr.stages["trunk"].caches[2**63 + 7].pending_rows == 2
    with pytest.raises(fr.StageError, match=r"N_ROWS: 3 for sequence 1 outside \[1, 1\]"):
        trunk.verify([Rows(1, [4], commit=3)])
    with pytest.raises(fr.StageError, match="OP: verify for sequence 1 while a verify is pending"):
        trunk.verify([Rows(1, [4])])
    trunk.prime([Rows(1, [4, 4], commit=1)])  # a new turn's prime carries the last commit too
    assert tr.stages["trunk"].caches[1].pos == 12 and tr.stages["trunk"].caches[1].pending is None
    trunk.close([1, 2**63 + 7])
    drafter.close([1, 2**63 + 7])
    assert not tr.stages["trunk"].caches and not tr.stages["drafter_mtp"].states


def test_service_errors_name_the_field(model):
    tr = local(model, max_ctx=16)
    trunk = fr.TrunkProxy(tr)
    with pytest.raises(fr.StageError, match="SIDS: unknown sequence id 9"):
        trunk.prime([Rows(9, [1, 2])])
    trunk.open([9])
    with pytest.raises(fr.StageError, match="TOKENS: context full .* max_ctx 16"):
        trunk.prime([Rows(9, list(range(17)))])
    with pytest.raises(fr.StageError, match=r"TOKENS: token ids must be in \[0, 512\), got 512"):
        trunk.prime([Rows(9, [model.cfg.vocab_size])])
    with pytest.raises(fr.StageError, match="N_ROWS: .* no pending verify"):
        trunk.commit([Commit(9, 1)])
    assert tr.stages["trunk"].caches[9].pos == 0  # rejected requests changed nothing
    stage = tr.stages["trunk"]
    with pytest.raises(schema.WireError, match="OP must be one of"):
        stage.handle({"OP": schema.string_array("train"), "SIDS": np.array([9])})
    with pytest.raises(schema.WireError, match="LENGTHS sum to 3 but TOKENS has 2"):
        stage.handle(
            {
                "OP": schema.string_array("prime"),
                "SIDS": np.array([9]),
                "TOKENS": np.array([1, 2]),
                "LENGTHS": np.array([3], np.int32),
            }
        )
    with pytest.raises(schema.WireError, match="SIDS: a sequence id appears twice"):
        stage.handle({"OP": schema.string_array("commit"), "SIDS": np.array([9, 9]), "N_ROWS": np.array([1, 1])})
    trunk.close([12345])  # closing an unknown sequence is a no-op
    drafter = fr.DrafterProxy(tr)
    with pytest.raises(fr.StageError, match="SIDS: unknown sequence id 4"):
        drafter.draft([DraftRequest(4, torch.zeros(1, model.cfg.hidden_size), [1], 2)])
    drafter.open([4])
    with pytest.raises(fr.StageError, match=r"NUM_DRAFT_TOKENS must be in \[0, 8\], got 9"):
        drafter.draft([DraftRequest(4, torch.zeros(1, model.cfg.hidden_size), [1], 9)])


def test_parse_turn():
    t = fr.parse_turn(
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
    t = fr.parse_turn(
        {"MAX_TOKENS": np.array([1]), "NUM_DRAFT_TOKENS": np.array([2]), "STOP_TOKEN_IDS": np.array([7, 9], np.int32)},
        7,
        schema.FLAG_START | schema.FLAG_END,
    )
    assert (t.tokens, t.spec, t.num_draft_tokens, t.start, t.end, t.stop_token_ids) == ([], None, 2, True, True, (7, 9))
    assert (
        fr.parse_turn({"MAX_TOKENS": np.array([1])}, 7, 0).start,
        fr.parse_turn({"MAX_TOKENS": np.array([1])}, 7, schema.FLAG_END).end,
    ) == (False, True)
    # no sequence id (HTTP generate): a one-turn session of its own, ids from 2**63 up with 63 random bits (a
    # CANCEL names the id, so one turn's id must not tell another's)
    a, b = (
        fr.parse_turn(
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
    ids = [fr.parse_turn({"MAX_TOKENS": np.array([1])}, 0, 0).sid - 2**63 for _ in range(200)]
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
            fr.parse_turn(inputs, corr, schema.FLAG_START | schema.FLAG_END)
    with pytest.raises(
        schema.WireError, match="INPUT_IDS has 65 elements, over the limit of 64"
    ):  # the server's max_ctx
        fr.parse_turn({"MAX_TOKENS": np.array([1]), "INPUT_IDS": np.zeros(65, np.int32)}, 1, 0, max_ctx=64)


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
    """The worker over BLS-shaped proxies streams what the in-process scheduler produces."""
    tr = local(model)
    cfg = schema.ServingConfig(max_ctx=64)
    front = fr.TandemFront(
        fr.TrunkProxy(tr, vocab_size=model.cfg.vocab_size), {"mtp": fr.DrafterProxy(tr)}, stop_ids=(), config=cfg
    )
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
            got = _run(front, fr.TurnRequest(2**64 - 5, [1, 2, 3, 4], 12, spec))
            assert got["err"] is None and got["ids"] == ref["ids"] and got["rounds"] == ref["rounds"]
            assert got["finish"] == "length" and got["bursts"] >= 2
        bad = _run(front, fr.TurnRequest(6, [1] * 70, 4))
        assert bad["err"].startswith("INPUT_IDS: 0 context + 70 new tokens") and "64" in bad["err"]
        lost = _run(front, fr.TurnRequest(7, [1], 4, start=False))["err"]
        assert lost.startswith(
            "sequence_id: unknown sequence id 7: this server holds no such session (set "
            "sequence_start on the first turn; behind a proxy, send the x-tandem-session header"
        )
        assert lost.endswith(" [tandem: session lost]")
        assert not front.sched.sessions and not tr.stages["trunk"].caches and not tr.stages["drafter_mtp"].states
    finally:
        front.stop()


def test_front_survives_a_broken_client(model):
    tr = local(model)
    front = fr.TandemFront(
        fr.TrunkProxy(tr),
        {"mtp": fr.DrafterProxy(tr)},
        stop_ids=(),
        config=schema.ServingConfig(max_ctx=64, burst_rounds=1),
    )
    logs = []
    front.log = logs.append
    try:

        def broken(arrays, err, final):
            raise ConnectionError("client gone")

        front.submit(fr.TurnRequest(1, [1, 2], 30), broken)
        ok = _run(front, fr.TurnRequest(2, [1, 2], 6))
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
            raise fr.StageError(model.name, op, "Server not ready")
        return self.inner(model, op, arrays)


@pytest.mark.parametrize("when", ["verify", "prime"])
def test_shutdown_ends_turns_with_one_clear_error(model, when):
    """A stage that answers "Server not ready" (the server exiting) ends every turn in flight, and
    any that arrives later, with one final "server shutting down" — not an internal error."""
    tr = _Exiting(local(model), {when, "draft"})
    front = fr.TandemFront(
        fr.TrunkProxy(tr),
        {"mtp": fr.DrafterProxy(tr)},
        stop_ids=(),
        config=schema.ServingConfig(max_ctx=256, burst_rounds=1),
    )
    try:
        got: list = []
        started = threading.Event()

        def send(arrays, err, final):
            got.append((err, final))
            started.set()

        if when == "verify":  # a turn streaming when the server starts to exit
            front.submit(fr.TurnRequest(1, [1, 2], 200), send)
            assert started.wait(30)
        tr.exiting = True
        if when == "prime":  # a turn admitted while it exits
            front.submit(fr.TurnRequest(1, [1, 2], 200), send)
        for _ in range(500):
            if got and got[-1][1]:
                break
            threading.Event().wait(0.01)
        assert got[-1] == (fr.SHUTTING_DOWN, True) and sum(f for _, f in got) == 1
        late = _run(front, fr.TurnRequest(2, [1, 2], 4)) if when == "verify" else None
        assert late is None or late["err"] == fr.SHUTTING_DOWN
    finally:
        front.stop()
