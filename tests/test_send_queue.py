"""The ``tandem`` model's I/O helpers. ``SendQueue``: a decoupled model's responses leave on a
thread of their own, in order, the final flag on the last; ``is_cancelled`` follows the client after
each send; a failing send marks its stream cancelled and leaves the other streams alone; ``close``
sends what is queued first. ``tensors_by_name``: one pass over a request's or response's tensors."""

import threading

import numpy as np

from tandem.serving.send_queue import SendQueue
from tandem.serving.stage_io import tensors_by_name

FINAL = 1


class FakeSender:
    def __init__(self, fail_at: int | None = None) -> None:
        self.sent, self.cancelled, self.fail_at, self.calls = [], False, fail_at, 0
        self.threads = set()

    def send(self, response, flags=0):
        self.threads.add(threading.get_ident())
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("the client went away")
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


def test_responses_leave_in_order_on_their_own_thread_and_cancels_follow():
    logs = []
    q = SendQueue(lambda arrays, error: ("error", error) if error else ("ok", arrays), FINAL, logs.append)
    a, b, broken = FakeSender(), FakeSender(), FakeSender(fail_at=1)
    send_a, cancelled_a = q.stream(a)
    send_b, cancelled_b = q.stream(b)
    send_x, cancelled_x = q.stream(broken)
    for i in range(50):
        send_a({"i": i}, None, False)
        send_b({"i": i}, None, i == 49)
        if i < 3:
            send_x({"i": i}, None, False)
    a.cancelled = True  # the client cancels: seen after the next non-final send
    send_a({"i": 50}, None, False)
    send_a(None, "cancelled by the client", True)
    q.close()
    assert [r for r, _ in a.sent] == [("ok", {"i": i}) for i in range(51)] + [("error", "cancelled by the client")]
    assert [f for _, f in a.sent] == [0] * 51 + [FINAL] and [f for _, f in b.sent] == [0] * 49 + [FINAL]
    assert cancelled_a() and not cancelled_b()
    assert cancelled_x() and [r for r, _ in broken.sent] == [("ok", {"i": 0}), ("ok", {"i": 2})]
    assert len(logs) == 1 and "the client went away" in logs[0]
    assert a.threads == b.threads and threading.get_ident() not in a.threads


class _T:
    def __init__(self, name, value):
        self._name, self.value, self.reads = name, value, 0

    def name(self):
        return self._name

    def as_numpy(self):
        self.reads += 1
        return self.value


def test_tensors_by_name_reads_each_named_tensor_once_in_the_names_order():
    ts = [_T("B", np.array([2])), _T("X", np.array([9])), _T("A", np.array([1]))]
    got = tensors_by_name(ts, ("A", "B", "C"))
    assert list(got) == ["A", "B"] and got["A"].tolist() == [1] and got["B"].tolist() == [2]
    assert [t.reads for t in ts] == [1, 0, 1]  # X is not asked for; C is absent


def test_flush_returns_once_everything_queued_before_it_was_sent():
    gate = threading.Event()

    class Slow(FakeSender):
        def send(self, response, flags=0):
            gate.wait(5)
            super().send(response, flags)

    q = SendQueue(lambda arrays, error: (arrays, error), FINAL, log=lambda m: None)
    a = Slow()
    send, _ = q.stream(a)
    send({"x": 1}, None, False)
    send(None, "boom", True)
    assert not q.flush(timeout_s=0.2)  # the first send is still blocked
    gate.set()
    assert q.flush(timeout_s=5) and a.calls == 2
    q.close()
