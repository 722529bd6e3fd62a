"""Stage faults and session bounds without Triton: a stage call that hangs
past ``stage_timeout_s``, a stage whose process died (restarted, then used again), sessions bounded by
``max_sessions`` with a bounded wait, and the gauges that show it. The same faults against a real
server are in tests/test_faults_served.py."""

from __future__ import annotations

import threading
import time

import pytest

from tandem import schema
from tandem.engine.mtp_stage import MTPStage
from tandem.engine.scheduler import Scheduler, Turn
from tandem.engine.trunk_stage import TrunkStage
from tandem.serving import front as fr

from conftest import make_tiny_trunk


@pytest.fixture(scope="module")
def model():
    return make_tiny_trunk(max_position_embeddings=256)


class Faulty:
    """A transport over in-process stages that can hang (until released) or answer like a dead stub
    for chosen ``(model, op)`` calls."""

    def __init__(self, model) -> None:
        self.stages = {"trunk": TrunkStage(model), "drafter_mtp": MTPStage(model)}
        self.inner = fr.LocalTransport(self.stages)
        self.hang: set[tuple[str, str]] = set()
        self.dead: set[str] = set()
        self.dying: set[str] = set()  # dead once a hung call is released
        self.release = threading.Event()
        self.calls: list[tuple[str, str, int]] = []  # (model, op, sequences)

    def __call__(self, model, op, arrays):
        self.calls.append((model.name, op, len(arrays.get("SIDS", ()))))
        if model.name in self.dead:
            time.sleep(0.05)
            raise fr.StageError(model.name, op, f"Stub process '{model.name}_0_0' is not healthy.")
        if (model.name, op) in self.hang:
            self.release.wait(30)
            if model.name in self.dying:  # died while the call hung: the backend says so at last
                self.dead.add(model.name)
                raise fr.StageError(model.name, op, f"Stub process '{model.name}_0_0' is not healthy.")
        return self.inner(model, op, arrays)


class Client:
    """Collects one turn's responses; ``done`` is set by the final one."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.err: str | None = None
        self.finals = 0
        self.done = threading.Event()
        self.first = threading.Event()
        self.t_final = None

    def send(self, arrays, err, final):
        if err is not None:
            self.err = err
        else:
            self.tokens += arrays[schema.OUTPUT_IDS].tolist()
            self.first.set()
        if final:
            self.finals += 1
            self.t_final = time.monotonic()
            self.done.set()


def _front(tr: Faulty, restarts: list | None = None, stage_timeout_s: float = 30.0, **cfg):
    """A front over ``tr``, warmed up by one turn of each arm (a first call compiles kernels) before
    its stage deadline is lowered to ``stage_timeout_s``."""
    w = fr.WatchedTransport(tr, 30.0)
    restart = None if restarts is None else (lambda m: (restarts.append(m), time.sleep(0.3), tr.dead.discard(m)))
    front = fr.TandemFront(
        fr.TrunkProxy(w),
        {"mtp": fr.DrafterProxy(w)},
        stop_ids=(),
        watch=w,
        restart=restart,
        config=schema.ServingConfig(max_ctx=256, burst_rounds=1, **cfg),
    )
    for spec in ("mtp", "off"):
        assert _turn(front, 999, max_tokens=3, spec=spec).done.wait(60)
    w.timeout_s = stage_timeout_s
    return front


def _turn(front, sid, max_tokens=100, **kw) -> Client:
    c = Client()
    front.submit(fr.TurnRequest(sid, [1, 2, 3], max_tokens, **kw), c.send)
    return c


def test_hung_stage_fails_its_turns_by_the_deadline_and_recovers(model):
    tr = Faulty(model)
    front = _front(tr, stage_timeout_s=0.4)
    try:
        a = _turn(front, 1, max_tokens=200, spec="off")
        assert a.first.wait(30)
        tr.hang.add(("trunk", "verify"))
        t0 = time.monotonic()
        assert a.done.wait(5)
        assert a.err == "trunk.verify: did not answer within 0.4 s (stage_timeout_s)" and a.finals == 1
        assert a.t_final - t0 < 0.4 + 0.5
        late = _turn(front, 2)  # arrives while the call still hangs: refused at once, naming the stage
        assert late.done.wait(2) and "trunk is not answering" in late.err
        tr.hang.clear()
        tr.release.set()  # the call returns at last: the failed sessions are closed
        ok = _turn(front, 3, max_tokens=8)
        assert ok.done.wait(30) and ok.err is None and len(ok.tokens) == 8
        deadline = time.monotonic() + 2
        while (tr.stages["trunk"].caches or tr.stages["drafter_mtp"].states) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not tr.stages["trunk"].caches and not tr.stages["drafter_mtp"].states  # nothing leaked
        assert not front.sched.sessions
    finally:
        tr.release.set()
        front.stop()


def test_hung_admission_is_answered_by_the_watchdog(model):
    tr = Faulty(model)
    front = _front(tr, stage_timeout_s=0.3)
    tr.hang.add(("trunk", "prime"))
    try:
        a = _turn(front, 1)
        assert a.done.wait(3) and a.err == "trunk.prime: did not answer within 0.3 s (stage_timeout_s)"
    finally:
        tr.release.set()
        front.stop()
    assert a.finals == 1


def test_dead_trunk_fails_every_turn_and_is_restarted(model):
    tr, restarts = Faulty(model), []
    front = _front(tr, restarts)
    try:
        a, idle = _turn(front, 1, max_tokens=200), _turn(front, 2, max_tokens=2)
        assert a.first.wait(30) and idle.done.wait(30)
        tr.dead.add("trunk")
        assert a.done.wait(3) and a.finals == 1
        assert (
            a.err.startswith("trunk.verify: Stub process 'trunk_0_0' is not healthy.") and "restarting trunk" in a.err
        )
        refused = _turn(front, 3)  # while it restarts
        assert refused.done.wait(2) and refused.err.startswith("trunk is restarting")
        deadline = time.monotonic() + 5
        while "trunk" in front.sched.unavailable and time.monotonic() < deadline:
            time.sleep(0.02)
        assert restarts == ["trunk"] and not front.sched.unavailable
        assert not front.sched.sessions and not tr.stages["drafter_mtp"].states  # the drafter's state closed too
        ok = _turn(front, 4, max_tokens=6)
        assert ok.done.wait(30) and ok.err is None and len(ok.tokens) == 6
        assert front.gauge_values()["stage_restarts"] == 1
    finally:
        front.stop()


def test_dead_trunk_noticed_after_the_deadline_is_restarted_and_the_watchdog_survives(model, monkeypatch):
    """The served flake's kind: the backend notices a dead stub later than the stage deadline, so the
    watchdog's error reaches the client first; when the hung call then answers "not healthy" the trunk
    is restarted all the same. A watchdog look that raises is logged and the next one still answers."""
    tr, restarts, logged = Faulty(model), [], []
    front = _front(tr, restarts, stage_timeout_s=0.3)
    front.log = logged.append
    real, fails = front.watch.overdue, [1]

    def flaky_overdue(now=None):
        if fails:
            fails.pop()
            raise RuntimeError("one bad look")
        return real(now)

    monkeypatch.setattr(front.watch, "overdue", flaky_overdue)
    try:
        a = _turn(front, 1, max_tokens=200, spec="off")
        assert a.first.wait(30)
        tr.hang.add(("trunk", "verify"))
        tr.dying.add("trunk")
        assert a.done.wait(3) and a.finals == 1
        assert a.err == "trunk.verify: did not answer within 0.3 s (stage_timeout_s)"
        assert "watchdog: RuntimeError: one bad look" in logged
        tr.release.set()  # the hung call answers "not healthy": restart
        deadline = time.monotonic() + 5
        while (not restarts or "trunk" in front.sched.unavailable) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert restarts == ["trunk"] and not front.sched.unavailable and not front.sched.sessions
        tr.hang.clear()
        tr.dying.clear()
        ok = _turn(front, 2, max_tokens=6)
        assert ok.done.wait(30) and ok.err is None and len(ok.tokens) == 6
        assert front.gauge_values()["stage_restarts"] == 1
    finally:
        tr.release.set()
        front.stop()


def test_stages_are_probed_only_once_the_worker_idles(model, monkeypatch):
    """The idle probe (a no-op call per stage model, to find dead processes) never runs between
    back-to-back turns, where a request arriving would wait on it; it runs once no turn has run for
    PROBE_IDLE_S."""
    monkeypatch.setattr(fr, "PROBE_S", 0.0)
    monkeypatch.setattr(fr, "PROBE_IDLE_S", 0.4)
    tr = Faulty(model)
    front = _front(tr)
    try:
        time.sleep(0.6)
        n0 = len(tr.calls)
        for sid in range(10, 16):  # back to back: each turn sent once the previous one ended
            assert _turn(front, sid, max_tokens=4, spec="off").done.wait(30)
        probes = lambda calls: [c for c in calls if c[1] == "close" and c[2] == 0]  # noqa: E731
        calls = tr.calls[n0:]  # a probe round under way when the first turn arrived may finish first (CI once)
        first = next(i for i, c in enumerate(calls) if c not in probes([c]))
        assert not probes(calls[first:]), calls
        time.sleep(0.7)
        assert probes(tr.calls[n0:])
    finally:
        front.stop()


def test_dead_drafter_degrades_its_sessions_and_is_restarted(model):
    tr, restarts = Faulty(model), []
    front = _front(tr, restarts)
    ref_s = Scheduler(TrunkStage(tr.stages["trunk"].model), {}, schema.ServingConfig(max_ctx=256))
    ref: list[int] = []
    ref_s.admit([Turn(9, [1, 2, 3], 60, lambda r, e, f: ref.extend(r.tokens), spec="off")])
    while ref_s.turns:
        ref_s.burst()
    try:
        a = _turn(front, 1, max_tokens=60, spec="mtp")
        assert a.first.wait(30)
        tr.dead.add("drafter_mtp")
        assert a.done.wait(30) and a.err is None and a.tokens == ref  # plain decoding: the same greedy output
        deadline = time.monotonic() + 5
        while front.sched.unavailable and time.monotonic() < deadline:
            time.sleep(0.02)
        assert restarts == ["drafter_mtp"]
        b = _turn(front, 2, max_tokens=60, spec="mtp")  # speculates again
        assert b.done.wait(30) and b.err is None, b.err
        assert b.tokens == ref
        assert front.gauge_values()["degraded_sessions"] == 1
    finally:
        front.stop()


def test_sessions_are_bounded_with_a_bounded_wait(model):
    """Case 9: with every slot taken, a new sequence waits ``admission_wait_s`` and then gets a clear
    "no free session" error; a slot that frees within the wait admits it; the gauges show the slots."""
    tr = Faulty(model)
    front = _front(tr, max_sessions=2, admission_wait_s=0.5)
    try:
        held = [_turn(front, sid, max_tokens=2, end=False) for sid in (1, 2)]  # two open, idle sessions
        assert all(c.done.wait(30) and c.err is None for c in held)
        g = front.gauge_values()
        assert (g["sessions_open"], g["session_slots_free"]) == (2, 0)
        t0 = time.monotonic()
        full = _turn(front, 3)
        assert full.done.wait(5)
        assert full.err.startswith(
            "sequence_id: no free session for sequence 3: all 2 sessions are open (max_sessions)"
        )
        assert "admission_wait_s" in full.err and 0.45 < time.monotonic() - t0 < 2.0
        waiting = _turn(front, 4, max_tokens=4)
        time.sleep(0.1)
        assert front.gauge_values()["turns_waiting"] == 1
        end = _turn(front, 1, max_tokens=1, start=False)  # ends sequence 1: its slot goes to sequence 4
        assert end.done.wait(10) and end.err is None
        assert waiting.done.wait(10) and waiting.err is None and len(waiting.tokens) == 4
        g = front.gauge_values()
        assert (g["sessions_open"], g["session_slots_free"], g["turns_waiting"], g["sessions_refused_full"]) == (
            1,
            1,
            0,
            1,
        )
        again = _turn(front, 2, max_tokens=2, start=False)  # an open session needs no new slot
        assert again.done.wait(10) and again.err is None
    finally:
        front.stop()


def test_idle_counts_from_the_end_of_the_turn(model):
    """Case 7: a turn that ends at prime (MAX_TOKENS 1) or after a long stream leaves the session
    alive for ``idle_timeout_s`` from its end; after that it is expired."""
    sched = Scheduler(
        TrunkStage(model), {"mtp": MTPStage(model)}, schema.ServingConfig(max_ctx=256, idle_timeout_s=1.0)
    )
    out: list = []
    sched.admit([Turn(5, [1, 2, 3], 1, lambda r, e, f: out.append(e), end=False)])  # done at prime
    assert out == [None] and 5 in sched.sessions and not sched.turns
    assert sched.expire_idle(now=time.monotonic() + 0.5) == []
    sched.admit([Turn(5, [4], 40, lambda r, e, f: out.append(e), start=False, end=False)])
    t_end = None
    while sched.turns:
        sched.burst()
        t_end = time.monotonic()
    s = sched.sessions[5]
    assert s.last_active >= t_end - 0.2  # stamped at the end of the turn, not at its start
    assert sched.expire_idle(now=s.last_active + 0.9) == []
    assert sched.expire_idle(now=s.last_active + 1.1) == [5] and not sched.trunk.caches


def test_health_during_a_reload_reads_not_ready(monkeypatch):
    """While Triton reloads a model it answers ``is_model_ready`` with UNAVAILABLE "Server not ready"
    (seen in tests/test_faults_served.py's restart case): health reads NOT READY for it instead of raising; other
    errors still raise."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    from tandem_client.client import stage_health

    class Reloading:
        answer = "Server not ready"

        def __init__(self, url):
            pass

        def is_server_live(self, **kw):
            return True

        def is_model_ready(self, name, **kw):
            if name == "trunk":
                raise InferenceServerException(self.answer, status="StatusCode.UNAVAILABLE")
            return True

        def infer(self, name, inputs, **kw):
            return None

        def close(self):
            pass

    monkeypatch.setattr(grpcclient, "InferenceServerClient", Reloading)
    health = stage_health("127.0.0.1:1")
    assert health["trunk"] == "NOT READY" and health["tandem"] == "READY", health
    Reloading.answer = "permission denied"
    with pytest.raises(InferenceServerException, match="permission denied"):
        stage_health("127.0.0.1:1")


def test_stop_leaves_a_worker_stuck_in_a_stage_call_behind_and_logs_where(model, monkeypatch):
    """At shutdown (the model's ``finalize``) the worker is waited for a bounded time: one stuck in a
    stage call (here the idle probe of a stage that never answers) is left behind with its stack in
    the log, so the model still unloads inside the server's exit timeout; an idle worker stops at
    once and calls no stage after the stop."""
    monkeypatch.setattr(fr, "PROBE_S", 0.0)
    monkeypatch.setattr(fr, "PROBE_IDLE_S", 0.1)
    tr = Faulty(model)
    front = _front(tr)
    logs: list[str] = []
    front.log = logs.append
    tr.hang.add(("trunk", "close"))
    try:
        deadline = time.monotonic() + 10
        while not (tr.calls and tr.calls[-1] == ("trunk", "close", 0)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tr.calls[-1] == ("trunk", "close", 0)  # the probe hangs
        t0 = time.monotonic()
        assert front.stop(timeout_s=0.5) is False
        assert time.monotonic() - t0 < 2.0
        assert any("did not stop within 0.5 s" in m and "_probe" in m for m in logs), logs
    finally:
        tr.release.set()
    tr2 = Faulty(model)
    idle = _front(tr2)
    time.sleep(0.3)
    t0 = time.monotonic()
    assert idle.stop() is True and time.monotonic() - t0 < fr.STOP_JOIN_S
    n = len(tr2.calls)
    time.sleep(0.3)
    assert len(tr2.calls) == n
