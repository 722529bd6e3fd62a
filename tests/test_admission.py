"""Admission by count and by bytes, and how fast a refusal comes: the session state estimate equals the
trunk cache's bytes; a turn that cannot fit in ``max_state_mb`` waits like one beyond ``max_sessions``, then
is refused naming the limit and the numbers; the admission clock runs from a turn's arrival and a refusal
does not wait for a worker busy in a stage call."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from tandem import schema
from tandem.engine.protocols import Rows, VerifyOut
from tandem.engine.scheduler import Scheduler, Turn
from tandem.engine.state_size import StateSize
from tandem.engine.trunk_stage import TrunkStage
from tandem.model.cache import KDAState, MLACache
from tandem.serving.engine_core import EngineCore
from tandem.serving.turns import TurnRequest


def _cache_bytes(cache) -> int:
    """Bytes of a trunk cache's buffers (the MLA row buffers whole, spare capacity included; the KDA state)."""
    n = 0
    for layer in cache.layers:
        if isinstance(layer, MLACache):
            n += sum(
                b.numel() * b.element_size()
                for name in ("latent", "k", "v", "ik", "ig", "pk")
                if (b := layer.buffer(name)) is not None
            )
        elif isinstance(layer, KDAState):
            n += sum(t.numel() * t.element_size() for t in (layer.tail, layer.S))
    return n


@pytest.mark.parametrize("tokens", [40, 300])
def test_the_estimate_is_the_trunk_cache_bytes(trunk_fp32, tokens):
    """After a prime of ``tokens`` rows the plain spec's estimate equals the cache's buffers, byte for byte."""
    stage = TrunkStage(trunk_fp32, 1024)
    stage.open([1])
    stage.prime([Rows(1, list(range(3, 3 + tokens)))])
    size = StateSize.from_configs(trunk_fp32.cfg.to_hf_dict())
    assert size.session(schema.OFF, tokens) == _cache_bytes(stage.cache(1)) > 0


class _Stage:
    """A trunk stage that answers every prime with one token (no model): what admission needs."""

    vocab_size = 100

    def __init__(self, prime_s: float = 0.0) -> None:
        self.prime_s, self.open_sids = prime_s, set()

    def open(self, sids):
        self.open_sids |= set(sids)

    def close(self, sids):
        self.open_sids -= set(sids)

    def prime(self, items):
        time.sleep(self.prime_s)
        return [
            VerifyOut(
                torch.full((len(it.tokens),), 7),
                torch.zeros(len(it.tokens), 0),
                torch.zeros(len(it.tokens)),
                torch.zeros(len(it.tokens), 0),
            )
            for it in items
        ]


#: 1 KiB a token, at least 256 tokens (the MLA buffers' first size): 256 KiB a short session
SIZE = StateSize(mla_row=1024, mla_pool=0, kpool=4, kda=0, hidden=0, features=0, drafter_row={})


def _sched(**config) -> Scheduler:
    cfg = dataclasses.replace(schema.DEFAULTS, prefix_cache_mb=0, **config)
    return Scheduler(_Stage(), {}, cfg, state_size=SIZE)


def _turn(sid, out, n=4, max_tokens=8, **kw) -> Turn:
    return Turn(
        sid, list(range(3, 3 + n)), max_tokens, lambda r, e, f: out.append((sid, r, e, f)), spec="off", end=False, **kw
    )


def test_a_turn_that_cannot_fit_waits_then_is_refused_naming_the_limit():
    """max_state_mb 1 holds four 256 KiB sessions: the fifth waits admission_wait_s, then is refused naming
    max_state_mb, the bytes and the at-capacity marker; one that could never fit is refused at once; the
    state_bytes gauge counts the sessions and returns to 0 when they end."""
    sched, out = _sched(max_state_mb=1, admission_wait_s=0.2), []
    sched.admit([_turn(s, out) for s in range(1, 6)])
    assert len(sched.sessions) == 4 and sched.waiting() == 1
    assert sched.gauges()["state_bytes"] == 4 * 256 * 1024
    sched.admit([Turn(9, [5] * 4, 4000, lambda r, e, f: out.append((9, r, e, f)), spec="off")])
    err = next(e for sid, _, e, _ in out if sid == 9)
    assert "max_state_mb 1" in err and "MB of session state" in err and schema.AT_CAPACITY_MARKER not in err
    time.sleep(0.25)
    sched.admit([])
    err = next(e for sid, _, e, _ in out if sid == 5 and e)
    assert "no room for" in err and "0.2 MB of session state" in err and "max_state_mb 1" in err
    assert schema.AT_CAPACITY_MARKER in err and sched.waiting() == 0 and sched.stats["sessions_refused_memory"] == 1
    for sid in list(sched.sessions):
        sched.close(sid)
    sched.flush_closes()
    assert sched.gauges()["state_bytes"] == 0 and not sched.trunk.open_sids


def test_a_freed_session_lets_the_waiting_turn_in():
    sched, out = _sched(max_state_mb=1, admission_wait_s=5.0), []
    sched.admit([_turn(s, out) for s in range(1, 6)])
    assert sched.waiting() == 1
    sched.close(1)
    sched.admit([])
    assert 5 in sched.sessions and sched.waiting() == 0 and not any(e for _, _, e, _ in out)


def test_the_admission_clock_runs_from_arrival():
    """A turn that reached the server admission_wait_s ago (it waited in the front's queue) is refused at
    once when no slot is free, and refuse_overdue refuses waiting turns without admit."""
    sched, out = _sched(max_sessions=1, admission_wait_s=1.0), []
    sched.admit([_turn(1, out)])
    sched.admit([_turn(2, out, arrived=time.monotonic() - 1.5)])
    assert "no free session" in out[-1][2] and sched.waiting() == 0
    sched.admit([_turn(3, out)])
    assert sched.waiting() == 1 and sched.refuse_overdue(time.monotonic() + 0.5) == 0
    assert sched.refuse_overdue(time.monotonic() + 1.1) == 1 and "no free session" in out[-1][2]


def test_refusals_come_while_the_worker_primes():
    """max_sessions 1, admission_wait_s 0.3: while the worker is inside a 2 s prime, turns of new sequences
    arriving meanwhile are refused 0.3 s after they arrive, not after the prime."""
    cfg = dataclasses.replace(schema.DEFAULTS, max_sessions=1, admission_wait_s=0.3, prefix_cache_mb=0)
    front = EngineCore(_Stage(prime_s=2.0), {}, (), cfg)
    got: dict[int, float] = {}
    try:
        front.submit(TurnRequest(1, [3, 4, 5], 2), lambda o, e, f: None)
        time.sleep(0.1)  # (the worker is priming turn 1)
        t0, done = time.monotonic(), threading.Event()
        for sid in range(2, 6):
            front.submit(
                TurnRequest(sid, [3, 4], 2),
                lambda o, e, f, sid=sid: (
                    got.setdefault(sid, time.monotonic() - t0) if e else None,
                    len(got) == 4 and done.set(),
                ),
            )
        assert done.wait(3.0), got
        assert max(got.values()) < 0.3 + 0.3, got
    finally:
        front.stop()
