"""Prefix capture and the prefix cache (README, "The prefix cache"): the session's prefix members,
warm == cold, published state that never changes, the tparallel gate after a warm start, LRU
eviction, and the same over the stages' wire form."""

from __future__ import annotations

import pytest
import torch

from tandem import schema
from tandem.engine.gate import tparallel_gate
from tandem.engine.inprocess import Engine
from tandem.engine.protocols import Rows
from tandem.engine.prefix import PrefixIndex, block_keys, reusable_blocks, split_points
from tandem.engine.scheduler import Scheduler, Turn
from tandem.serving import front as fr

from test_dflash import _Tok, tiny  # noqa: F401 - the tiny trunk + drafters fixture

C = schema.PREFIX_BLOCK


def _ids(n, seed):
    return torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(tiny, **kw):  # noqa: F811
    trunk, drafters = tiny
    return Engine(model=trunk, tokenizer=_Tok(), dflash=drafters, max_ctx=256, **kw)


def _run(sched, sid, ids, n, spec, check=None, end=True):
    """Run one turn to completion; ``check(session)`` after every burst. Returns (tokens, receipts)."""
    got = []
    sched.admit([Turn(sid, ids, n, lambda r, e, f: got.append((r, e)), spec=spec, end=end)])
    assert got and got[0][1] is None, got
    while sid in sched.turns:
        sched.burst()
        if check is not None and sid in sched.sessions:
            check(sched.sessions[sid])
    errs = [e for _, e in got if e]
    assert not errs, errs
    return [t for r, _ in got for t in r.tokens], [r for r, _ in got]


def test_keys_blocks_and_split_points():
    a, b = _ids(200, 1), _ids(200, 1)
    b[150] += 1  # differs in block 2 only
    ka, kb = block_keys(a, 3), block_keys(b, 3)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and len(set(ka)) == 3
    assert block_keys(a, 2) == ka[:2]  # a key names the whole prefix up to its block's end
    assert [reusable_blocks(n) for n in (1, C, C + 1, 2 * C, 2 * C + 1)] == [0, 0, 1, 1, 2]
    assert split_points(10, 140) == [10, C, 2 * C, 140] and split_points(0, C) == [0, C]
    assert split_points(C, C + 1) == [C, C + 1]
    with pytest.raises(ValueError, match="need"):
        block_keys(a[:100], 2)


@pytest.mark.parametrize("arm", ["dflash", "dflash2", "off"])
def test_same_prompt_twice_warm_equals_cold(tiny, arm):  # noqa: F811
    eng = _engine(tiny, burst_rounds=2)
    ids = _ids(2 * C + 30, 5)
    cold, _ = _run(eng.sched, 1, ids, 40, arm)
    st = eng.sched.prefix.stats
    assert st["misses"] == 1 and st["hits"] == 0 and st["blocks"] == 2
    warm, _ = _run(eng.sched, 2, ids, 40, arm)
    assert warm == cold and len(cold) == 40
    assert st["hits"] == 1 and st["rows_skipped"] == 2 * C
    fresh, _ = _run(_engine(tiny, burst_rounds=2).sched, 3, ids, 40, arm)
    assert fresh == cold


def test_shared_system_prompt_warm_equals_cold(tiny):  # noqa: F811
    system = _ids(C + 40, 7)  # one whole shared block
    a, b = system + _ids(50, 8), system + _ids(35, 9)
    eng = _engine(tiny, burst_rounds=3)
    _run(eng.sched, 1, a, 30, "dflash")
    warm, _ = _run(eng.sched, 2, b, 30, "dflash")
    assert eng.sched.prefix.stats["hits"] == 1 and eng.sched.prefix.stats["rows_skipped"] == C
    cold, _ = _run(_engine(tiny, burst_rounds=3).sched, 3, b, 30, "dflash")
    assert warm == cold


def test_prefix_members_follow_the_contract(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=1)
    sched, ids = eng.sched, _ids(C + 20, 11)
    got = []
    sched.admit([Turn(1, ids, 12, lambda r, e, f: got.append(e), spec="dflash", end=False)])
    s = sched.sessions[1]
    assert s.prefix_capture is not None and s.prefix_capture.boundary == C
    assert not s.prefix_capture_ready()  # primed, but the drafter ingests the prompt at round 1
    assert s.export_draft_tail(C) is None  # nothing ingested yet: too short
    sched.round({})
    assert s.prefix_capture_ready()
    tail = s.export_draft_tail(C)
    assert tail is not None and tail[0][0].shape[2] == C
    assert s.export_draft_tail(len(s.committed) + 1) is None  # more rows than the drafter covers
    cap = s.take_prefix_capture()
    assert cap.keys == block_keys(ids, 1) and s.take_prefix_capture() is None and not s.prefix_capture_ready()
    # the native MTP arm keeps no capture and exports no tail
    sched.admit([Turn(2, ids, 12, lambda r, e, f: got.append(e), spec="mtp", end=False)])
    m = sched.sessions[2]
    sched.burst()
    assert m.take_prefix_capture() is None and not m.prefix_capture_ready() and m.export_draft_tail(C) is None
    assert all(e is None for e in got)


def test_published_rows_never_change_and_warm_passes_the_gate(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=1)
    sched, ids = eng.sched, _ids(2 * C + 9, 13)
    _run(sched, 1, ids, 8, "dflash2", end=False)  # published after round 1; the session stays open
    blocks = {k: {i: {n: t.clone() for n, t in d.items()} for i, d in b.mla.items()} for k, b in eng.trunk.blocks.items()}
    kda = {k: {i: st.S.clone() for i, st in b.kda.items()} for k, b in eng.trunk.blocks.items()}
    tails = {k: [(a.clone(), v.clone()) for a, v in kv] for k, kv in eng.drafters["dflash2"].tails.items()}
    assert len(blocks) == 2 and len(tails) == 2
    rejected = []
    # keep decoding (rejected drafts roll the cache back) in the publishing session and a warm one
    gate = []

    def check(s):
        eng.sched.settle()
        gate.append(max(tparallel_gate(eng.model, eng.trunk.cache(s.sid), s.committed).values()))

    sched.admit([Turn(1, _ids(5, 14), 60, lambda r, e, f: rejected.append(r.drafted - r.accepted if r else 0),
                      start=False)])
    while 1 in sched.turns:
        sched.burst()
    warm, _ = _run(sched, 2, ids, 60, "dflash2", check=check)
    assert sched.prefix.stats["hits"] == 1 and sum(rejected) > 0 and len(gate) >= 5
    assert max(gate) <= 1e-5, gate
    for k, b in eng.trunk.blocks.items():
        for i, d in b.mla.items():
            for n, t in d.items():
                assert torch.equal(t, blocks[k][i][n]), (k, i, n)
        for i, st in b.kda.items():
            assert torch.equal(st.S, kda[k][i])
    for k, kv in eng.drafters["dflash2"].tails.items():
        assert all(torch.equal(a, b) and torch.equal(v, w) for (a, v), (b, w) in zip(kv, tails[k]))


def test_lru_eviction_keeps_the_stores_in_step(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=4)
    sched = eng.sched
    _run(sched, 1, _ids(C + 5, 20), 4, "dflash")
    per_block = sched.prefix.stats["bytes"]
    sched.prefix.capacity = 2 * per_block  # room for two blocks
    for sid, seed in ((2, 21), (3, 22), (4, 23)):
        _run(sched, sid, _ids(C + 5, seed), 4, "dflash")
    st = sched.prefix.stats
    assert st["evictions"] == 2 and st["blocks"] == 2 and st["bytes"] <= sched.prefix.capacity
    assert set(eng.trunk.blocks) == set(sched.prefix.entries)
    assert {k for _, k in eng.drafters["dflash"].tails} == set(sched.prefix.entries)
    _run(sched, 5, _ids(C + 5, 20), 4, "dflash")  # the first prompt was evicted: a miss
    assert st["hits"] == 0 and st["misses"] == 5


def test_index_lookup_needs_the_arms_tail():
    idx = PrefixIndex(1 << 20)
    keys = block_keys(_ids(3 * C, 1), 3)
    assert idx.add(keys[:2], 200, "off", [], 0, keys[:2]) == []
    assert idx.lookup(keys, "off") == 2 and idx.lookup(keys, "dflash") == 0
    idx.add([], 0, "dflash", keys[:1], 50, keys[:1])
    assert idx.lookup(keys, "dflash") == 1 and idx.lookup(keys, "dflash2") == 0
    assert idx.stats["hits"] == 2 and idx.stats["misses"] == 2 and idx.stats["bytes"] == 250


def test_warm_start_over_the_wire_equals_cold(tiny):  # noqa: F811
    trunk, drafters = tiny
    ref = _engine(tiny, burst_rounds=2)
    tr = fr.LocalTransport({"trunk": ref.trunk, "drafter_dflash": ref.drafters["dflash"]})
    stage = ref.drafters["dflash"]
    sched = Scheduler(fr.TrunkProxy(tr, 512), {a: fr.DFlashProxy(tr) for a in schema.DFLASH_ARMS},
                      ref.config, stop_ids=())
    ids = _ids(C + 50, 31)
    cold, _ = _run(sched, 1, ids, 30, "dflash")
    warm, _ = _run(sched, 2, ids, 30, "dflash")
    assert cold == warm and sched.prefix.stats["hits"] == 1
    assert set(ref.trunk.blocks) == set(sched.prefix.entries) == {k for _, k in stage.tails}
    sched.trunk.open([99])
    with pytest.raises(fr.StageError, match="PREFIX_KEYS: block 5 is not published"):
        sched.trunk.prime([Rows(99, [1, 2], [5])])
    with pytest.raises(fr.StageError, match="PREFIX_KEYS: no dflash drafter tail for prefix block 5"):
        sched.drafters["dflash"].open([99], [("dflash", [5])])
    sched.trunk.close([99])


def test_a_failed_publication_loses_only_the_cache_entry(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=2)
    stage = eng.drafters["dflash"]

    def broken(items):
        raise RuntimeError("drafter store full")

    stage.publish = broken
    ids = _ids(C + 30, 41)
    out, _ = _run(eng.sched, 1, ids, 20, "dflash")  # the turn completes
    st = eng.sched.prefix.stats
    assert len(out) == 20 and st["errors"] == 1 and "drafter store full" in st["last_error"]
    assert eng.trunk.blocks == {} and st["blocks"] == 0  # the trunk's half was evicted again
    del stage.publish
    again, _ = _run(eng.sched, 2, ids, 20, "dflash")
    assert again == out and st["misses"] == 2 and st["blocks"] == 1
