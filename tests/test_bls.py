"""The serving layer without Triton: wire packing, the trunk/drafter services, the BLS proxies over
an in-process transport, request parsing, the tandem front, and the client's incremental decoder."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tandem import bls
from tandem.config import TrunkConfig
from tandem.front import TandemFront
from tandem.stages import MTPStage, TrunkStage
from tandem.trunk import Trunk, cast_trunk, init_weights
from tandem.worker import Scheduler, Turn
from tandem_client.client import IncrementalDecoder


@pytest.fixture(scope="module")
def model() -> Trunk:
    cfg = TrunkConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=32,
                      qk_nope_head_dim=32, v_head_dim=32, index_head_dim=16, index_n_heads=2, index_topk=16,
                      linear_head_dim=32, linear_num_heads=2, max_position_embeddings=64)
    return cast_trunk(init_weights(Trunk(cfg).eval().requires_grad_(False), seed=1), torch.float32)


def local(model, max_ctx=None):
    return bls.LocalTransport({"trunk": bls.TrunkService(TrunkStage(model, max_ctx)),
                               "drafter_mtp": bls.DrafterService(MTPStage(model))})


def test_sid_wire_roundtrip():
    for sid in (0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1):
        w = bls.sid_to_wire(sid)
        assert -(2**63) <= w < 2**63
        assert bls.sid_from_wire(w) == sid
        assert int(np.array([w], np.int64).view(np.uint64)[0]) == sid
    with pytest.raises(ValueError):
        bls.sid_to_wire(2**64)


def test_pack_split():
    p = bls.pack_rows([(3, [1, 2, 3]), (2**64 - 1, [4])])
    assert p["SIDS"].tolist() == [3, -1] and p["TOKENS"].tolist() == [1, 2, 3, 4] and p["LENGTHS"].tolist() == [3, 1]
    assert [x.tolist() for x in bls.split_rows(p["TOKENS"], p["LENGTHS"])] == [[1, 2, 3], [4]]


def test_proxy_equals_stage(model):
    """prime / verify / commit / draft through the wire format give the in-process stages' results."""
    tr = local(model)
    trunk, drafter = bls.TrunkProxy(tr), bls.DrafterProxy(tr)
    ref_t, ref_d = TrunkStage(model), MTPStage(model)
    items = [(1, [5, 6, 7, 8, 9]), (2**63 + 7, [10, 11])]
    for st in (trunk, ref_t, drafter, ref_d):
        for sid, _ in items:
            st.open(sid)
    got, ref = trunk.prime(items), ref_t.prime(items)
    for g, r in zip(got, ref):
        assert torch.equal(g.argmax, r.argmax) and torch.equal(g.hidden, r.hidden)
        assert torch.equal(g.top2_gap, r.top2_gap)
    d_items = [(sid, o.hidden, rows[1:] + [int(o.argmax[-1])], 3) for (sid, rows), o in zip(items, ref)]
    assert drafter.draft(d_items) == ref_d.draft(d_items)
    v = [(1, [3, 4, 5]), (2**63 + 7, [6])]
    for g, r in zip(trunk.verify(v), ref_t.verify(v)):
        assert torch.equal(g.argmax, r.argmax) and torch.equal(g.hidden, r.hidden)
    trunk.commit([(1, 2), (2**63 + 7, 1)])
    ref_t.commit([(1, 2), (2**63 + 7, 1)])
    assert tr.services["trunk"].stage.caches[1].pos == ref_t.caches[1].pos == 7
    last = trunk.prime([(1, [1])], all_rows=False)[0]
    assert last.hidden.shape == (1, model.cfg.hidden_size)


def test_service_errors_name_the_field(model):
    tr = local(model, max_ctx=16)
    trunk = bls.TrunkProxy(tr)
    with pytest.raises(bls.StageError, match="SIDS: unknown sequence id 9"):
        trunk.prime([(9, [1, 2])])
    trunk.open(9)
    with pytest.raises(bls.StageError, match="TOKENS: context full .* max_ctx 16"):
        trunk.prime([(9, list(range(17)))])
    with pytest.raises(bls.StageError, match="TOKENS: token ids must be in"):
        trunk.prime([(9, [model.cfg.vocab_size])])
    with pytest.raises(bls.StageError, match="N_ROWS: .* no pending verify"):
        trunk.commit([(9, 1)])
    assert tr.services["trunk"].stage.caches[9].pos == 0  # rejected requests changed nothing
    svc = tr.services["trunk"]
    with pytest.raises(bls.StageRequestError, match="OP must be one of"):
        svc.handle({"OP": bls.string_array("train"), "SIDS": np.array([9])})
    with pytest.raises(bls.StageRequestError, match="LENGTHS sum to 3 but TOKENS has 2"):
        svc.handle({"OP": bls.string_array("prime"), "SIDS": np.array([9]), "TOKENS": np.array([1, 2]),
                    "LENGTHS": np.array([3], np.int32)})
    trunk.close(12345)  # closing an unknown sequence is a no-op
    drafter = bls.DrafterProxy(tr)
    with pytest.raises(bls.StageError, match="SIDS: unknown sequence id 4"):
        drafter.draft([(4, torch.zeros(1, model.cfg.hidden_size), [1], 2)])


def test_parse_turn():
    t = bls.parse_turn({"INPUT_IDS": np.array([1, 2], np.int32), "MAX_TOKENS": np.array([5], np.int32),
                        "START": np.array([1], np.int32), "END": np.array([0], np.int32),
                        "CORRID": np.array([2**64 - 2], np.uint64), "SPEC": np.array([b"OFF"], object)})
    assert (t.sid, t.tokens, t.max_tokens, t.spec, t.start, t.end, t.k) == (2**64 - 2, [1, 2], 5, "off", True, False, None)
    assert bls.parse_turn({"MAX_TOKENS": np.array([1])}, correlation_id=7).tokens == []
    for inputs, msg in [({}, "MAX_TOKENS is required"),
                        ({"MAX_TOKENS": np.array([0])}, r"MAX_TOKENS must be in \[1, 4096\], got 0"),
                        ({"MAX_TOKENS": np.array([1]), "SPEC": np.array([b"x"], object)}, "SPEC must be one of"),
                        ({"MAX_TOKENS": np.array([1]), "INPUT_IDS": np.zeros((2, 2))}, "INPUT_IDS must be 1-D"),
                        ({"MAX_TOKENS": np.array([1]), "NUM_DRAFT_TOKENS": np.array([1, 2])}, "NUM_DRAFT_TOKENS")]:
        with pytest.raises(bls.StageRequestError, match=msg):
            bls.parse_turn(inputs, correlation_id=1)


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
            out["finish"] = arrays["FINISH_REASON"][0].decode()
        if final:
            done.set()

    front.submit(req, send)
    assert done.wait(60)
    return out


def test_front_over_proxies_equals_in_process(model):
    """The worker over BLS-shaped proxies streams what the in-process scheduler produces."""
    tr = local(model)
    front = TandemFront(bls.TrunkProxy(tr, vocab_size=model.cfg.vocab_size), bls.DrafterProxy(tr), stop_ids=(),
                        max_ctx=64)
    try:
        ref_s = Scheduler(TrunkStage(model), MTPStage(model), max_ctx=64)
        for spec in ("mtp", "off"):
            ref = {"ids": [], "rounds": 0}

            def emit(r, err, final, ref=ref):
                assert err is None
                ref["ids"] += r.tokens
                ref["rounds"] += r.rounds

            ref_s.admit([Turn(5, [1, 2, 3, 4], 12, emit, spec=spec)])
            while 5 in ref_s.turns:
                ref_s.burst()
            got = _run(front, bls.TurnRequest(2**64 - 5, [1, 2, 3, 4], 12, spec, True, True, None))
            assert got["err"] is None and got["ids"] == ref["ids"] and got["rounds"] == ref["rounds"]
            assert got["finish"] == "length" and got["bursts"] >= 2
        bad = _run(front, bls.TurnRequest(6, [1] * 70, 4, "mtp", True, True, None))
        assert "input_ids" in bad["err"] and "64" in bad["err"]
        assert _run(front, bls.TurnRequest(7, [1], 4, "mtp", False, True, None))["err"].startswith("unknown sequence id 7")
        assert not front.sched.sessions and not tr.services["trunk"].stage.caches
    finally:
        front.stop()


def test_front_survives_a_broken_client(model):
    tr = local(model)
    front = TandemFront(bls.TrunkProxy(tr), bls.DrafterProxy(tr), stop_ids=(), max_ctx=64, burst_rounds=1)
    logs = []
    front.log = logs.append
    try:
        def broken(arrays, err, final):
            raise ConnectionError("client gone")

        front.submit(bls.TurnRequest(1, [1, 2], 30, "mtp", True, True, None), broken)
        ok = _run(front, bls.TurnRequest(2, [1, 2], 6, "mtp", True, True, None))
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
