"""Pipelined ``draft_verify`` calls (``pipeline``, the serving default with ``colocate``): while the
trunk runs a call, the next one (``draft_verify_next``) is already sent and continues the same
sequences from where the trunk's walks leave them. Same tokens, rounds and acceptance as calls made
one at a time, in-process over the wire form and on a real server."""

from __future__ import annotations

import pytest

from tandem import schema
from tandem.engine.scheduler import Turn

from test_colocated import hosted, shipped  # noqa: F401 - the served wiring and the shipped-engine fixture


def test_served_pipeline_sends_each_next_call_ahead(shipped, checkpoint, tokenizer, tmp_path):
    """A real tritonserver with ``pipeline`` on (the default): two concurrent sessions per arm get the
    engine's tokens, most ``draft_verify`` calls are pipelined ``draft_verify_next`` calls, and the
    tandem log at unload counts them (refused: ones that reached the trunk before their predecessor)."""
    import ast
    import re
    from concurrent.futures import ThreadPoolExecutor

    from tandem.serving.serve import running_server
    from tandem_client.client import generate

    prompts = [tokenizer.chat_prompt(t) for t in ("Write a short poem about the sea.", "Name three colours.")]
    log = tmp_path / "server.log"
    with running_server(env={"TANDEM_CHECKPOINT": str(checkpoint.resolve()), "TANDEM_PREFIX_CACHE_MB": "0"},
                        ready_timeout_s=240, log_path=log) as srv, ThreadPoolExecutor(2) as pool:
        for arm in ("dflash2", "off"):
            got = list(pool.map(lambda ids: generate(ids, 64, url=srv.grpc_url, spec=arm), prompts))
            assert [g["token_ids"] for g in got] == [shipped.generate(ids, 64, spec=arm)["token_ids"] for ids in prompts]
    text = log.read_text(errors="replace")
    counts = ast.literal_eval(re.search(r"; pipelined (\{[^}]*\})", text).group(1))
    calls = ast.literal_eval(re.search(r"tandem: BLS calls (\{.*\}); pipelined", text).group(1))
    assert counts["calls"] >= 4 and counts["refused"] <= counts["calls"] // 4, counts
    assert calls["trunk.draft_verify_next"]["calls"] == counts["calls"]


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
        sched.admit([Turn(sid, x, 40, lambda r, e, f, sid=sid: got[sid].append((r, e)), spec=arm)
                     for sid, x in zip((1, 2), ids)])
        while sched.turns:
            sched.burst()
        assert not [e for sid in got for _, e in got[sid] if e]
        runs.append([([t for r, _ in got[sid] for t in r.tokens], sum(r.rounds for r, _ in got[sid]),
                      sum(r.accepted for r, _ in got[sid])) for sid in (1, 2)])
        assert not host.trunk.caches
    assert runs[0] == runs[1]
    assert [t for t, _, _ in runs[1]] == [shipped.generate(x, 40, spec="off")["token_ids"] for x in ids]
    pipe = sched.trunk.pipeline
    ops = [(op, a.get("CALL")) for _, op, a, _ in spy.calls]
    nexts = [i for i, (op, _) in enumerate(ops) if op == "draft_verify_next"]
    assert len(nexts) >= 3 and pipe.counts["refused"] == 0 and pipe.queued is None, (pipe.counts, [op for op, _ in ops])
    for i in nexts:  # the call it continues ran just before it
        assert ops[i - 1][0] in ("draft_verify", "draft_verify_next") and int(ops[i - 1][1][0]) == int(ops[i][1][0]) - 1
