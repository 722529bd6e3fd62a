"""The co-located stage host (``colocate``, the serving default): the drafters run in the trunk's process and a round is
one ``trunk.draft_verify`` call. Over the wire form (the ``trunk`` model's ``handle``, as served), every arm gives the
in-process engine's tokens and acceptance, no hidden row on the wire, nothing kept after a close; bad requests name the field."""

from __future__ import annotations

import numpy as np
import pytest

from tandem import schema
from tandem.engine.accept import accept_walk
from tandem.engine.colocated import StageHost
from tandem.engine.inprocess import Engine
from tandem.engine.protocols import DecodedRounds, RoundsPlan, Rows
from tandem.engine.sampling import SamplingParams
from tandem.engine.scheduler import Scheduler, Turn
from tandem.engine.trunk_stage import TrunkStage
from tandem.serving import front as fr

from test_dflash import _Tok, tiny  # noqa: F401 - the tiny trunk + drafters fixture
from test_prefix import _ids, _run

C = schema.PREFIX_BLOCK


class _Spy:
    """A transport that records every call's model, op and arrays (in and out)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, model, op, arrays):
        out = self.inner(model, op, arrays)
        self.calls.append((model.name, op, arrays, out))
        return out


def hosted(eng: Engine, run_ahead: bool = False, pipeline: bool = False, pipeline_delay_s: float = 0.02, **config):
    """A scheduler over the served wiring with ``colocate`` on: the trunk model's wire form (a
    :class:`StageHost` over ``eng``'s trunk and drafters, shared weights; ``run_ahead`` as served)
    behind a spying transport (``pipeline``: through a :class:`~tandem.engine.pipeline.Pipeline`, as
    served by default; each next call sent ``pipeline_delay_s`` after the call it continues, long
    enough for the other thread here). Returns (scheduler, host, spy)."""
    dflash = {a: st.drafters[a] for a, st in eng.drafters.items() if a in schema.DFLASH_ARMS}
    host = StageHost.build(
        TrunkStage(eng.model, eng.config.max_ctx, eng.trunk.feature_layers, eng.config.batch_invariant),
        dflash,
        eng.config.max_num_draft_tokens,
        run_ahead=run_ahead,
    )
    spy = _Spy(fr.LocalTransport({"trunk": host}))
    tr = fr.Pipeline(spy, pipeline_delay_s) if pipeline else spy
    to_drafters = fr.HostedTransport(tr)
    dfl = fr.DFlashProxy(to_drafters)
    drafters = {schema.MTP: fr.DrafterProxy(to_drafters), **{a: dfl for a in dflash}}
    cfg = eng.config if not config else type(eng.config)(**{**eng.config.__dict__, **config})
    sched = Scheduler(
        fr.TrunkProxy(tr, eng.model.cfg.vocab_size, hosted=True), drafters, cfg, stop_ids=eng.tokenizer.stop_ids
    )
    return sched, host, spy


@pytest.mark.parametrize("arm", schema.SPECS)
def test_every_arm_equals_the_engine_one_call_a_round(shipped, tokenizer, sharegpt_prompts, arm):
    """Greedy, shipped checkpoint: tokens, rounds and accepted drafts equal the in-process engine's
    (drafter and trunk calls apart), the output equals plain decoding, a burst's rounds are one trunk
    call (``burst_ms`` 0: bursts by rounds only), and no hidden or feature row crosses the wire either way."""
    sched, host, spy = hosted(shipped, burst_ms=0.0, burst_rounds=4)
    for sid, text in enumerate(sharegpt_prompts[:2], 1):
        ids = tokenizer.chat_prompt(text)
        ref, plain = shipped.generate(ids, 48, spec=arm), shipped.generate(ids, 48, spec="off")
        spy.calls.clear()
        out, receipts = _run(sched, sid, ids, 48, arm)
        assert out == ref["token_ids"] == plain["token_ids"]
        assert sum(r.rounds for r in receipts) == ref["rounds"] and sum(r.accepted for r in receipts) == ref["accepted"]
        if arm != schema.OFF:
            assert ref["accepted"] > 0  # the drafts were real
        ops = [op for _, op, _, _ in spy.calls]
        rounds_per_call = [int(res["ROUNDS_RUN"][0]) for _, op, _, res in spy.calls if op == "draft_verify"]
        assert sum(rounds_per_call) == ref["rounds"] and "verify" not in ops and "draft" not in ops
        # admission is one call (the prime opens the trunk and drafter state) and so is the close
        assert ops[0] == "prime" and ops[-1] == "close" and ops.count("close") == 1
        assert not any(o.endswith("open") or o.startswith("drafter_") for o in ops), ops
        assert spy.calls[0][2][schema.SPEC].tolist() == [arm.encode()]
        # a burst's rounds in one call (fewer where the demotion policy could change the plan)
        assert max(rounds_per_call) == sched.config.burst_rounds and len(rounds_per_call) < ref["rounds"]
        assert all(m == "trunk" for m, _, _, _ in spy.calls)
        for _, op, args, res in spy.calls:
            assert "FEATURES" not in args and "HIDDEN" not in args
            assert (
                res.get("HIDDEN", np.zeros((0, 0))).shape[-1] == 0
                and res.get("FEATURES", np.zeros((0, 0))).shape[-1] == 0
            )
    assert not host.ingest and not host.pending and not host.trunk.caches  # closed with the sessions
    assert all(not st.states for st in host.by_model.values())


@pytest.mark.parametrize("arm", [schema.OFF, schema.DFLASH2])
def test_a_burst_ends_after_burst_ms(shipped, tokenizer, sharegpt_prompts, arm):
    """``burst_ms``: each ``draft_verify`` is told the burst's time left (``BURST_MS``) and a burst ends
    at the first round boundary after it, on both paths (co-located calls and per-round calls): with
    ~0 ms every burst is one round, with a long one a burst's rounds; the tokens never change."""
    ids = tokenizer.chat_prompt(sharegpt_prompts[3])
    plain = shipped.generate(ids, 40, spec="off")["token_ids"]
    for ms, one_round in ((1e-3, True), (1e4, False)):
        sched, _, spy = hosted(shipped, burst_ms=ms, burst_rounds=8)
        out, receipts = _run(sched, 1, ids, 40, arm)
        calls = [(args, res) for _, op, args, res in spy.calls if op == "draft_verify"]
        assert out == plain and all(float(a["BURST_MS"][0]) <= ms for a, _ in calls)
        assert (max(r.rounds for r in receipts) == 1) == one_round
        assert (max(int(r["ROUNDS_RUN"][0]) for _, r in calls) == 1) == one_round
        eng = Engine(
            model=shipped.model,
            tokenizer=tokenizer,
            dflash={a: shipped.drafters[a].drafters[a] for a in schema.DFLASH_ARMS},
            burst_ms=ms,
            burst_rounds=8,
        )  # per-round calls (colocate off / in-process)
        out, receipts = _run(eng.sched, 1, ids, 40, arm)
        assert out == plain and (max(r.rounds for r in receipts) == 1) == one_round
    with pytest.raises(ValueError, match="burst_ms must be >= 0"):
        schema.ServingConfig(burst_ms=-1.0)


def test_sampled_rejection_and_multi_turn_equal_the_engine(shipped, tokenizer, sharegpt_prompts):
    """A seeded rejection-sampled MTP turn, then a second turn of the same session: the same tokens
    as the engine's (the session-owned Philox counters), with the previous turn's last commit riding
    on the next prime."""
    sched, host, _ = hosted(shipped)
    ids = tokenizer.chat_prompt(sharegpt_prompts[2])
    p = SamplingParams.create(0.8, 0, 1.0, 11, schema.REJECTION)
    runs = []
    for s in (sched, shipped.sched):
        got = []
        s.admit([Turn(7, list(ids), 24, lambda r, e, f: got.append((r, e)), spec="mtp", sampling=p, end=False)])
        while 7 in s.turns:
            s.burst()
        more = tokenizer.chat_prompt("And then?", later=True)
        s.admit([Turn(7, more, 16, lambda r, e, f: got.append((r, e)), spec="mtp", start=False)])
        while 7 in s.turns:
            s.burst()
        assert all(e is None for _, e in got), got
        runs.append([t for r, _ in got for t in r.tokens])
    assert runs[0] == runs[1] and len(runs[0]) == 40
    assert not host.ingest and not host.trunk.caches


def test_prefix_cache_warm_equals_cold_hosted(tiny):  # noqa: F811
    """The prefix cache with the drafter tails in the trunk's process: a warm start skips the
    published blocks (trunk state and drafter tail) and gives the cold run's tokens."""
    trunk, drafters = tiny
    eng = Engine(model=trunk, tokenizer=_Tok(), dflash=drafters, max_ctx=256, demote_probe_rounds=0, burst_rounds=2)
    sched, host, spy = hosted(eng)
    ids = _ids(C + 50, 31)
    cold, _ = _run(sched, 1, ids, 30, "dflash")
    spy.calls.clear()
    warm, _ = _run(sched, 2, ids, 30, "dflash")
    ref, _ = _run(eng.sched, 3, ids, 30, "dflash")
    assert cold == warm == ref and sched.prefix.stats["hits"] == 1
    assert set(host.trunk.blocks) == set(sched.prefix.entries) == {k for _, k in host.drafters["dflash"].tails}
    prime = next(a for _, op, a, _ in spy.calls if op == "prime")
    assert len(prime["TOKENS"]) == len(ids) - C  # the first block was restored, not primed


def _plan(arm, k, rounds=1, budget=100, stop_ids=(), room=200):
    return RoundsPlan(arm, k, rounds, budget, stop_ids, room)


def test_bad_requests_name_the_field(tiny):  # noqa: F811
    trunk, drafters = tiny
    host = StageHost.build(TrunkStage(trunk, 256, (1, 3)), drafters)
    proxy = fr.TrunkProxy(tr := fr.LocalTransport({"trunk": host}), 512, hosted=True)
    proxy.open([1, 2])
    dfl = fr.DFlashProxy(fr.HostedTransport(tr))
    dfl.open([1])
    proxy.prime([Rows(1, [5, 6, 7]), Rows(2, [8, 9])])
    dv = proxy.draft_verify_rounds
    with pytest.raises(fr.StageError, match="SIDS: sequence 2 has no dflash drafter state"):
        dv([Rows(2, [4])], [_plan("dflash", 3)])
    dfl.open([2])
    with pytest.raises(fr.StageError, match="SIDS: sequence 2 has no committed rows its dflash drafter has not seen"):
        dv([Rows(2, [4])], [_plan("dflash", 3)])
    with pytest.raises(fr.StageError, match=r"NUM_DRAFT_TOKENS must be in \[0, 8\], got 9"):
        dv([Rows(1, [4])], [_plan("dflash", 9)])
    with pytest.raises(fr.StageError, match="SIDS: unknown sequence id 3"):
        dv([Rows(3, [4])], [_plan(None, 0)])
    with pytest.raises(fr.StageError, match="SPEC must be one of"):
        dv([Rows(1, [4])], [_plan("medusa", 2)])
    with pytest.raises(fr.StageError, match=r"ROUNDS needs one entry >= 1 per SIDS \(1\), got \[0\]"):
        dv([Rows(1, [4])], [_plan("dflash", 2, rounds=0)])
    bad = {
        "OP": schema.string_array("draft_verify"),
        "SIDS": schema.sids_to_wire([1]),
        "TOKENS": np.array([4]),
        schema.NUM_DRAFT_TOKENS: np.array([2], np.int32),
        schema.SPEC: np.array([b"dflash"], dtype=object),
        "STOP_IDS": np.array([7, 8]),
        "STOP_LENGTHS": np.array([1], np.int32),
    }
    with pytest.raises(
        schema.WireError, match=r"STOP_LENGTHS \[1\] must hold one count >= 0 per SIDS \(1\) summing to the 2"
    ):
        host.handle(bad)
    with pytest.raises(schema.WireError, match=r"BURST_MS must be >= 0.0, got -1.0"):
        host.handle({**bad, "STOP_LENGTHS": np.array([2], np.int32), "BURST_MS": np.array([-1.0], np.float32)})
    nxt = proxy.draft_verify_next
    with pytest.raises(fr.StageError, match=r"CALL: draft_verify_next is not the call after 6 .*last call: none"):
        nxt(7, [1, 2], [1, 1], None)
    got = dv([Rows(1, [4]), Rows(2, [4])], [_plan("dflash", 3), _plan(None, 0)], number=7)
    assert [[len(d) for _, d, _ in per] for per in got] == [[3], [0]] and [len(got[0][0][2].argmax)] == [4]
    for number, sids, msg in (
        (7, [1, 2], "after 6 .*last call: call 7 over 2"),
        (8, [2, 1], "after 7 over these SIDS"),
    ):
        with pytest.raises(fr.StageError, match="CALL: draft_verify_next is not the call " + msg):
            nxt(number, sids, [1, 1], None)  # refused: nothing ran (the walk's anchors are still next)
    cont = nxt(8, [1, 2], [2, 1], None)  # continues call 7 from the anchors its walks chose
    assert [len(per) for per in cont] == [2, 1] and cont[1][0][0] == int(got[1][0][2].argmax[0])
    with pytest.raises(schema.WireError, match="CALL: draft_verify_next needs the number of the call it is"):
        host.handle({"OP": schema.string_array("draft_verify_next"), "SIDS": schema.sids_to_wire([1, 2])})
    proxy.probe()  # a health probe (a close of no sequence) between two calls moves nothing, nor do refusals:
    assert [len(per) for per in nxt(9, [1, 2], [1, 1], None)] == [1, 1]
    with pytest.raises(fr.StageError, match="OP: draft_verify for sequence 1 while a verify is pending"):
        dv([Rows(1, [4])], [_plan(None, 0)])
    proxy.close([1, 2])
    assert not host.ingest and not host.pending
    bare = fr.LocalTransport({"trunk": StageHost(TrunkStage(trunk, 256), {})})
    with pytest.raises(fr.StageError, match="OP 'drafter_dflash.open': this trunk hosts no drafter_dflash"):
        fr.DFlashProxy(fr.HostedTransport(bare)).open([1])
    bare_trunk = fr.TrunkProxy(bare, 512, hosted=True)
    for opens, msg in (
        (["medusa"], r"SPEC on prime: one of .* or '' per SIDS \(1\), got \('medusa',\)"),
        (["mtp", ""], r"SPEC on prime: .* per SIDS \(1\)"),
        (["mtp"], "SPEC: 'mtp' is not hosted here"),
    ):
        with pytest.raises(fr.StageError, match=msg):
            bare_trunk.prime([Rows(9, [5, 6])], opens)
    assert bare_trunk.prime([Rows(9, [5, 6])], ["off"])[0].argmax.shape == (2,)  # opened and primed in one call
    plain = fr.TrunkProxy(fr.LocalTransport({"trunk": TrunkStage(trunk, 256)}), 512, hosted=True)
    plain.open([1])
    plain.prime([Rows(1, [5, 6])])
    with pytest.raises(fr.StageError, match="this trunk does not run the drafters .* colocate is false"):
        plain.draft_verify_rounds([Rows(1, [4])], [_plan(None, 0)])


@pytest.mark.parametrize("run_ahead", [False, True])
def test_several_rounds_a_call_end_where_each_turn_ends(shipped, checkpoint, tokenizer, sharegpt_prompts, run_ahead):
    """Sessions of every arm together, with budgets, a stop token and a near-full context that end
    them in different rounds of a call, and one with a stop string (one round a call): each gives the
    in-process engine's tokens and finish reason, and a call's rounds stop where its turn ends. With
    ``run_ahead`` the same, with calls answered ahead and guesses undone (a turn cut by its stop string)."""
    eng = Engine(
        checkpoint,
        model=shipped.model,
        tokenizer=shipped.tokenizer,
        demote_probe_rounds=0,
        max_ctx=160,
        burst_ms=0.0,
        burst_rounds=4,
        dflash={a: shipped.drafters[a].drafters[a] for a in schema.DFLASH_ARMS},
    )
    sched, host, spy = hosted(eng, run_ahead)
    ids = [tokenizer.chat_prompt(t) for t in sharegpt_prompts[3:8]]
    stop_tok = shipped.generate(ids[1], 12, spec="off")["token_ids"][9]  # its 10th token ends that turn
    cases = [
        (ids[0], 37, "dflash2", (), ()),
        (ids[1], 40, "mtp", (stop_tok,), ()),
        (ids[2], 200, "dflash", (), ()),
        (ids[3], 30, "off", (), ()),
        (ids[4], 30, "dflash2", (), (".",)),
    ]
    cases[2] = ((ids[2] * 4)[:110], 150, "dflash", (), ())  # the context fills: 110 prompt rows of 160
    want = [eng.generate(p, n, spec=a, stop_token_ids=st, stop=ss) for p, n, a, st, ss in cases]
    got = {i: [] for i in range(len(cases))}
    fin = {}

    def emit(i):
        def f(r, e, final):
            assert e is None, e
            got[i].extend(r.tokens)
            if final:
                fin[i] = r.finish_reason

        return f

    sched.decode = tokenizer.decode
    sched.admit(
        [
            Turn(100 + i, list(p), n, emit(i), spec=a, stop_token_ids=st, stop=ss)
            for i, (p, n, a, st, ss) in enumerate(cases)
        ]
    )
    while sched.turns:
        sched.burst()
    for i, w in enumerate(want):
        assert got[i] == w["token_ids"] and fin[i] == w["finish_reason"], (i, cases[i][2])
    assert [fin[i] for i in range(4)] == ["length", "stop", "context", "length"]
    runs = [res["ROUNDS_RUN"].tolist() for _, op, _, res in spy.calls if op == "draft_verify"]
    assert max(max(r) for r in runs) == sched.config.burst_rounds and min(min(r) for r in runs) >= 1
    if run_ahead:
        assert host.ahead.hits > 0 and host.ahead.misses > 0 and not host.ahead.busy, (
            host.ahead.hits,
            host.ahead.misses,
        )


def test_run_ahead_undoes_a_guess_that_missed(shipped, tokenizer, sharegpt_prompts):
    """A trunk that runs ahead answers the same calls as one that does not, bit for bit: calls it
    guessed (answered ahead), a smaller commit than its guess (a turn cut by a stop string), another
    draft count, another op while it runs (a close); after each miss the states it touched are back,
    so every later call agrees too."""
    dflash = {a: shipped.drafters[a].drafters[a] for a in schema.DFLASH_ARMS}
    prompts = [tokenizer.chat_prompt(t) for t in sharegpt_prompts[:2]]

    def script(host):
        tr = fr.LocalTransport({"trunk": host})
        proxy, dfl = fr.TrunkProxy(tr, 8192, hosted=True), fr.DFlashProxy(fr.HostedTransport(tr))
        proxy.open([1, 2])
        dfl.open([1])
        outs = proxy.prime([Rows(1, prompts[0]), Rows(2, prompts[1])])
        items = [Rows(s, [int(o.argmax[-1])]) for s, o in zip((1, 2), outs)]
        plans = [_plan("dflash", 3, rounds=2, room=900), _plan(None, 0, rounds=2, room=900)]
        seen, r = [], None  # r: the call with a smaller commit; then r+1 a new k, a close before r+3, r+4 the last
        while r is None or len(seen) < r + 5:
            res = proxy.draft_verify_rounds(items, plans)  # (a plain sequence's rounds whole:)
            assert all(isinstance(per, DecodedRounds) == (p.arm is None) for per, p in zip(res, plans))
            seen.append([[(a, d, o.argmax.tolist()) for a, d, o in per] for per in res])
            nxt, i = [], len(seen)  # the next call's index, made as the scheduler makes it
            for it, p, per in zip(items, plans, res):
                walks = [accept_walk(d, o.argmax.tolist(), (), 10**6) for _, d, o in per]
                m, k = len(walks[-1].emitted), p.k
                if it.sid == 1 and r is None and i > 1 and m > 1:
                    m, r = m - 1, i  # a smaller commit than the guess (a stop string's cut)
                if it.sid == 1 and r is not None and i == r + 1:
                    k = 2  # another draft count
                used = sum(len(w.emitted) for w in walks[:-1]) + m
                nxt.append(
                    (
                        Rows(it.sid, [walks[-1].emitted[m - 1]], commit=m),
                        _plan(p.arm, k, p.rounds, p.budget - used, (), p.room - used),
                    )
                )
            items, plans = [x for x, _ in nxt], [y for _, y in nxt]
            if r is not None and i == r + 3:  # while the guessed call of both runs ahead
                proxy.close([2])
                items, plans = items[:1], plans[:1]
        return seen

    want = script(StageHost.build(TrunkStage(shipped.model, 1024, shipped.trunk.feature_layers), dflash))
    host = StageHost.build(TrunkStage(shipped.model, 1024, shipped.trunk.feature_layers), dflash, run_ahead=True)
    assert script(host) == want
    # missed: the smaller commit, the new k, the close; answered ahead: the calls between and the last
    assert host.ahead.misses == 3 and host.ahead.hits >= 3, (host.ahead.hits, host.ahead.misses)
    host.ahead.settle()


def test_demotion_sees_the_load_per_round_calls_would(tiny):  # noqa: F811
    """Load-sensitive demotion costs, one session with a stop string (one round a call) beside one
    without: the hosted bursts give the same rounds, speculative rounds and demotions as per-round
    calls (the policy counts every session still active in each round, not those in the call). Bursts
    by rounds only (``burst_ms`` 0), so both sides' bursts are the same rounds."""
    trunk, drafters = tiny
    eng = Engine(
        model=trunk,
        tokenizer=_Tok(),
        dflash=drafters,
        max_ctx=256,
        round_cost_dflash=1.0,
        demote_load_slope=1.0,
        demote_below=0.9,
        promote_above=5.0,
        burst_ms=0.0,
        burst_rounds=4,
    )
    sched, _, _ = hosted(eng)
    ids = _ids(20, 1)
    runs = []
    for s in (eng.sched, sched):
        s.decode = lambda toks: " ".join(map(str, toks))
        got = {1: [0, 0, []], 2: [0, 0, []]}

        def em(i):
            def f(r, e, final):
                assert e is None, e
                got[i][0] += r.rounds
                got[i][1] += r.spec_rounds
                got[i][2] += r.tokens

            return f

        s.admit([Turn(1, ids, 40, em(1), spec="dflash"), Turn(2, ids[:15], 40, em(2), spec="dflash", stop=("zzzz",))])
        while s.turns:
            s.burst()
        runs.append((got, s.stats["demotions"], s.stats["promotions"]))
    assert runs[0] == runs[1] and runs[0][1] > 0


def test_hosted_draft_requests_are_checked_before_any_change(tiny):  # noqa: F811
    trunk, drafters = tiny
    host = StageHost.build(TrunkStage(trunk, 64, (1, 3)), drafters, max_num_draft_tokens=4)
    tr = fr.LocalTransport({"trunk": host})
    proxy, dfl = fr.TrunkProxy(tr, 512, hosted=True), fr.DFlashProxy(fr.HostedTransport(tr))
    proxy.open([1])
    dfl.open([1])
    proxy.prime([Rows(1, [5, 6, 7])])
    dv = proxy.draft_verify_rounds
    dv([Rows(1, [4])], [_plan("dflash", 2, room=60)])  # the drafter's arm is now dflash
    before = (host.trunk.caches[1].pending_rows, len(host.ingest[1].outs), host.drafters["dflash"].covered_rows(1))
    with pytest.raises(fr.StageError, match="SPEC: sequence 1 drafts with dflash, not dflash2"):
        dv([Rows(1, [4], commit=1)], [_plan("dflash2", 2, room=59)])
    with pytest.raises(fr.StageError, match=r"NUM_DRAFT_TOKENS must be in \[0, 4\], got 5"):  # this host's maximum
        dv([Rows(1, [4], commit=1)], [_plan("dflash", 5, room=59)])
    with pytest.raises(fr.StageError, match="ROOM: 500 for sequence 1 exceeds the 60 rows its trunk cache has left"):
        dv([Rows(1, [4], commit=1)], [_plan("dflash", 2, room=500)])
    assert (
        host.trunk.caches[1].pending_rows,
        len(host.ingest[1].outs),
        host.drafters["dflash"].covered_rows(1),
    ) == before
    assert (
        dv([], []) == []
        and host.handle(
            {"OP": schema.string_array("draft_verify"), "SIDS": np.zeros(0, np.int64), "TOKENS": np.zeros(0, np.int64)}
        )["ROUNDS_RUN"].size
        == 0
    )


def test_served_with_colocate_off_takes_the_drafter_models(shipped, checkpoint, tokenizer, tmp_path):
    """A real tritonserver with ``colocate=false`` (``$TANDEM_COLOCATE``, both models read it): the
    drafter models draft (two calls a round, the BLS statistics logged at unload say which), with the
    engine's tokens."""
    from tandem.serving.serve import running_server
    from tandem_client.client import generate

    ids = tokenizer.chat_prompt("Write a short poem about the sea.")
    env = {"TANDEM_CHECKPOINT": str(checkpoint.resolve()), "TANDEM_COLOCATE": "false", "TANDEM_PREFIX_CACHE_MB": "0"}
    log = tmp_path / "server.log"
    with running_server(env=env, ready_timeout_s=240, log_path=log) as srv:
        for arm in ("dflash2", "mtp"):
            got, ref = generate(ids, 24, url=srv.grpc_url, spec=arm), shipped.generate(ids, 24, spec=arm)
            assert got["token_ids"] == ref["token_ids"] and got["accepted"] > 0
    text = log.read_text(errors="replace")
    assert "drafters hosted: none (colocate off)" in text
    calls = text[text.index("tandem: BLS calls") :]
    assert "'drafter_dflash.draft'" in calls and "'drafter_mtp.draft'" in calls and "draft_verify" not in calls


def test_served_with_run_ahead_answers_ahead_with_the_engines_tokens(shipped, checkpoint, tokenizer, tmp_path):
    """A real tritonserver with ``run_ahead`` on (``$TANDEM_RUN_AHEAD``): every arm gives the engine's
    tokens, and the trunk's log at unload counts calls answered ahead."""
    import re

    from tandem.serving.serve import running_server
    from tandem_client.client import generate

    ids = tokenizer.chat_prompt("Write a short poem about the sea.")
    env = {
        "TANDEM_CHECKPOINT": str(checkpoint.resolve()),
        "TANDEM_RUN_AHEAD": "true",
        "TANDEM_PIPELINE": "false",
        "TANDEM_PREFIX_CACHE_MB": "0",
    }
    log = tmp_path / "server.log"
    with running_server(env=env, ready_timeout_s=240, log_path=log) as srv:
        for arm in ("dflash2", "dflash", "off"):
            got, ref = generate(ids, 64, url=srv.grpc_url, spec=arm), shipped.generate(ids, 64, spec=arm)
            assert got["token_ids"] == ref["token_ids"], arm
    text = log.read_text(errors="replace")
    assert ", run_ahead" in text
    hits = re.search(r"run-ahead (\d+) hits", text)
    assert hits and int(hits.group(1)) > 0, text[-3000:]
