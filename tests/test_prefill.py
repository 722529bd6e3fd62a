"""Chunked prefill under ``prefill_budget``: a long prompt primed in pieces gives the same greedy
output as one prime on every spec (with and without the prefix cache); a session already streaming gets
bursts while long prompts are primed; a burst primes at most the budget however many prompts wait, and a
short prompt is not held behind long ones."""

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
    kw = dict(model=trunk_fp32, tokenizer=tokenizer, adaptive_draft=False, burst_rounds=1)
    return {
        c: {p: Engine(checkpoint, "fp32", prefill_budget=c, prefix_cache_mb=p, **kw) for p in (0, 64)}
        for c in (0, 48, 128)
    }


def _with_a_stream(eng, tokenizer, ids, spec):
    """``ids`` as a turn admitted while another session streams (so it is primed in chunks)."""
    sched, got = eng.sched, []
    sched.admit([Turn(11, tokenizer.chat_prompt("Tell me a story."), 400, lambda r, e, f: None, spec="off")])
    sched.admit([Turn(12, ids, 24, lambda r, e, f: got.append(r), spec=spec)])
    chunked = bool(sched.prefilling()) == bool(eng.config.prefill_budget)
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
    chunked, accepted = _with_a_stream(engines[48][prefix_mb], tokenizer, ids, spec)  # one block a burst
    assert chunked == one["token_ids"]
    assert accepted > 0 or spec == "off"
    alone = engines[48][prefix_mb]
    if prefix_mb:  # the chunked prime captured every block it crossed: its prompt was published
        st = alone.sched.prefix.stats
        assert st.get("errors", 0) == 0 and st["blocks"] >= len(ids) // 64 - 1, st
    assert alone.generate(ids, 24, spec=spec)["token_ids"] == one["token_ids"]  # nobody streaming: pieces too


def test_streaming_session_keeps_streaming_while_a_long_prompt_primes(engines, tokenizer):
    eng = engines[128][0]
    sched, events = eng.sched, []
    sched.admit(
        [Turn(1, tokenizer.chat_prompt("Tell me a story."), 200, lambda r, e, f: events.append("a"), spec="mtp")]
    )
    long = _long_prompt(tokenizer)
    sched.admit([Turn(2, long, 4, lambda r, e, f: events.append("b"), spec="off", end=False)])
    assert events == ["a"] and [s.sid for s in sched.prefilling()] == [2]  # no first token yet: primed in chunks
    while 2 in sched.turns:
        sched.burst()
    first_b = events.index("b")
    chunks = -(-(len(long) - 128) // 128)  # bursts after the admission's piece (at most 128 rows)
    assert events[1:first_b].count("a") >= chunks - 1  # a burst of the streaming session between chunks
    assert sched.sessions[2].committed[: len(long)] == long
    sched.cancel(1)
    sched.cancel(2)


def _counting_prime(sched) -> list[int]:
    """Wrap ``sched.trunk.prime``: every call appends its rows to the returned list."""
    rows, prime = [], sched.trunk.prime

    def counted(items, *a, **kw):
        rows.append(sum(len(it.tokens) for it in items))
        return prime(items, *a, **kw)

    sched.trunk.prime = counted
    return rows


@pytest.mark.parametrize("prefix_mb", [0, 64])
def test_budget_bounds_each_burst_and_short_prompts_go_first(trunk_fp32, tokenizer, checkpoint, engines, prefix_mb):
    """Six long prompts wait behind a stream: every burst cycle (its admissions, then its prefill call)
    primes at most ``prefill_budget`` rows, but the cycle that admits the long prompts, which primes at
    most each further one's least piece beyond it (one row: under CPU ``batch_invariant`` pieces are cut
    anywhere, prefix cache or not); a 2-token prompt arriving behind them gets
    its first token at its admission, a 300-token one within two bursts while every long prompt still
    waits; every greedy output equals the same turn's output without contention."""
    from tandem.engine.prefill import LEAST_PIECE_ROWS

    budget = 192
    eng = Engine(
        checkpoint,
        "fp32",
        model=trunk_fp32,
        tokenizer=tokenizer,
        adaptive_draft=False,
        burst_rounds=1,
        prefill_budget=budget,
        prefix_cache_mb=prefix_mb,
    )
    sched, got = eng.sched, {}

    def emit(sid):
        return lambda r, e, f: got.setdefault(sid, []).extend([] if r is None else r.tokens)

    story = tokenizer.chat_prompt("Tell me a story.")
    base = _long_prompt(tokenizer, 500)
    longs = [base[:5] + [100 + i] + base[6:] for i in range(6)]  # (no prefix-cache hits between them)
    medium, short = _long_prompt(tokenizer, 300), story[:2]
    sched.admit([Turn(1, story, 48, emit(1), spec="off")])
    rows = _counting_prime(sched)
    sched.admit([Turn(10 + i, ids, 3, emit(10 + i), spec="off") for i, ids in enumerate(longs)])
    admitted = rows.pop()
    assert sched.prefill.invariant_prime
    assert admitted <= budget + (len(longs) - 1) * LEAST_PIECE_ROWS and len(sched.prefilling()) == len(longs)
    cycles = []
    for _ in range(2):
        sched.burst()
        cycles.append(sum(rows))
        rows.clear()
    sched.admit([Turn(30, short, 2, emit(30), spec="off")])
    assert got.get(30), "the 2-token prompt waited for a burst"
    sched.admit([Turn(31, medium, 2, emit(31), spec="off")])
    for n in range(1, 4):
        sched.burst()
        cycles.append(sum(rows))
        rows.clear()
        if got.get(31):
            break
    assert n <= 2 and len(sched.prefilling()) == len(longs), "the 300-token prompt waited behind long ones"
    while any(sid in sched.turns for sid in [1, 30, 31] + [10 + i for i in range(len(longs))]):
        sched.burst()
        cycles.append(sum(rows))
        rows.clear()
    assert max(cycles) <= budget, cycles
    assert admitted + sum(cycles) >= len(longs) * 500 + 300  # (every prompt row was counted)
    alone = {1: (story, 48), 30: (short, 2), 31: (medium, 2), **{10 + i: (ids, 3) for i, ids in enumerate(longs)}}
    for sid, (ids, n) in alone.items():
        assert got[sid] == engines[0][0].generate(ids, n, spec="off")["token_ids"], sid


def test_pieces_end_at_block_multiples_only_when_aligned():
    """With the prefix cache on and a trunk whose prime rows depend on their pieces (``aligned``), every
    piece but the last ends at a multiple of ``PREFIX_BLOCK`` of the sequence position; otherwise a piece
    is as big as the budget allows, and the least piece is one row."""
    from tandem import schema
    from tandem.engine.prefill import LEAST_PIECE_ROWS, PendingPrefill
    from tandem.engine.protocols import Rows

    C = schema.PREFIX_BLOCK
    item = Rows(7, list(range(5, 5 + 3 * C + 11)), [], 0, None)
    aligned = PendingPrefill(item, 4, start=C + 5, aligned=True)
    free = PendingPrefill(item, 4, start=C + 5, aligned=False)
    assert (aligned.fit(100), free.fit(100)) == (2 * C - (C + 5), 100)
    assert (aligned.fit(30), free.fit(30)) == (0, 30)  # no block end within 30 rows of position 69
    assert (aligned.least(), free.least()) == (2 * C - (C + 5), LEAST_PIECE_ROWS)
    assert aligned.fit(10_000) == free.fit(10_000) == len(item.tokens)
