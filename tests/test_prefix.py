"""Prefix capture and the prefix cache (README, "The prefix cache"): the session's prefix members,
warm == cold, published state that never changes, the tparallel gate after a warm start, LRU
eviction, and the same over the stages' wire form; keyed block keys, hits confirmed by tokens (a
forced hash collision is a counted miss, served cold), and cache-salt namespaces."""

from __future__ import annotations

import pytest
import torch

from tandem import schema
from tandem.engine.gate import tparallel_gate
from tandem.engine.inprocess import Engine
from tandem.engine.protocols import Rows
from tandem.engine.prefix import KeyedHasher, PrefixIndex, reusable_blocks, split_points
from tandem.engine.scheduler import Scheduler, Turn
from tandem.serving import proxies

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
    while sid in sched.turns:  # (a prompt over the prefill budget is primed over the first bursts)
        sched.burst()
        if check is not None and sid in sched.sessions:
            check(sched.sessions[sid])
    errs = [e for _, e in got if e]
    assert not errs, errs
    return [t for r, _ in got for t in r.tokens], [r for r, _ in got]


class _Constant:
    """A degenerate hasher: every chain digest is the same, so every block of every prompt has one key."""

    def digest(self, data: bytes) -> bytes:
        return bytes(16)


def _run_many(sched, turns):
    """Admit ``(sid, ids, n, spec)`` turns together and run them to completion: tokens per sid."""
    got: dict[int, list] = {sid: [] for sid, *_ in turns}
    sched.admit(
        [Turn(sid, ids, n, lambda r, e, f, sid=sid: got[sid].append((r, e)), spec=spec) for sid, ids, n, spec in turns]
    )
    while any(sid in sched.turns for sid in got):
        sched.burst()
    assert not [e for v in got.values() for _, e in v if e]
    return {sid: [t for r, _ in v for t in r.tokens] for sid, v in got.items()}


def test_keys_blocks_and_split_points():
    idx = PrefixIndex(1 << 20)
    a, b = _ids(200, 1), _ids(200, 1)
    b[150] += 1  # differs in block 2 only
    ka, kb = idx.keys(a, 3), idx.keys(b, 3)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and len(set(ka)) == 3
    assert idx.keys(a, 2) == ka[:2]  # a key names the whole prefix up to its block's end
    assert all(-(2**63) <= k < 2**63 for k in ka)  # int64 on the wire
    assert [reusable_blocks(n) for n in (1, C, C + 1, 2 * C, 2 * C + 1)] == [0, 0, 1, 1, 2]
    assert split_points(10, 140) == [10, C, 2 * C, 140] and split_points(0, C) == [0, C]
    assert split_points(C, C + 1) == [C, C + 1]
    with pytest.raises(ValueError, match="need"):
        idx.keys(a[:100], 2)


def test_keys_are_keyed_by_a_secret_and_salted():
    a = _ids(3 * C, 2)
    one, two = PrefixIndex(1 << 20), PrefixIndex(1 << 20)
    assert set(one.keys(a, 3)).isdisjoint(two.keys(a, 3))  # each index draws its own secret
    assert set(one.keys(a, 3)).isdisjoint(one.keys(a, 3, salt="tenant-a"))
    assert set(one.keys(a, 3, salt="tenant-a")).isdisjoint(one.keys(a, 3, salt="tenant-b"))
    assert one.keys(a, 3, salt="x") == one.keys(a, 3, salt="x")
    secret = bytes(range(32))
    same = [PrefixIndex(1 << 20, KeyedHasher(secret)).keys(a, 2) for _ in range(2)]
    assert same[0] == same[1]  # the same secret gives the same keys: they are a function of it
    with pytest.raises(ValueError, match="16 to 64 bytes"):
        KeyedHasher(bytes(8))


def test_a_collision_is_a_counted_miss_and_never_published():
    idx = PrefixIndex(1 << 20, hasher=_Constant())
    p, q = idx.capture(_ids(2 * C + 1, 3)), idx.capture(_ids(2 * C + 1, 4))
    assert p.keys == q.keys and p.blocks != q.blocks  # a forced collision: same keys, other tokens
    assert idx.lookup(p, "off") == 0
    r = idx.reserve(p, "off")
    assert r.chain == r.trunk == p.keys[:1]  # block 1 has block 0's key: held by another block, not publishable
    idx.fill(r, 100, [], 0)
    assert idx.lookup(q, "off") == 0 and idx.stats["collisions"] == 1 and idx.stats["misses"] == 2
    assert idx.reserve(q, "off").chain == []  # the entry of p stays p's
    assert idx.lookup(p, "off") == 1 and idx.stats["hits"] == 1
    salted = idx.capture(_ids(2 * C + 1, 3), salt="b")
    assert salted.keys == p.keys and idx.lookup(salted, "off") == 0  # same tokens, other namespace: not p's root
    assert idx.stats["collisions"] == 3 and idx.reserve(salted, "off").chain == []


@pytest.mark.parametrize("spec", ["dflash", "off"])
def test_forced_collision_is_served_cold(tiny, spec):  # noqa: F811
    """Every key equal (a degenerate hasher): prompts whose keys collide are told apart by their tokens,
    each is served what a cold prime computes, and the published state of the first stays in place."""
    eng = _engine(tiny, burst_rounds=2)
    eng.sched.prefix = PrefixIndex(eng.sched.prefix.capacity, hasher=_Constant())
    p, q, r = _ids(2 * C + 30, 51), _ids(2 * C + 30, 52), _ids(2 * C + 30, 53)
    plain = _engine(tiny, burst_rounds=2, prefix_cache_mb=0).sched
    ref = {sid: _run(plain, sid, ids, 30, spec)[0] for sid, ids in ((1, p), (2, q), (3, r))}
    assert _run(eng.sched, 1, p, 30, spec)[0] == ref[1]
    st = eng.sched.prefix.stats
    assert st["blocks"] == 1 and len(eng.trunk.blocks) == 1  # block 1 shares block 0's key: not published
    ((key, held),) = eng.trunk.blocks.items()
    before = {i: {n: t.clone() for n, t in d.items()} for i, d in held.mla.items()}
    assert _run(eng.sched, 2, q, 30, spec)[0] == ref[2]  # a colliding prompt: a counted miss, served cold
    assert st["collisions"] == 1 and st["hits"] == 0 and st["misses"] == 2 and st["rows_skipped"] == 0
    got = _run_many(eng.sched, [(4, q, 30, spec), (5, r, 30, spec)])  # two colliders published in one burst
    assert got == {4: ref[2], 5: ref[3]} and st["collisions"] == 3
    assert list(eng.trunk.blocks) == [key] and eng.trunk.blocks[key] is held  # p's block was never overwritten
    assert all(torch.equal(t, before[i][n]) for i, d in held.mla.items() for n, t in d.items())
    assert _run(eng.sched, 6, p, 30, spec)[0] == ref[1]  # p still hits its own block
    assert st["hits"] == 1 and st["rows_skipped"] == C


def test_cache_salt_isolates_namespaces(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=2)
    ids = _ids(2 * C + 20, 61)
    st = eng.sched.prefix.stats
    cold = eng.generate(ids, 24, spec="dflash", cache_salt="tenant-a")
    assert st["misses"] == 1 and st["blocks"] == 2
    for salt in ("tenant-b", ""):  # another namespace (or the shared one) does not see tenant a's blocks
        assert eng.generate(ids, 24, spec="dflash", cache_salt=salt)["token_ids"] == cold["token_ids"]
    assert st["hits"] == 0 and st["misses"] == 3 and st["collisions"] == 0 and st["blocks"] == 6
    warm = eng.generate(ids, 24, spec="dflash", cache_salt="tenant-a")
    assert warm["token_ids"] == cold["token_ids"] and st["hits"] == 1 and st["rows_skipped"] == 2 * C
    with pytest.raises(ValueError, match=f"{schema.CACHE_SALT}: at most {schema.MAX_CACHE_SALT_BYTES} bytes"):
        eng.generate(ids, 4, spec="off", cache_salt="x" * (schema.MAX_CACHE_SALT_BYTES + 1))


def test_a_later_turn_keeps_the_salt_of_the_prime(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=2)
    sched, ids, got = eng.sched, _ids(C + 20, 71), []
    sched.admit([Turn(1, ids, 4, lambda r, e, f: got.append(e), spec="off", end=False, cache_salt="a")])
    while 1 in sched.turns:
        sched.burst()
    sched.admit([Turn(1, [5, 6], 4, lambda r, e, f: got.append(e), start=False, cache_salt="b")])
    while 1 in sched.turns:
        sched.burst()
    assert not [e for e in got if e] and sched.prefix.stats["misses"] == 1  # the later turn looks nothing up
    assert eng.generate(ids, 4, spec="off", cache_salt="a")["finish_reason"] and sched.prefix.stats["hits"] == 1


@pytest.mark.parametrize("spec", ["dflash", "dflash2", "off"])
def test_same_prompt_twice_warm_equals_cold(tiny, spec):  # noqa: F811
    eng = _engine(tiny, burst_rounds=2)
    ids = _ids(2 * C + 30, 5)
    cold, _ = _run(eng.sched, 1, ids, 40, spec)
    st = eng.sched.prefix.stats
    assert st["misses"] == 1 and st["hits"] == 0 and st["blocks"] == 2
    warm, _ = _run(eng.sched, 2, ids, 40, spec)
    assert warm == cold and len(cold) == 40
    assert st["hits"] == 1 and st["rows_skipped"] == 2 * C
    fresh, _ = _run(_engine(tiny, burst_rounds=2).sched, 3, ids, 40, spec)
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
    eng = _engine(tiny, burst_rounds=1, prefill_budget=0)  # the whole prompt primed at admission
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
    assert cap.keys == sched.prefix.keys(ids, 1) and s.take_prefix_capture() is None and not s.prefix_capture_ready()
    # the native MTP spec keeps no capture and exports no tail
    sched.admit([Turn(2, ids, 12, lambda r, e, f: got.append(e), spec="mtp", end=False)])
    m = sched.sessions[2]
    sched.burst()
    assert m.take_prefix_capture() is None and not m.prefix_capture_ready() and m.export_draft_tail(C) is None
    assert all(e is None for e in got)


def test_published_rows_never_change_and_warm_passes_the_gate(tiny):  # noqa: F811
    eng = _engine(tiny, burst_rounds=1, adaptive_draft=False)  # (every round drafts: some drafts are rejected)
    sched, ids = eng.sched, _ids(2 * C + 9, 13)
    _run(sched, 1, ids, 8, "dflash2", end=False)  # published after round 1; the session stays open
    blocks = {
        k: {i: {n: t.clone() for n, t in d.items()} for i, d in b.mla.items()} for k, b in eng.trunk.blocks.items()
    }
    kda = {k: {i: st.S.clone() for i, st in b.kda.items()} for k, b in eng.trunk.blocks.items()}
    tails = {k: [(a.clone(), v.clone()) for a, v in kv] for k, kv in eng.drafters["dflash2"].tails.items()}
    assert len(blocks) == 2 and len(tails) == 2
    rejected = []
    # keep decoding (rejected drafts roll the cache back) in the publishing session and a warm one
    gate = []

    def check(s):
        eng.sched.settle()
        gate.append(max(tparallel_gate(eng.model, eng.trunk.cache(s.sid), s.committed).values()))

    sched.admit(
        [Turn(1, _ids(5, 14), 60, lambda r, e, f: rejected.append(r.drafted - r.accepted if r else 0), start=False)]
    )
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


def test_index_lookup_needs_the_specs_tail():
    idx = PrefixIndex(1 << 20)
    cap = idx.capture(_ids(3 * C + 1, 1))
    two = idx.capture(_ids(3 * C + 1, 1)[: 2 * C + 1])
    r = idx.reserve(two, "off")
    assert r.trunk == r.chain == cap.keys[:2] and r.tails == []
    idx.fill(r, 200, [], 0)
    assert idx.shrink() == []
    assert idx.lookup(cap, "off") == 2 and idx.lookup(cap, "dflash") == 0
    r = idx.reserve(idx.capture(_ids(C + 1, 1)), "dflash")
    assert r.trunk == [] and r.tails == r.chain == cap.keys[:1]
    idx.fill(r, 0, r.tails, 50)
    idx.shrink()
    assert idx.lookup(cap, "dflash") == 1 and idx.lookup(cap, "dflash2") == 0
    assert idx.stats["hits"] == 2 and idx.stats["misses"] == 2 and idx.stats["bytes"] == 250
    idx.release(idx.reserve(cap, "off"))  # a failed publication leaves the index as it was
    assert set(idx.entries) == set(cap.keys[:2])


def test_warm_start_with_the_drafter_over_the_wire_equals_cold(tiny):  # noqa: F811
    """With the DFlash drafter in its model (``colocate`` off, here over a local transport), a warm start
    restores the trunk's blocks and the drafter's tails and equals the cold run; an unpublished key is
    refused by each store."""
    trunk, drafters = tiny
    ref = _engine(tiny, burst_rounds=2)
    tr = proxies.LocalTransport({"drafter_dflash": ref.drafters["dflash"]})
    stage = ref.drafters["dflash"]
    sched = Scheduler(ref.trunk, {a: proxies.DFlashProxy(tr) for a in schema.DFLASH_SPECS}, ref.config, stop_ids=())
    ids = _ids(C + 50, 31)
    cold, _ = _run(sched, 1, ids, 30, "dflash")
    warm, _ = _run(sched, 2, ids, 30, "dflash")
    assert cold == warm and sched.prefix.stats["hits"] == 1
    assert set(ref.trunk.blocks) == set(sched.prefix.entries) == {k for _, k in stage.tails}
    sched.trunk.open([99])
    with pytest.raises(KeyError):
        sched.trunk.prime([Rows(99, [1, 2], [5])])
    with pytest.raises(proxies.StageError, match="PREFIX_KEYS: no dflash drafter tail for prefix block 5"):
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


def test_a_turn_ending_at_its_first_token_publishes_its_prompt(tiny):  # noqa: F811
    """A prompt run with max_tokens 1 publishes its blocks at its first token (it reaches no burst): the
    second run restores them, a hit."""
    sched = _engine(tiny).sched
    ids = _ids(3 * C + 5, 41)
    a, _ = _run(sched, 1, ids, 1, schema.OFF)
    b, _ = _run(sched, 2, ids, 1, schema.OFF)
    assert a == b and sched.prefix.stats["misses"] == 1 and sched.prefix.stats["hits"] == 1
    assert sched.prefix.stats["blocks"] == 3


@pytest.mark.parametrize("when", ["prime", "end"])
def test_a_cancelled_turn_publishes_nothing_and_counts_once(tiny, when):  # noqa: F811
    """A turn whose client cancelled it during its prime, or while its whole reply was being made (the
    reply fits in its first burst), ends with one cancelled last response and no tokens after the
    cancel; nothing it primed is published; the scheduler counts it once."""
    sched = _engine(tiny).sched
    got, asked, seen = [], [], {"cancelled": when == "prime"}

    def cancelled(sync):  # "end": only a look at the connection (sync) sees it, as before a final response
        asked.append(sync)
        return seen["cancelled"] and (sync or when == "prime")

    def emit(r, e, f):
        got.append((r, e, f))
        seen["cancelled"] = True  # the client leaves after its first response

    sched.admit([Turn(5, _ids(2 * C + 3, 42), 8, emit, spec=schema.OFF, cancelled=cancelled)])
    while 5 in sched.turns:
        sched.burst()
    r, e, f = got[-1]
    assert e is None and f and r.tokens == [] and r.finish_reason == schema.CANCELLED
    assert len(got) == (1 if when == "prime" else 2) and True in asked
    assert sched.prefix.stats["blocks"] == 0 and sched.stats["cancelled"] == 1
    assert 5 not in sched.sessions
