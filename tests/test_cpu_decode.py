"""Plain greedy decode steps in one compiled call (``tandem.ops.cpu.decode``, ``Trunk.decode_many``)
against the same steps as one-row verify passes with their commits: bit-identical targets, gaps,
hidden rows, features and caches, on odd shapes (3 streams, 5 experts, a vocabulary of 97) and on the
shipped checkpoint; the early stop; the scheduler's and the co-located host's plain rounds in one
call give the tokens, receipts and caches of the rounds one at a time; bad calls are refused."""

import pytest
import torch

from tandem.engine.inprocess import Engine
from tandem.engine.protocols import Rows
from tandem.engine.trunk_stage import TrunkStage
from tandem.ops.cpu import decode as cpu_decode
from tandem.ops.cpu import groups, trunk_pass
from test_cpu_block import _odd_model


def _primed(model, prompts):
    caches = []
    for p in prompts:
        c = model.new_cache(model.cfg.max_position_embeddings)
        model.prime(c, torch.tensor([p]))
        caches.append(c)
    return caches


def _same_caches(model, a, b):
    """Both cache sets commit their pending row and verify the same two rows: equal outputs."""
    for c in a + b:
        c.commit(1)
    assert [c.pos for c in a] == [c.pos for c in b]
    oa = model.verify_many(a, [torch.tensor([[3, 4]])] * len(a), (1,))
    ob = model.verify_many(b, [torch.tensor([[3, 4]])] * len(b), (1,))
    return all(torch.equal(x, y) for pa, pb in zip(oa, ob) for x, y in zip(pa, pb))


def _equal(ra, rb):
    return all(qa.keys() == qb.keys() and all(torch.equal(qa[k], qb[k]) for k in qa) for qa, qb in zip(ra, rb))


@pytest.mark.parametrize("steps,threads", [(1, 1), (7, 1), (7, 2), (5, 3)])
def test_compiled_steps_equal_one_row_verifies(steps, threads):
    model = _odd_model()
    prompts = [[5, 9, 11, 2, 40, 41, 42, 7, 8, 9, 10], [60, 61, 62], list(range(20, 45))]
    with torch.no_grad():
        a, b = _primed(model, prompts), _primed(model, prompts)
        ra = model.decode_many(a, [1, 2, 3], steps, [(), (), ()], (0, 2), threads=threads)
        assert trunk_pass._PLANS.get(model) is not None  # the compiled loop ran (not the fallback)
        rb = model._decode_reference(b, [1, 2, 3], steps, [(), (), ()], (0, 2))
        assert len(ra) == len(rb) == 3 and all(q["tokens"].shape == (steps,) for q in ra + rb)
        assert _equal(ra, rb)
        assert ra[0]["features"].shape == (steps, 2 * model.cfg.hidden_size)
        assert all(c.pending_rows == 1 for c in a)
        assert _same_caches(model, a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_call_after_a_call_reads_the_states_it_left(threads, monkeypatch):
    """The second of two calls over the same sequences starts from the KDA states the first wrote, in
    place (no copy: ``_carried``), with the targets and caches of the verify passes; a call over the
    sequences in another order copies them (nothing carried); what is kept for that goes with the caches."""
    import gc

    gc.collect()
    kept = len(cpu_decode._CARRY)
    model = _odd_model()
    prompts = [[5, 9, 11, 2, 40, 41, 42, 7, 8, 9, 10], [60, 61, 62], list(range(20, 45))]
    carried = []
    real = cpu_decode._carried
    monkeypatch.setattr(cpu_decode, "_carried", lambda *a: carried.append(real(*a) is not None) or real(*a))
    with torch.no_grad():
        a, b = _primed(model, prompts), _primed(model, prompts)
        ra = model.decode_many(a, [1, 2, 3], 4, [()] * 3, (0, 2), threads=threads)
        rb = model._decode_reference(b, [1, 2, 3], 4, [()] * 3, (0, 2))
        nxt = [int(q["tokens"][-1]) for q in ra]
        for c in a + b:
            c.commit(1)
        ra2 = model.decode_many(a, nxt, 5, [()] * 3, (0, 2), threads=threads)
        rb2 = model._decode_reference(b, nxt, 5, [()] * 3, (0, 2))
        assert carried == [False] * threads + [True] * threads
        assert _equal(ra, rb) and _equal(ra2, rb2)
        carried.clear()
        order = [2, 0, 1]
        for c in a + b:
            c.commit(1)
        ra3 = model.decode_many([a[j] for j in order], [1] * 3, 3, [()] * 3, (0, 2), threads=threads)
        rb3 = model._decode_reference([b[j] for j in order], [1] * 3, 3, [()] * 3, (0, 2))
        assert carried == [False] * threads and _equal(ra3, rb3) and _same_caches(model, a, b)
        assert len(cpu_decode._CARRY) > kept
    del a, ra, ra2, ra3
    gc.collect()
    assert len(cpu_decode._CARRY) == kept


@pytest.mark.parametrize("threads", [1, 2])
def test_a_compiled_verify_equals_the_verify_pass_row_by_row(threads, monkeypatch):
    """Sequences of 8, 1, 3 and 5 rows in one compiled verify (one group, or two side by side): every row's
    target, gap, hidden row and features equal the verify pass's; each commit of a prefix (the accept walk's)
    leaves the caches of the reference, and a compiled verify and decode after it go on from them (the second
    verify of one group reads the kept rows' states where the first wrote them, without a copy)."""
    in_place = []
    real = trunk_pass._starts_in_place
    monkeypatch.setattr(trunk_pass, "_starts_in_place", lambda *a: (r := real(*a), in_place.append(r is not None))[0])
    model = _odd_model()
    prompts = [[5, 9, 11, 2, 40, 41, 42, 7, 8, 9, 10], [60, 61, 62], list(range(20, 45)), [3]]
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [9], [10, 11, 12], [13, 14, 15, 16, 17]]
    keep = [3, 1, 3, 5]
    with torch.no_grad():
        a, b = _primed(model, prompts), _primed(model, prompts)
        ra = model.verify_targets(a, rows, (0, 2), threads=threads)
        assert trunk_pass._PLANS.get(model) is not None
        rb = model._verify_reference(b, rows, (0, 2))
        assert [q["tokens"].shape[0] for q in ra] == [len(r) for r in rows]
        assert _equal(ra, rb)
        assert [c.pending_rows for c in a] == [len(r) for r in rows]
        for c, d, n in zip(a, b, keep):
            c.commit(n), d.commit(n)
        nxt = [[7, 8], [2], [5, 5, 5, 5, 5, 5], [1]]
        ra2 = model.verify_targets(a, nxt, (1,), threads=threads)
        rb2 = model._verify_reference(b, nxt, (1,))
        assert _equal(ra2, rb2)
        if threads == 1:
            assert in_place == [False, True]  # primed caches: copied; after a verify and its commit: in place
        for c in a + b:
            c.commit(1)
        ra3 = model.decode_many(a, [4, 4, 4, 4], 3, [()] * 4, (), threads=threads)
        rb3 = model._decode_reference(b, [4, 4, 4, 4], 3, [()] * 4, ())
        assert _equal(ra3, rb3) and _same_caches(model, a, b)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_shipped_trunk_verifies_compiled_as_its_verify_pass(trunk_fp32, threads):
    """The shipped checkpoint's greedy verify of a DFlash block (8 rows) beside a plain row, in one call on one
    thread or split across two (its GEMMs' columns, its MoE's experts): the compiled call and the verify pass
    give the same rows and caches."""
    prompts = [list(range(100, 160)), list(range(300, 340))]
    rows = [[11, 12, 13, 14, 15, 16, 17, 18], [19]]
    trunk_fp32.batch_invariant = True  # (the serving default)
    with torch.no_grad():
        a, b = _primed(trunk_fp32, prompts), _primed(trunk_fp32, prompts)
        ra = trunk_pass.verify_rows(trunk_fp32, a, rows, (1, 3), split=threads)
        assert trunk_pass._PLANS.get(trunk_fp32) is not None
        rb = trunk_fp32._verify_reference(b, rows, (1, 3))
        assert _equal(ra, rb)
        assert _same_caches(trunk_fp32, a, b)


def test_a_stop_token_ends_its_group_after_its_step():
    model = _odd_model()
    prompts = [[5, 9, 11, 2, 40], [60, 61, 62, 63]]
    with torch.no_grad():
        ref = model._decode_reference(_primed(model, prompts), [1, 2], 9, [(), ()])
        stop = int(ref[1]["tokens"][3])  # sequence 1's target at step 3
        first = next(t for t in range(9) if int(ref[1]["tokens"][t]) == stop)
        a, b = _primed(model, prompts), _primed(model, prompts)
        ra = model.decode_many(a, [1, 2], 9, [(), (stop,)], threads=1)  # one group: both stop
        rb = model._decode_reference(b, [1, 2], 9, [(), (stop,)])
        assert [q["tokens"].shape[0] for q in ra] == [q["tokens"].shape[0] for q in rb] == [first + 1] * 2
        assert _equal(ra, rb)
        assert _same_caches(model, a, b)
        a = _primed(model, prompts)  # two groups: sequence 0 runs on
        ra = model.decode_many(a, [1, 2], 9, [(), (stop,)], threads=2)
        assert [q["tokens"].shape[0] for q in ra] == [9, first + 1]
        assert torch.equal(ra[0]["tokens"], ref[0]["tokens"]) and torch.equal(
            ra[1]["tokens"], ref[1]["tokens"][: first + 1]
        )
        assert [c.pos for c in a] == [5 + 8, 4 + first]


def test_bad_calls_are_refused_before_any_cache_changes():
    model = _odd_model()
    with torch.no_grad():
        (c,) = _primed(model, [[5, 6, 7]])
        with pytest.raises(ValueError, match="context full"):
            model.decode_many([c], [1], model.cfg.max_position_embeddings, [()])
        assert c.pos == 3 and c.pending is None
        model.decode_many([c], [1], 2, [()])
        with pytest.raises(ValueError, match="pending"):
            model.decode_many([c], [1], 2, [()])
    stage = TrunkStage(model)
    stage.open([1])
    stage.prime([Rows(1, [5, 6, 7])])
    with pytest.raises(ValueError, match="anchor alone"):
        stage.decode([Rows(1, [5, 6])], 2, [()])


def _plain(engine, prompts, n):
    return [engine.generate(p, n, spec="off") for p in prompts]


def test_scheduler_plain_rounds_in_one_call_equal_rounds_one_at_a_time(
    checkpoint, trunk_fp32, tokenizer, sharegpt_prompts, monkeypatch
):
    # (prompts primed whole at admission: a burst's time is all its rounds')
    eng = Engine(checkpoint, model=trunk_fp32, tokenizer=tokenizer, max_ctx=512, prefill_budget=0)
    prompts = [tokenizer.chat_prompt(t) for t in sharegpt_prompts[:3]]
    calls = []  # (rounds, the fewest tokens a session of the call had left)
    real, sessions = eng.trunk.decode_rows, eng.sched.sessions
    left = lambda items: min(sessions[it.sid].turn_remaining for it in items)  # noqa: E731
    monkeypatch.setattr(eng.trunk, "decode_rows", lambda *a: calls.append((a[1], left(a[0]))) or real(*a))
    eng.sched.plain.round_s = 10.0  # a slow call once (a compile) must not keep later bursts from one call
    fast = _plain(eng, prompts, 40)
    # every call ran 2 rounds at least, but one for a turn's last token
    assert calls and all(n >= 2 or n == rest for n, rest in calls) and max(n for n, _ in calls) > 2, calls
    # each way a turn ends, reached inside a call: a stop id, the budget, the context end
    stop = fast[1]["token_ids"][17]
    short = Engine(checkpoint, model=trunk_fp32, tokenizer=tokenizer, max_ctx=len(prompts[2]) + 23)
    ends = [
        eng.generate(prompts[1], 40, spec="off", stop_token_ids=(stop,)),
        eng.generate(prompts[0], 29, spec="off"),
        short.generate(prompts[2], 40, spec="off"),
    ]
    assert [e["finish_reason"] for e in ends] == ["stop", "length", "context"]
    monkeypatch.setattr(eng.trunk, "decode_rows", None)  # the scheduler then runs one verify a round
    monkeypatch.setattr(short.trunk, "decode_rows", None)
    slow = _plain(eng, prompts, 40)
    slow_ends = [
        eng.generate(prompts[1], 40, spec="off", stop_token_ids=(stop,)),
        eng.generate(prompts[0], 29, spec="off"),
        short.generate(prompts[2], 40, spec="off"),
    ]
    for f, s in zip(fast + ends, slow + slow_ends):
        assert f["token_ids"] == s["token_ids"] and f["finish_reason"] == s["finish_reason"]
        assert f["rounds"] == s["rounds"] == len(f["token_ids"]) - 1 and f["top2_gaps"] == s["top2_gaps"]
    assert ends[0]["token_ids"][-1] == stop and len(ends[1]["token_ids"]) == 29
    spec = eng.generate(prompts[0], 40, spec="mtp")  # speculation still equals plain decoding
    assert spec["token_ids"] == fast[0]["token_ids"]


def test_a_paced_plain_call_ends_its_burst(checkpoint, trunk_fp32, tokenizer, sharegpt_prompts, monkeypatch):
    """A plain call that ran the rounds the burst's time left gave it at the last call's pace ends the
    burst: no short second call for the rest,
    which was mostly its fixed cost (calls of 2-3 rounds between paced ones, 62 calls for 8 turns of
    128 tokens instead of 39)."""
    eng = Engine(
        checkpoint, model=trunk_fp32, tokenizer=tokenizer, max_ctx=512, burst_ms=50.0, burst_rounds=32, prefill_budget=0
    )  # the prompt primed whole at admission: every burst's call runs rounds
    calls, bursts = [], []
    real, burst = eng.trunk.decode_rows, eng.sched.burst
    monkeypatch.setattr(eng.trunk, "decode_rows", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr(eng.sched, "burst", lambda: bursts.append(len(calls)) or burst())
    eng.sched.plain.round_s = 0.1  # a slow pace: the first burst's call is two rounds, and ends the burst
    ids = tokenizer.chat_prompt(sharegpt_prompts[2])
    out = eng.generate(ids, 40, spec="off")
    assert calls[0] == 2 and len(calls) <= len(bursts) and len(out["token_ids"]) == 40
    monkeypatch.setattr(eng.trunk, "decode_rows", None)
    assert eng.generate(ids, 40, spec="off")["token_ids"] == out["token_ids"]


def test_a_short_prompt_and_its_answer_fit_the_first_buffers(trunk_fp32):
    """A 30-token prompt and a 128-token answer decoded in calls of 32 rows write every MLA buffer in
    place: the first buffers have room (:data:`~tandem.model.cache.MIN_ENTRIES`), no doubling copy."""
    from tandem.model.cache import _MLA_DIMS, MLACache

    c = _primed(trunk_fp32, [list(range(40, 70))])[0]
    mla = [x for x in c.layers if isinstance(x, MLACache)]
    ptrs = [[m.buffer(n).data_ptr() for n in _MLA_DIMS] for m in mla]
    anchor = 5
    for _ in range(4):
        anchor = int(cpu_decode.decode_steps(trunk_fp32, [c], [anchor], 32, [()])[0]["tokens"][-1])
        c.commit(1)
    assert c.pos == 30 + 128 and ptrs == [[m.buffer(n).data_ptr() for n in _MLA_DIMS] for m in mla]


def test_row_groups_cut_in_order_at_equal_shares():
    from tandem.model.trunk import row_groups

    assert row_groups([16] * 8, 2) == [range(0, 4), range(4, 8)]
    assert row_groups([600, 10, 10], 2) == [range(0, 1), range(1, 3)]
    assert row_groups([5, 5, 5], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert row_groups([1, 1, 100], 2) == [range(0, 2), range(2, 3)]
    assert row_groups([7], 4) == [range(0, 1)] and row_groups([3, 4], 1) == [range(0, 2)]


@pytest.mark.parametrize("threads", [2, 3])
def test_prime_groups_on_threads_equal_one_forward(threads, monkeypatch):
    """Several sequences primed in ``decode_threads`` groups on threads: outputs, features and caches
    bit-identical to one forward over all of them, and the groups did run on other threads."""
    import threading

    model = _odd_model()
    prompts = [list(range(20, 45)), [5, 9, 11, 2, 40, 41, 42, 7, 8, 9, 10], [60, 61, 62], [70, 71, 72, 73, 74, 75]]
    seen = set()
    real = model._prime_rows
    monkeypatch.setattr(model, "_prime_rows", lambda *a: seen.add(threading.get_ident()) or real(*a))
    with torch.no_grad():
        outs = {}
        for n in (1, threads):
            model.decode_threads = n
            caches = [model.new_cache(model.cfg.max_position_embeddings) for _ in prompts]
            outs[n] = (model.prime_many(caches, [torch.tensor([p]) for p in prompts], (0, 2)), caches)
        (o1, c1), (on, cn) = outs[1], outs[threads]
        assert all(torch.equal(x, y) for a, b in zip(o1, on) for x, y in zip(a, b))
        for c in c1 + cn:
            c.pending, c.pending_rows = None, 0
        assert _same_caches_after_verify(model, c1, cn)
    assert len(seen) >= 2  # a group ran on a pool thread (the pool may run two groups on one)


def _same_caches_after_verify(model, a, b):
    oa = model.verify_many(a, [torch.tensor([[3, 4]])] * len(a), (1,))
    ob = model.verify_many(b, [torch.tensor([[3, 4]])] * len(b), (1,))
    return all(torch.equal(x, y) for pa, pb in zip(oa, ob) for x, y in zip(pa, pb))


def test_the_pool_threads_run_the_initializer_first():
    """A decode pool made after ``set_pool_initializer`` runs it on each of its threads before any group
    (the served trunk sets its decode threads' nice value so); the threads made before it are replaced."""
    import threading

    groups.thread_pool(1)
    ran = []
    try:
        groups.set_pool_initializer(lambda: ran.append(threading.get_ident()))
        got = groups.run_groups(lambda g: [(g, threading.get_ident())], [0, 1, 2])
        assert [g for g, _ in got] == [0, 1, 2]
        assert {t for _, t in got[1:]} <= set(ran) and ran and threading.get_ident() not in ran
    finally:
        groups.set_pool_initializer(None)
