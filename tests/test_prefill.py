"""Chunked prefill: a long prompt primed ``prefill_chunk`` rows per burst gives the same
greedy output as one prime on every arm (with and without the prefix cache), and a session already
streaming gets bursts while the long prompt is primed."""

from __future__ import annotations

import pytest

from tandem.engine.inprocess import Engine
from tandem.engine.scheduler import Turn


def _long_prompt(tokenizer, n: int = 600) -> list[int]:
    import inspect
    import json

    text = inspect.getsource(json.decoder)
    ids = tokenizer.chat_prompt("Explain this code:\n" + text)
    return ids[: n - 2] + ids[-2:]


@pytest.fixture(scope="module")
def engines(trunk_fp32, tokenizer, checkpoint):
    kw = dict(model=trunk_fp32, tokenizer=tokenizer, demote_probe_rounds=0, burst_rounds=1)
    return {c: {p: Engine(checkpoint, "fp32", prefill_chunk=c, prefix_cache_mb=p, **kw) for p in (0, 64)}
            for c in (0, 48, 128)}


def _with_a_stream(eng, tokenizer, ids, spec):
    """``ids`` as a turn admitted while another session streams (so it is primed in chunks)."""
    sched, got = eng.sched, []
    sched.admit([Turn(11, tokenizer.chat_prompt("Tell me a story."), 400, lambda r, e, f: None, spec="off")])
    sched.admit([Turn(12, ids, 24, lambda r, e, f: got.append(r), spec=spec)])
    chunked = bool(sched.prefilling()) == bool(eng.config.prefill_chunk)
    while 12 in sched.turns:
        sched.burst()
    sched.cancel(11)
    assert chunked
    return [t for r in got for t in r.tokens], sum(r.accepted for r in got)


@pytest.mark.parametrize("spec", ["off", "mtp", "dflash2"])
@pytest.mark.parametrize("prefix_mb", [0, 64])
def test_chunked_prime_equals_one_prime(engines, tokenizer, spec, prefix_mb):
    ids = _long_prompt(tokenizer)
    one = engines[0][prefix_mb].generate(ids, 24, spec=spec)
    chunked, accepted = _with_a_stream(engines[48][prefix_mb], tokenizer, ids, spec)  # pieces across blocks
    assert chunked == one["token_ids"]
    assert accepted > 0 or spec == "off"
    alone = engines[48][prefix_mb]
    if prefix_mb:  # the chunked prime captured every block it crossed: its prompt was published
        st = alone.sched.prefix.stats
        assert st.get("errors", 0) == 0 and st["blocks"] >= len(ids) // 64 - 1, st
    assert alone.generate(ids, 24, spec=spec)["token_ids"] == one["token_ids"]  # nobody streaming: one prime


def test_streaming_session_keeps_streaming_while_a_long_prompt_primes(engines, tokenizer):
    eng = engines[128][0]
    sched, events = eng.sched, []
    sched.admit([Turn(1, tokenizer.chat_prompt("Tell me a story."), 200, lambda r, e, f: events.append("a"),
                      spec="mtp")])
    long = _long_prompt(tokenizer)
    sched.admit([Turn(2, long, 4, lambda r, e, f: events.append("b"), spec="off", end=False)])
    assert events == ["a"] and [s.sid for s in sched.prefilling()] == [2]  # no first token yet: primed in chunks
    while 2 in sched.turns:
        sched.burst()
    first_b = events.index("b")
    chunks = -(-(len(long) - 128) // 128)  # bursts after the admission's chunk
    assert events[1:first_b].count("a") >= chunks - 1  # a burst of the streaming session between chunks
    assert sched.sessions[2].committed[: len(long)] == long
    sched.cancel(1)
    sched.cancel(2)
