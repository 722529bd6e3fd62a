"""Drafter faults and session bounds without Triton: the trunk runs in the engine core's process, the
``mtp`` drafter in its own model reached over a transport (``colocate`` off). A drafter call that hangs
past ``stage_timeout_s``, a drafter whose process died (restarted; its sessions go on plain, which gives
the trunk's greedy output), sessions bounded by ``max_sessions`` with a bounded wait, and the gauges that
show it. The same faults against a real server are in tests/test_faults_served.py."""

from __future__ import annotations

import threading
import time

import pytest

from tandem import schema
from tandem.engine.mtp_stage import MTPStage
from tandem.engine.scheduler import Scheduler, Turn
from tandem.engine.trunk_stage import TrunkStage
from tandem.serving import engine_core as fr
from tandem.serving import proxies
from tandem.serving import turns

from conftest import make_tiny_trunk

DRAFTER = "drafter_mtp"


@pytest.fixture(scope="module")
def model():
    return make_tiny_trunk(max_position_embeddings=256)


@pytest.fixture(scope="module")
def plain(model):
    """The trunk's plain greedy output for the prompt [1, 2, 3] (60 tokens)."""
    sched = Scheduler(TrunkStage(model), {}, schema.ServingConfig(max_ctx=256))
    out: list[int] = []
    sched.admit([Turn(9, [1, 2, 3], 60, lambda r, e, f: out.extend(r.tokens), spec="off")])
    while sched.turns:
        sched.burst()
    assert len(out) == 60
    return out


class Faulty:
    """A transport over the in-process ``drafter_mtp`` stage that can hang (until released) or answer
    like a dead stub for chosen ``(model, op)`` calls."""

    def __init__(self, model) -> None:
        self.model = model
        self.stages = {DRAFTER: MTPStage(model)}
        self.inner = proxies.LocalTransport(self.stages)
        self.hang: set[tuple[str, str]] = set()
        self.dead: set[str] = set()
        self.dying: set[str] = set()  # dead once a hung call is released
        self.release = threading.Event()
        self.calls: list[tuple[str, str, int]] = []  # (model, op, sequences)

    def __call__(self, model, op, arrays):
        self.calls.append((model.name, op, len(arrays.get("SIDS", ()))))
        if model.name in self.dead:
            time.sleep(0.05)
            raise proxies.StageError(model.name, op, f"Stub process '{model.name}_0_0' is not healthy.")
        if (model.name, op) in self.hang:
            self.release.wait(30)
            if model.name in self.dying:  # died while the call hung: the backend says so at last
                self.dead.add(model.name)
                raise proxies.StageError(model.name, op, f"Stub process '{model.name}_0_0' is not healthy.")
        return self.inner(model, op, arrays)

    def drafts_since(self, n: int) -> int:
        """``draft`` calls among the calls after the first ``n``."""
        return sum(1 for m, op, _ in self.calls[n:] if (m, op) == (DRAFTER, "draft"))


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


def _front(
    tr: Faulty,
    restarts: list | None = None,
    stage_timeout_s: float = 30.0,
    back: threading.Event | None = None,
    **cfg,
):
    """A front with the trunk in its process and the ``mtp`` drafter over ``tr``, warmed up by one turn
    of each spec (a first call compiles kernels) before its stage deadline is lowered to ``stage_timeout_s``;
    its sessions draft every round (``adaptive_draft`` off: the faults are the drafter's, whatever it pays).
    With ``restarts``, a restart of a model is recorded there and takes 0.3 s (or, with ``back``, until it
    is set), after which the model answers again."""
    w = proxies.WatchedTransport(tr, 30.0)

    def restart(name: str) -> None:
        restarts.append(name)
        if back is None:
            time.sleep(0.3)
        else:
            assert back.wait(30)
        tr.dead.discard(name)

    front = fr.EngineCore(
        TrunkStage(tr.model),
        {"mtp": proxies.DrafterProxy(w)},
        stop_ids=(),
        watch=w,
        restart=None if restarts is None else restart,
        config=schema.ServingConfig(max_ctx=256, burst_rounds=1, **{"adaptive_draft": False, **cfg}),
    )
    for spec in ("mtp", "off"):
        assert _turn(front, 999, max_tokens=3, spec=spec).done.wait(60)
    w.timeout_s = stage_timeout_s
    return front


def _turn(front, sid, max_tokens=100, **kw) -> Client:
    c = Client()
    front.submit(turns.TurnRequest(sid, [1, 2, 3], max_tokens, **kw), c.send)
    return c


def _wait(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(cond())


def test_hung_drafter_fails_its_turns_by_the_deadline_and_recovers(model, plain):
    tr = Faulty(model)
    front = _front(tr, stage_timeout_s=0.4)
    try:
        a = _turn(front, 1, max_tokens=200, spec="mtp")
        assert a.first.wait(30)
        tr.hang.add((DRAFTER, "draft"))
        t0 = time.monotonic()
        assert a.done.wait(5)
        assert a.err == "drafter_mtp.draft: did not answer within 0.4 s (stage_timeout_s)" and a.finals == 1
        assert a.t_final - t0 < 0.4 + 0.5
        late = _turn(front, 2)  # arrives while the call still hangs: refused at once, naming the drafter
        assert late.done.wait(2)
        assert late.err == "drafter_mtp is not answering (a call has run past 0.4 s, stage_timeout_s); retry later"
        tr.hang.clear()
        tr.release.set()  # the call returns at last: the failed session is closed
        assert _wait(lambda: front.watch.stalled is None)
        n = len(tr.calls)
        ok = _turn(front, 3, max_tokens=8, spec="mtp")
        assert ok.done.wait(30) and ok.err is None and ok.tokens == plain[:8]
        assert tr.drafts_since(n) > 0  # speculates again
        assert _wait(lambda: not (front.sched.sessions or front.sched.trunk.caches or tr.stages[DRAFTER].states))
        assert not front.sched.trunk.caches and not tr.stages[DRAFTER].states  # nothing leaked
        assert not front.sched.sessions and front.gauge_values()["stage_restarts"] == 0
    finally:
        tr.release.set()
        front.stop()


def test_hung_admission_is_answered_by_the_watchdog(model, plain):
    """A drafter ``open`` that hangs while a turn is admitted: the watchdog answers the turn; once the call
    returns, the session is closed and new turns are served."""
    tr = Faulty(model)
    front = _front(tr, stage_timeout_s=0.3)
    tr.hang.add((DRAFTER, "open"))
    try:
        a = _turn(front, 1, spec="mtp")
        assert a.done.wait(3) and a.err == "drafter_mtp.open: did not answer within 0.3 s (stage_timeout_s)"
        tr.hang.clear()
        tr.release.set()
        assert _wait(lambda: front.watch.stalled is None)
        ok = _turn(front, 2, max_tokens=8, spec="mtp")
        assert ok.done.wait(30) and ok.err is None and ok.tokens == plain[:8]
        assert _wait(lambda: not front.sched.sessions and not front.sched.trunk.caches)
    finally:
        tr.release.set()
        front.stop()
    assert a.finals == 1


def test_dead_drafter_at_admission_is_restarted_and_turns_go_on_plain_meanwhile(model, plain):
    """A drafter found dead when a turn opens its state: the turn decodes plain (the trunk's greedy output,
    no error), the drafter is restarted, and turns admitted while it restarts go plain without calling it;
    once it is back, new turns speculate again."""
    tr, restarts, back = Faulty(model), [], threading.Event()
    front = _front(tr, restarts, back=back)
    try:
        tr.dead.add(DRAFTER)
        a = _turn(front, 1, max_tokens=30, spec="mtp")
        assert a.done.wait(30) and a.err is None and a.tokens == plain[:30]
        assert _wait(lambda: restarts) and restarts == [DRAFTER] and front.sched.unavailable == {DRAFTER}
        n = len(tr.calls)
        b = _turn(front, 2, max_tokens=30, spec="mtp")  # while it restarts
        assert b.done.wait(30) and b.err is None and b.tokens == plain[:30]
        assert tr.calls[n:] == []  # no call to the restarting drafter
        back.set()
        assert _wait(lambda: not front.sched.unavailable)
        n = len(tr.calls)
        c = _turn(front, 3, max_tokens=30, spec="mtp")
        assert c.done.wait(30) and c.err is None and c.tokens == plain[:30]
        assert tr.drafts_since(n) > 0  # speculates again
        g = front.gauge_values()
        assert (g["stage_restarts"], g["degraded_sessions"]) == (1, 2)
        assert restarts == [DRAFTER]
        assert _wait(lambda: not front.sched.sessions and not tr.stages[DRAFTER].states)
    finally:
        back.set()
        front.stop()


def test_dead_drafter_noticed_after_the_deadline_is_restarted_and_the_watchdog_survives(model, plain, monkeypatch):
    """The served flake's kind: the backend notices a dead stub later than the stage deadline, so the
    watchdog's error reaches the client first; when the hung call then answers "not healthy" the drafter
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
        a = _turn(front, 1, max_tokens=200, spec="mtp")
        assert a.first.wait(30)
        tr.hang.add((DRAFTER, "draft"))
        tr.dying.add(DRAFTER)
        assert a.done.wait(3) and a.finals == 1
        assert a.err == "drafter_mtp.draft: did not answer within 0.3 s (stage_timeout_s)"
        assert "watchdog: RuntimeError: one bad look" in logged
        tr.release.set()  # the hung call answers "not healthy": restart
        assert _wait(lambda: restarts and not front.sched.unavailable and not front.sched.sessions)
        assert restarts == [DRAFTER] and any(m.startswith(f"{DRAFTER}'s process died") for m in logged), logged
        tr.hang.clear()
        tr.dying.clear()
        n = len(tr.calls)
        ok = _turn(front, 2, max_tokens=6, spec="mtp")
        assert ok.done.wait(30) and ok.err is None and ok.tokens == plain[:6]
        assert tr.drafts_since(n) > 0
        assert front.gauge_values()["stage_restarts"] == 1
    finally:
        tr.release.set()
        front.stop()


def test_stages_are_probed_only_once_the_worker_idles(model, monkeypatch):
    """The idle probe (a no-op call per drafter model, to find dead processes) never runs between
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
            assert _turn(front, sid, max_tokens=4, spec="mtp").done.wait(30)
        probes = lambda calls: [c for c in calls if c[1] == "close" and c[2] == 0]  # noqa: E731
        calls = tr.calls[n0:]  # a probe round under way when the first turn arrived may finish first (CI once)
        first = next(i for i, c in enumerate(calls) if c not in probes([c]))
        assert not probes(calls[first:]), calls
        assert tr.drafts_since(n0) >= 6
        time.sleep(0.7)
        assert probes(tr.calls[n0 + len(calls) :]) and set(probes(tr.calls[n0:])) == {(DRAFTER, "close", 0)}
    finally:
        front.stop()


def test_dead_drafter_degrades_its_sessions_and_is_restarted(model, plain):
    """A drafter that dies under a running turn: the turn goes on plain to the end (the trunk's greedy
    output, no error), the drafter is restarted, and a later turn speculates again."""
    tr, restarts = Faulty(model), []
    front = _front(tr, restarts)
    try:
        a = _turn(front, 1, max_tokens=60, spec="mtp")
        assert a.first.wait(30)
        tr.dead.add(DRAFTER)
        assert a.done.wait(30) and a.err is None and a.tokens == plain  # plain decoding: the same greedy output
        assert _wait(lambda: restarts and not front.sched.unavailable)
        assert restarts == [DRAFTER]
        n = len(tr.calls)
        b = _turn(front, 2, max_tokens=60, spec="mtp")  # speculates again
        assert b.done.wait(30) and b.err is None, b.err
        assert b.tokens == plain and tr.drafts_since(n) > 0
        g = front.gauge_values()
        assert (g["degraded_sessions"], g["stage_restarts"]) == (1, 1)
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
    """While Triton reloads a drafter model (restarting its dead process) it answers ``is_model_ready`` with
    UNAVAILABLE "Server not ready" (seen in tests/test_faults_served.py's restart case): health reads NOT READY
    for it, and READY for the ``tandem`` model, instead of raising; a model never loaded is left out; other
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

        def get_model_repository_index(self, **kw):
            names = ("drafter_mtp", "tandem")  # (drafter_dflash: in the repository, never loaded)
            return {"models": [{"name": n, "state": "READY"} for n in names] + [{"name": "drafter_dflash"}]}

        def is_model_ready(self, name, **kw):
            if name == "drafter_mtp":
                raise InferenceServerException(self.answer, status="StatusCode.UNAVAILABLE")
            return True

        def infer(self, name, inputs, **kw):
            return None

        def close(self):
            pass

    monkeypatch.setattr(grpcclient, "InferenceServerClient", Reloading)
    health = stage_health("127.0.0.1:1")
    assert health == {"drafter_mtp": "NOT READY", "tandem": "READY"}, health
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
    tr.hang.add((DRAFTER, "close"))
    try:
        deadline = time.monotonic() + 10
        while not (tr.calls and tr.calls[-1] == (DRAFTER, "close", 0)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tr.calls[-1] == (DRAFTER, "close", 0)  # the probe hangs
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
