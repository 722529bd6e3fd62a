"""Pipelined ``draft_verify`` calls (``pipeline``, the serving default with ``colocate``): while the
trunk runs a call, the next one (``draft_verify_next``) is already sent and continues the same
sequences from where the trunk's walks leave them. Same tokens, rounds and acceptance as calls made
one at a time, in-process over the wire form and on a real server."""

from __future__ import annotations

import pytest

from tandem import schema
from tandem.engine.protocols import Rows
from tandem.engine.scheduler import Turn

from test_colocated import hosted


def test_served_pipeline_sends_each_next_call_ahead(shipped, checkpoint, tokenizer, tmp_path):
    """A real tritonserver with ``pipeline`` on (the default): two concurrent sessions per arm get the
    engine's tokens, most ``draft_verify`` calls are pipelined ``draft_verify_next`` calls, and the
    metric ``tandem_pipelined_calls_total`` and the tandem log at unload count them (refused: ones
    that reached the trunk before their predecessor)."""
    import ast
    import re
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tandem.serving.observe import scrape
    from tandem.serving.serve import running_server
    from tandem_client.client import generate

    prompts = [tokenizer.chat_prompt(t) for t in ("Write a short poem about the sea.", "Name three colours.")]
    log = tmp_path / "server.log"
    with (
        running_server(
            env={"TANDEM_CHECKPOINT": str(checkpoint.resolve()), "TANDEM_PREFIX_CACHE_MB": "0"},
            ready_timeout_s=240,
            log_path=log,
        ) as srv,
        ThreadPoolExecutor(2) as pool,
    ):
        for arm in ("dflash2", "off"):
            got = list(pool.map(lambda ids: generate(ids, 64, url=srv.grpc_url, spec=arm), prompts))
            assert [g["token_ids"] for g in got] == [
                shipped.generate(ids, 64, spec=arm)["token_ids"] for ids in prompts
            ]
        deadline = time.monotonic() + 10  # the metrics are published about once a second
        while not (
            seen := sum(
                v for (name, _), v in scrape(srv.metrics_port).items() if name == "tandem_pipelined_calls_total"
            )
        ):
            assert time.monotonic() < deadline, "tandem_pipelined_calls_total never moved"
            time.sleep(0.25)
    text = log.read_text(errors="replace")
    counts = ast.literal_eval(re.search(r"; pipelined (\{[^}]*\})", text).group(1))
    calls = ast.literal_eval(re.search(r"tandem: BLS calls (\{.*\}); pipelined", text).group(1))
    assert counts["calls"] >= 4 and counts["refused"] <= counts["calls"] // 4, counts
    assert calls["trunk.draft_verify_next"]["calls"] == counts["calls"] >= seen


@pytest.mark.parametrize("arm", [schema.OFF, schema.DFLASH2, schema.MTP])
def test_pipelined_calls_equal_calls_one_at_a_time(shipped, tokenizer, sharegpt_prompts, arm):
    """``pipeline`` (the serving default): while the trunk runs a call, the next one
    (``draft_verify_next``, continuing the same sequences from where the trunk's walk leaves them) is
    already sent. Two concurrent sessions get the tokens, rounds and accepted drafts of the same
    scheduler without a pipeline (and plain decoding's tokens), most calls are pipelined, and a
    pipelined call only ever runs right after the call it continues."""
    ids = [tokenizer.chat_prompt(t) for t in sharegpt_prompts[:2]]
    runs = []
    for pipeline in (False, True):
        sched, host, spy = hosted(shipped, pipeline=pipeline, burst_ms=0.0, burst_rounds=3)
        got = {1: [], 2: []}
        sched.admit(
            [
                Turn(sid, x, 40, lambda r, e, f, sid=sid: got[sid].append((r, e)), spec=arm)
                for sid, x in zip((1, 2), ids)
            ]
        )
        while sched.turns:
            sched.burst()
        assert not [e for sid in got for _, e in got[sid] if e]
        runs.append(
            [
                (
                    [t for r, _ in got[sid] for t in r.tokens],
                    sum(r.rounds for r, _ in got[sid]),
                    sum(r.accepted for r, _ in got[sid]),
                )
                for sid in (1, 2)
            ]
        )
        assert not host.trunk.caches
    assert runs[0] == runs[1]
    assert [t for t, _, _ in runs[1]] == [shipped.generate(x, 40, spec="off")["token_ids"] for x in ids]
    pipe = sched.trunk.pipeline
    ops = [(op, a.get("CALL")) for _, op, a, _ in spy.calls]
    nexts = [i for i, (op, _) in enumerate(ops) if op == "draft_verify_next"]
    assert len(nexts) >= 3 and pipe.counts["refused"] == 0 and pipe.queued is None, (pipe.counts, [op for op, _ in ops])
    for i in nexts:  # the call it continues ran just before it
        assert ops[i - 1][0] in ("draft_verify", "draft_verify_next") and int(ops[i - 1][1][0]) == int(ops[i][1][0]) - 1
    # none is sent after a call sure to end every turn (plain: a round a token; it would run no round)
    assert arm != schema.OFF or all(
        res["ROUNDS_RUN"].max() > 0 for _, op, _, res in spy.calls if op == "draft_verify_next"
    )


def test_a_next_call_runs_only_over_every_active_session_and_never_replays_on_a_reused_id(
    shipped, tokenizer, sharegpt_prompts
):
    """A pipelined call is chained only over every active session (else the others would wait for the
    chain to end); its rounds are replayed only on the session it continued: a sequence id closed
    (its END refused while a turn ran) and opened again meanwhile is another session, whose turn gets
    plain decoding's tokens; dropping every session drops the calls in flight."""
    arm = schema.DFLASH2
    # (both prompts primed whole at their admission, so both decode from the first burst: under a prefill
    # budget the shorter one would finish its 40 tokens while the other is still being primed)
    sched, host, _ = hosted(shipped, pipeline=True, burst_ms=0.0, burst_rounds=3, prefill_budget=0)
    pipe = sched.trunk.pipeline
    a, b = (tokenizer.chat_prompt(t) for t in sharegpt_prompts[2:4])
    got: dict[str, list] = {"a": [], "end": [], "b": [], "c": []}
    sched.admit(
        [
            Turn(1, a, 40, lambda r, e, f: got["a"].append((r, e)), spec=arm),
            Turn(2, b, 40, lambda r, e, f: got["c"].append((r, e)), spec=arm),
        ]
    )
    for _ in range(4):  # (the first burst publishes the prompts' prefix blocks: not chained)
        if pipe.queued is None:
            sched.burst()
    s1, s2 = sched.sessions[1], sched.sessions[2]
    assert pipe.queued is not None and sched._may_chain([s1, s2]) and not sched._may_chain([s1])
    sched.admit([Turn(1, [5], 4, lambda r, e, f: got["end"].append((r, e)), start=False, end=True)])
    assert got["end"][0][1] and got["a"][-1][1] and 1 not in sched.sessions  # refused; END closed sequence 1
    sched.admit([Turn(1, b, 24, lambda r, e, f: got["b"].append((r, e)), spec=arm)])
    while 1 in sched.turns:
        sched.burst()
    assert [e for _, e in got["b"] if e] == []
    assert [t for r, _ in got["b"] for t in r.tokens] == shipped.generate(b, 24, spec="off")["token_ids"]
    sched.admit([Turn(3, a, 40, lambda r, e, f: got["c"].append((r, e)), spec=arm)])
    for _ in range(4):
        if pipe.queued is None:
            sched.burst()
    assert 3 in sched.turns and pipe.queued is not None
    sched.forget_all("gone")
    assert pipe.queued is None and got["c"][-1][1] == "gone"
    assert not host.trunk.caches


def _alone(shipped, ids, pipeline, **turn):
    """One turn admitted alone (bursts of 3 rounds, by rounds only): (tokens, rounds, accepted, ops, scheduler, host)."""
    sched, host, spy = hosted(shipped, pipeline=pipeline, burst_ms=0.0, burst_rounds=3)
    sched.decode = shipped.tokenizer.decode  # (stop strings)
    got = []
    sched.admit([Turn(1, ids, 40, lambda r, e, f: got.append((r, e)), **turn)])
    while sched.turns:
        sched.burst()
    assert not [e for _, e in got if e]
    rs = [r for r, _ in got]
    ops = [(op, int(a["CALL"][0]) if "CALL" in a else None) for _, op, a, _ in spy.calls]
    return [t for r in rs for t in r.tokens], sum(r.rounds for r in rs), sum(r.accepted for r in rs), ops, sched, host


@pytest.mark.parametrize("arm,sampled", [(schema.OFF, False), (schema.MTP, True), (schema.DFLASH2, False)])
def test_a_lone_turns_first_burst_call_continues_its_prime(shipped, tokenizer, sharegpt_prompts, arm, sampled):
    """A turn admitted with no other session generating: its first burst call is sent right after its
    prime, before the prime answers (a ``draft_verify_next`` numbered after the prime, carrying the round
    program; the trunk takes the anchor from the prime's first token). Tokens, rounds and accepted drafts
    equal the same scheduler's without a pipeline; nothing is refused or left in flight."""
    from tandem.engine.sampling import SamplingParams

    ids = tokenizer.chat_prompt(sharegpt_prompts[4])
    turn = {"spec": arm, "sampling": SamplingParams.create(0.8, 0, 0.95, seed=11) if sampled else None}
    want, got = _alone(shipped, ids, False, **turn), _alone(shipped, ids, True, **turn)
    assert got[:3] == want[:3] and len(got[0]) == 40
    ops, pipe = got[3], got[4].trunk.pipeline
    assert ops[:2] == [("prime", 1), ("draft_verify_next", 2)], ops[:4]
    assert pipe.counts["refused"] == 0 and pipe.queued is None and not got[5].trunk.caches
    if not sampled:
        assert got[0] == shipped.generate(ids, 40, spec="off")["token_ids"]


def test_a_prime_continuation_stops_where_the_first_token_ends_the_turn(shipped, tokenizer, sharegpt_prompts):
    """The first token is a stop id: the turn ends with it and the call sent after the prime runs no
    round; a turn with stop strings (only this side can cut them) gets no call after its prime."""
    ids = tokenizer.chat_prompt(sharegpt_prompts[5])
    first = shipped.generate(ids, 1, spec="off")["token_ids"][0]
    toks, rounds, _, ops, sched, host = _alone(shipped, ids, True, spec=schema.OFF, stop_token_ids=(first,))
    assert toks == [first] and rounds == 0 and ops[:2] == [("prime", 1), ("draft_verify_next", 2)]
    assert sched.trunk.pipeline.queued is None and sched.trunk.pipeline.counts["refused"] == 0 and not host.trunk.caches
    toks, _, _, ops, _, _ = _alone(shipped, ids, True, spec=schema.OFF, stop=("zzqx",))
    assert ops[0] == ("prime", None) and ops[1][0] == "draft_verify" and len(toks) == 40


def test_a_next_call_after_a_prime_is_checked(shipped, tokenizer, sharegpt_prompts):
    """On the trunk's side: a ``draft_verify_next`` continuing a prime over other SIDS is refused naming
    the prime, and one without the round program is refused naming the field; neither changes anything."""
    import numpy as np

    from tandem.engine.pipeline import NOT_NEXT
    from tandem.serving import front as fr

    _, host, _ = hosted(shipped)
    tr = fr.LocalTransport({"trunk": host})
    ids = tokenizer.chat_prompt(sharegpt_prompts[6])
    fr.TrunkProxy(tr, shipped.model.cfg.vocab_size, hosted=True).prime([Rows(1, ids)], opens=["off"], number=7)
    pos = host.trunk.caches[1].pos
    base = {
        "OP": schema.string_array("draft_verify_next"),
        "ROUNDS": np.array([2], np.int32),
        "CALL": np.array([8], np.int64),
    }
    with pytest.raises(schema.WireError, match=f"{NOT_NEXT} 7 over these SIDS .*last call: prime 7 over 1 sequences"):
        host.handle({**base, "SIDS": schema.sids_to_wire([2])})
    with pytest.raises(schema.WireError, match=schema.NUM_DRAFT_TOKENS):
        host.handle({**base, "SIDS": schema.sids_to_wire([1])})
    assert host.trunk.caches[1].pos == pos and host.trunk.caches[1].pending is None
