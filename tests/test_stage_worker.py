"""The decoupled stage model's compute thread (tandem.serving.stage_worker.StageWorker) with fake
Python-backend requests: arrival order, one final response each, a failing request that does not stop
the later ones, and a bounded stop; and the references a decoupled BLS call leaves
(BarrierRelease), released by a later ``is_cancelled`` round trip of SendQueue."""

from __future__ import annotations

import os
import threading
import time

from tandem.serving.backend import SendQueue, requested_only
from tandem.serving.stage_worker import BarrierRelease, StageWorker, set_thread_nice

FINAL = 1


class Sender:
    def __init__(self, log: list, fail: bool = False, cancelled: bool = False) -> None:
        self.log, self.fail, self.cancelled, self.checks = log, fail, cancelled, 0

    def send(self, response=None, flags=0):
        if self.fail:
            raise RuntimeError("stream gone")
        self.log.append((response, flags))

    def is_cancelled(self):
        self.checks += 1
        return self.cancelled


class Request:
    def __init__(self, value, out: list, fail_send: bool = False) -> None:
        self.value, self.sender = value, Sender(out, fail_send)

    def get_response_sender(self):
        return self.sender


def _wait(cond, timeout_s=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s
        time.sleep(0.005)


def test_requests_run_in_order_one_final_response_each_and_a_failure_stops_nothing():
    ran, out, logs = [], [], []
    gate = threading.Event()

    def run(r):
        if r.value == "boom":
            raise ValueError("bad request")
        if r.value == 0:
            gate.wait(5)  # a slow first request: the later ones wait their turn
        ran.append(r.value)
        return f"response {r.value}"

    w = StageWorker(run, FINAL, logs.append, "t")
    reqs = [Request(i, out) for i in range(3)] + [
        Request("boom", out),
        Request("gone", out, fail_send=True),
        Request(3, out),
    ]
    w.submit(reqs[:2])
    w.submit(reqs[2:])  # submit returned while request 0 still runs: execute never waits on the work
    assert ran == [] and out == []
    gate.set()
    _wait(lambda: len(out) == 5)
    assert ran == [0, 1, 2, "gone", 3]
    assert out == [
        ("response 0", FINAL),
        ("response 1", FINAL),
        ("response 2", FINAL),
        (None, FINAL),
        ("response 3", FINAL),
    ]  # the failed request: the final flag alone
    assert any("ValueError: bad request" in m for m in logs) and any("stream gone" in m for m in logs)
    assert w.stop() is True


def test_summary_tells_the_compute_threads_time_off_the_cpu_from_its_time_on_it():
    def run(r):
        if r.value == "sleep":
            time.sleep(0.05)  # off the CPU
        else:
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.05:  # on the CPU
                pass
        return r.value

    out: list = []
    w = StageWorker(run, FINAL, print, "t")
    assert w.summary() == {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0, "off_cpu": 0.0}
    w.submit([Request("sleep", out)])
    _wait(lambda: len(out) == 1)
    asleep = w.summary()
    assert asleep["calls"] == 1 and asleep["wall_s"] >= 0.05 and asleep["off_cpu"] > 0.8
    w.submit([Request("spin", out), Request("spin", out), Request("spin", out)])
    _wait(lambda: len(out) == 4)
    s = w.summary()
    assert s["calls"] == 4 and s["cpu_s"] >= 0.15 and s["off_cpu"] < 0.6  # 0.05 s of 0.2 s asleep, some switched out
    assert w.stop() is True


def test_stop_is_bounded_and_logs_a_compute_thread_left_behind():
    release, logs = threading.Event(), []
    w = StageWorker(lambda r: release.wait(30), FINAL, logs.append, "t")
    w.submit([Request(0, [])])
    time.sleep(0.05)
    t0 = time.monotonic()
    assert w.stop(timeout_s=0.3) is False
    assert time.monotonic() - t0 < 1.0
    assert any("did not stop within 0.3 s" in m and "wait" in m for m in logs), logs
    release.set()


def test_barrier_release_holds_until_a_later_barrier_or_the_age_bound():
    b = BarrierRelease(max_age_s=60)
    b.keep("a")
    b.keep("b")
    m = b.mark()
    b.keep("c")  # kept after the mark: a barrier that began before it proves nothing for it
    assert len(b) == 3
    assert b.release(m) == 2 and len(b) == 1
    assert b.release(m) == 0 and len(b) == 1
    assert b.release(b.mark()) == 1 and len(b) == 0
    old = BarrierRelease(max_age_s=0.01)
    old.keep("x")
    time.sleep(0.03)
    old.keep("y")  # keeping drops what is past its age
    assert len(old) == 1


def test_send_queue_releases_held_references_only_after_an_is_cancelled_that_answered_false():
    held, out = BarrierRelease(max_age_s=60), []
    q = SendQueue(lambda arrays, error: (arrays, error), FINAL, lambda m: None, barrier=held)
    live, gone = Sender(out), Sender(out, cancelled=True)
    send_gone, _ = q.stream(gone)
    held.keep("iterator 1")
    send_gone({"X": 1}, None, False)  # answered True: maybe a cached flag, no round trip: nothing released
    assert q.flush() and gone.checks == 1 and len(held) == 1
    send_live, is_cancelled = q.stream(live, requested=("X",))
    send_live({"X": 1, "Y": 2}, None, True)  # a final send asks nothing
    assert q.flush() and live.checks == 0 and len(held) == 1
    send_live({"X": 3, "Y": 4}, None, False)
    assert q.flush() and live.checks == 1 and len(held) == 0 and not is_cancelled()
    # each response carries only the requested outputs (the sender would drop the rest without the GIL)
    assert [r for r, _ in out] == [({"X": 1}, None), ({"X": 1}, None), ({"X": 3}, None)]
    assert q.close()


def test_requested_only_keeps_all_when_none_were_requested():
    a = {"X": 1, "Y": 2}
    assert requested_only(a, []) == a and requested_only(a, ["Y", "Z"]) == {"Y": 2}


class _T:
    def __init__(self, name, value=None):
        self._name, self.value = name, value

    def name(self):
        return self._name

    def as_numpy(self):
        return self.value


class _Resp:
    def __init__(self, tensors=(), error=None):
        self.tensors, self.err = list(tensors), error

    def has_error(self):
        return self.err is not None

    def error(self):
        return type("E", (), {"message": lambda s: self.err})()

    def output_tensors(self):
        return self.tensors


def _fake_pb(answers: list):
    """A ``pb_utils`` whose requests answer, in turn, the response lists in ``answers`` (decoupled)."""
    import types

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names, **kw):
            self.requested = requested_output_names

        def exec(self, decoupled=False):
            assert decoupled  # the trunk is decoupled: a plain exec would be refused by the server
            return iter(answers.pop(0))

    return types.SimpleNamespace(Tensor=_T, InferenceRequest=InferenceRequest)


def test_bls_transport_reads_a_decoupled_call_and_holds_its_iterator():
    import numpy as np
    import pytest

    from tandem import schema
    from tandem.serving.proxies import BLSTransport, StageError

    names = schema.TRUNK.output_names
    full = [_T(n, np.arange(3) + i) for i, n in enumerate(names)]
    t = BLSTransport(
        _fake_pb([[_Resp(full), _Resp()], [_Resp(error="SIDS: unknown sequence id 7"), _Resp()], [_Resp()]])
    )
    out = t(schema.TRUNK, "close", {"SIDS": np.zeros(0, np.int64)})
    assert list(out) == list(names) and (out[names[1]] == np.arange(3) + 1).all()
    assert len(t.held) == 1  # the iterator waits for a barrier
    with pytest.raises(StageError, match="unknown sequence id 7"):
        t(schema.TRUNK, "close", {"SIDS": np.array([7], np.int64)})
    with pytest.raises(StageError, match="ended without a response"):
        t(schema.TRUNK, "close", {"SIDS": np.zeros(0, np.int64)})
    assert len(t.held) == 3 and t.stats.calls["trunk.close"] == 3


def test_decoupled_caller_gives_up_on_a_call_whose_process_died_and_waits_out_a_slow_live_one():
    import pytest

    from tandem.serving.stage_worker import DecoupledCaller, StageDied

    forever, slow = threading.Event(), threading.Event()

    def blocked(until):  # a response iterator whose next() waits, as for an answer that never comes
        until.wait(30)
        yield _Resp([_T("ARGMAX", 1)])

    held = BarrierRelease(max_age_s=60)
    c = DecoupledCaller(held, check_s=0.05)
    probes = []

    def dead_probe():
        probes.append(1)
        return iter([_Resp(error="Stub process 'trunk_0_0' is not healthy."), _Resp()])

    t0 = time.monotonic()
    with pytest.raises(StageDied, match="is not healthy"):
        c.call("trunk", lambda: blocked(forever), dead_probe)
    assert time.monotonic() - t0 < 1.0 and len(probes) >= 1
    # the abandoned read keeps its thread; the next call gets a reader of its own and is answered
    r = c.call("trunk", lambda: iter([_Resp([_T("ARGMAX", 2)]), _Resp()]), dead_probe)
    assert r.output_tensors()[0].value == 2
    # a live process busy with a long call: its probes are queued behind it (never answered meanwhile)
    threading.Timer(0.3, slow.set).start()
    r = c.call("trunk", lambda: blocked(slow), lambda: blocked(slow))
    assert r.output_tensors()[0].value == 1
    forever.set()
    c.stop()


def test_a_death_found_by_one_call_ends_every_call_sent_before_it():
    """Two calls in flight (a burst's call and its pipelined next) when the process dies: the probe of
    one finds it; the other ends too, although the restarted model answers its own later probes."""
    from tandem.serving.stage_worker import DecoupledCaller, StageDied

    forever = threading.Event()

    def blocked():
        forever.wait(30)
        yield _Resp([_T("ARGMAX", 1)])

    c = DecoupledCaller(BarrierRelease(max_age_s=60), check_s=0.05)
    answers = iter([[_Resp(error="Stub process 'trunk_0_0' is not healthy."), _Resp()]])
    probe = lambda: iter(next(answers, [_Resp([_T("ARGMAX", 0)]), _Resp()]))  # noqa: E731 - dead once, then back
    errors = []

    def call():
        try:
            c.call("trunk", blocked, probe)
        except StageDied as e:
            errors.append(str(e))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3)
    assert errors == ["Stub process 'trunk_0_0' is not healthy."] * 2
    r = c.call("trunk", lambda: iter([_Resp([_T("ARGMAX", 2)]), _Resp()]), probe)  # a call after the death
    assert r.output_tensors()[0].value == 2
    forever.set()
    c.stop()


def _nice_now(r=None):
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class NiceSender(Sender):
    def send(self, response=None, flags=0):
        self.log.append((response, _nice_now()))


def test_the_compute_and_send_threads_run_at_their_nice_value_and_a_refusal_leaves_them_running(monkeypatch):
    """The compute thread takes ``nice`` before the worker is built, the sender thread too (raising a nice
    value needs no privilege); one the process may not take is reported in ``priority`` and the requests
    still run."""
    out = []
    base = os.getpriority(os.PRIO_PROCESS, 0)
    w = StageWorker(_nice_now, FINAL, out.append, "t", nice=min(base + 3, 19))
    assert w.priority == f"nice {min(base + 3, 19)}"
    req = Request(0, out)
    req.sender = NiceSender(out)
    w.submit([req])
    _wait(lambda: len(out) == 1)
    assert out == [(min(base + 3, 19), min(base + 3, 19))]  # computed there, sent from there
    assert w.stop()

    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    assert set_thread_nice(-10) == f"nice {base} (nice -10 refused: Operation not permitted; it needs CAP_SYS_NICE)"
    w = StageWorker(_nice_now, FINAL, out.append, "t", nice=-10)
    assert w.priority.startswith(f"nice {base} (nice -10 refused")
    w.submit([Request(1, out)])
    _wait(lambda: len(out) == 2)
    assert out[1] == (base, FINAL)
    assert w.stop()
    assert set_thread_nice(0) == f"nice {base}"  # 0 leaves the thread as it is
