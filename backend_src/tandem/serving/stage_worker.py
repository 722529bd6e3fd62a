"""A decoupled stage model's compute thread (the ``trunk``), and the references a decoupled BLS call
leaves to be dropped safely in the calling process (``tandem``).

A non-decoupled Python-backend model gets its next request only after ``execute`` returned and its
response travelled out: the ``tandem`` model's pipelined ``draft_verify_next`` waited in Triton's
queue, and the trunk idled ~1.5 ms a call more than in-process (response out, next request in, through
the server's process). A decoupled ``trunk`` (:class:`StageWorker`) queues each request in ``execute``
and returns, so Triton hands the process the next request while one runs; one compute thread runs
them in arrival order (one at a time, as Triton's single instance did) and a sender thread sends each
response with the final flag, so the compute thread starts the next request at once.

The caller then iterates a decoupled BLS response iterator, which in the Python backend of Triton 2.51
is unsafe to simply drop: :class:`BarrierRelease` says why and keeps it.
"""

from __future__ import annotations

import collections
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable


def set_thread_nice(nice: int) -> str:
    """Set the calling thread's nice value (on Linux a thread's own; threads it starts later inherit it) to
    ``nice`` (-20..19: lower is served first when threads compete for a core). Returns what happened, for
    the log: ``"nice -10"``, or ``"nice 0 (nice -10 refused: ...)"`` when the process may not (below its
    current value it needs CAP_SYS_NICE); never raises for a refusal. ``0`` leaves the thread as it is."""
    tid = threading.get_native_id()
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:
            return f"nice {os.getpriority(os.PRIO_PROCESS, tid)} (nice {nice} refused: {e.strerror or e}; it needs CAP_SYS_NICE)"
    return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"


class StageWorker:
    """Runs ``run(request) -> response`` for each request on one thread, in arrival order, and sends
    each response through the request's sender with ``final_flag`` from a second thread. ``run`` never
    raises for a bad request (it answers with an error response); anything it does raise is logged
    with ``log(text)`` and the caller gets the final flag alone (the call ends without a response: the
    BLS caller reports "no response"). A response that cannot be sent (the caller's stream is gone) is
    logged and the other requests go on. :meth:`stop` ends both threads, bounded (a model's
    ``finalize`` must end inside the server's exit timeout). :meth:`summary` says how much of the
    compute thread's time inside ``run`` it spent off the CPU. Both threads run at ``nice``
    (:func:`set_thread_nice`; :attr:`priority` says what the compute thread got): on a busy machine the
    server's other threads and its clients then do not time-slice the thread that computes every answer,
    nor delay the one that sends it."""

    def __init__(
        self, run: Callable[[Any], Any], final_flag: int, log: Callable[[str], None], name: str = "stage", nice: int = 0
    ) -> None:
        self.run, self.final_flag, self.log, self.nice = run, final_flag, log, nice
        self.priority = ""  # the compute thread's nice value, as set_thread_nice says it (set before __init__ returns)
        self._started = threading.Event()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._calls, self._wall_s, self._cpu_s = 0, 0.0, 0.0  # requests run; seconds inside run, of them on the CPU
        self._compute = threading.Thread(target=self._compute_loop, name=f"{name}-compute", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._compute.start()
        self._sender.start()
        self._started.wait(5.0)

    def summary(self) -> dict:
        """``{"calls", "wall_s", "cpu_s", "off_cpu"}``: requests run, seconds inside ``run``, the compute
        thread's CPU seconds in them, and the share of the former it spent off the CPU (switched out for
        another thread, or waiting: for the GIL, for the decode pool's threads)."""
        wall, cpu = self._wall_s, self._cpu_s
        return {
            "calls": self._calls,
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3),
            "off_cpu": round(max(wall - cpu, 0.0) / wall, 4) if wall > 0 else 0.0,
        }

    def submit(self, requests) -> None:
        """Queue ``requests`` (Python-backend requests of a decoupled model) in order; returns at once."""
        for r in requests:
            self._work.put((r, r.get_response_sender()))

    def _compute_loop(self) -> None:
        self.priority = set_thread_nice(self.nice)
        self._started.set()
        while (item := self._work.get()) is not None:
            request, sender = item
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                response = self.run(request)
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one request (else all later hang)
                self.log(f"a request failed outside its handler: {type(e).__name__}: {e}")
                response = None
            self._calls += 1
            self._wall_s += time.perf_counter() - w0
            self._cpu_s += time.thread_time() - c0
            self._out.put((sender, response))
            del request, sender, response  # the request's tensors die on this thread, with the GIL
        self._out.put(None)

    def _send_loop(self) -> None:
        set_thread_nice(self.nice)  # its answers leave as soon as they are computed
        while (item := self._out.get()) is not None:
            sender, response = item
            try:
                if response is None:
                    sender.send(flags=self.final_flag)
                else:
                    sender.send(response, flags=self.final_flag)
            except Exception as e:  # noqa: BLE001 - one caller gone must not stop the others' responses
                self.log(f"could not send a response: {type(e).__name__}: {e}")
            del item, sender, response

    def stop(self, timeout_s: float = 3.0) -> bool:
        """Finish the queued requests and their responses, then end both threads, waiting at most
        ``timeout_s`` seconds for each; a compute thread still running then is left behind with its
        stack logged. Returns whether both threads ended."""
        self._work.put(None)
        self._compute.join(timeout_s)
        if self._compute.is_alive():
            frame = sys._current_frames().get(self._compute.ident)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
            self.log(f"compute thread did not stop within {timeout_s:g} s; left behind in:\n{where.rstrip()}")
            return False
        self._sender.join(timeout_s)
        return not self._sender.is_alive()


class BarrierRelease:
    """Objects kept alive until a later barrier, or ``max_age_s`` seconds.

    Why (Python backend of Triton 2.51, python_backend r24.10, read from its source): a decoupled BLS
    call's ``ResponseIterator`` is also held by the stub's ``response_iterator_map_``. The iterator's
    last ``__next__`` queues a cleanup message on the stub's stub-to-parent utility thread, which
    erases the map's entry *without the GIL*. When that erase drops the last reference, the iterator's
    responses and their tensors are freed on that thread, and ``~PbTensor`` releases each tensor's
    numpy array without the GIL (python_backend b771f4f, "Hold GIL when deleting numpy array", #390,
    Dec 2024, fixed it after 2.51). Under load this killed the ``tandem`` stub with
    ``pybind11_object_dealloc(): Tried to deallocate unregistered instance!`` (measured: twice in two
    runs of the 1,000-session fault test). Keeping our reference until the map's is surely gone makes
    ours the last one, dropped in Python with the GIL.

    The barrier: a ``ResponseSender.is_cancelled()`` that answered False made a round trip through
    the same utility queue (a True answer may be cached and prove nothing), and that queue is served
    in order, so every cleanup queued before it was sent has been processed. :meth:`mark` before such
    a call, :meth:`release` with the mark after it. Between turns (no stream, no barrier) entries go
    after ``max_age_s`` seconds (the utility thread serves a message in well under a millisecond)."""

    def __init__(self, max_age_s: float = 10.0) -> None:
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._held: collections.deque = collections.deque()  # (sequence number, monotonic time, object)
        self._n = 0

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` (after its cleanup was queued: a finished iterator); drops entries past their age."""
        now = time.monotonic()
        with self._lock:
            self._n += 1
            self._held.append((self._n, now, obj))
            old = self._pop(lambda n, t: now - t > self.max_age_s)
        del old  # dropped outside the lock

    def mark(self) -> int:
        """The number of the last object kept so far (before a barrier call)."""
        with self._lock:
            return self._n

    def release(self, mark: int) -> int:
        """Drop the objects kept up to ``mark`` (after a barrier call that began after :meth:`mark`);
        returns how many."""
        with self._lock:
            old = self._pop(lambda n, t: n <= mark)
        return len(old)

    def _pop(self, due: Callable[[int, float], bool]) -> list:
        out = []
        while self._held and due(self._held[0][0], self._held[0][1]):
            out.append(self._held.popleft())
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class StageDied(RuntimeError):
    """A decoupled call given up on: its model's process died (a probe's error text says so)."""


class _Threads:
    """Daemon threads that each run one job at a time, reused once their job ends: :meth:`run` returns
    a :class:`_Done` to wait on. A job that never ends (a call to a dead process) keeps its thread.
    (Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit.)"""

    def __init__(self, name: str) -> None:
        self.name = name
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()
        self._n = 0

    def run(self, fn: Callable[[], Any]) -> "_Done":
        done = _Done()
        with self._lock:
            if self._idle:
                q = self._idle.pop()
            else:
                self._n += 1
                q = queue.SimpleQueue()
                threading.Thread(target=self._loop, args=(q,), name=f"{self.name}-{self._n}", daemon=True).start()
        q.put((fn, done))
        return done

    def _loop(self, q: queue.SimpleQueue) -> None:
        while (job := q.get()) is not None:
            fn, done = job
            try:
                done.value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                done.error = e
            del job, fn
            with self._lock:
                self._idle.append(q)
            done.event.set()
            del done

    def stop(self) -> None:
        """End the idle threads (a busy one ends when its job does and it finds no more)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for q in idle:
            q.put(None)


class _Done:
    def __init__(self) -> None:
        self.event, self.value, self.error = threading.Event(), None, None

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


class DecoupledCaller:
    """Runs decoupled BLS calls (one response each, with the final flag) so that a caller is never
    stuck behind a dead process.

    A decoupled model's request in flight when its stub process dies is never answered in Triton 2.51
    (the Python backend answers "Stub process is not healthy" only to requests whose ``execute`` it is
    still waiting on; a decoupled ``execute`` has long returned), and both ``exec(decoupled=True)``
    (which returns with the first response) and the iterator's ``__next__`` wait in C++ with no
    timeout. So each call is sent and read on a thread of its own (:class:`_Threads`) while the caller
    waits; every ``check_s`` seconds of waiting it sends ``probe()`` (a no-op request of the same
    model, on a thread of its own; one at a time): a new request to a dead stub is answered with that
    error within ~1-2 s, and the caller then gets :class:`StageDied` with it, and so does every other
    call to that model sent before (a pipelined one: once the model is restarted its probes would be
    answered while the call never is). The abandoned call keeps its thread, as a hung call does. ``held`` receives each finished iterator (:class:`BarrierRelease`)."""

    def __init__(self, held: BarrierRelease, check_s: float = 0.5, stale_s: float = 5.0) -> None:
        self.held, self.check_s, self.stale_s = held, check_s, stale_s
        self._lock = threading.Lock()
        self._threads = _Threads("bls-call")
        self._probes: dict[str, tuple[_Done, float]] = {}  # model -> (its last probe, when sent)
        self._deaths: dict[str, tuple[int, str]] = {}  # model -> (deaths found so far, the last one's error)

    def read(self, it):
        """The first response of iterator ``it`` that carries tensors or an error (None: only the final
        flag came back); reads to the end and hands ``it`` to ``held``."""
        resp = None
        try:
            for r in it:  # until the final flag; an empty final response carries nothing
                if resp is None and (r.has_error() or r.output_tensors()):
                    resp = r
        finally:
            self.held.keep(it)
        return resp

    def call(self, model: str, send: Callable[[], Any], probe: Callable[[], Any]):
        """``send()`` (an ``exec(decoupled=True)``: returns the response iterator) -> its response
        (:meth:`read`). Raises :class:`StageDied` when ``probe()`` (the same, for a no-op request)
        answers an error saying the process is not healthy while this call waits."""
        seen = self._deaths.get(model, (0, ""))[0]  # a death found after this, by any call, ends this one too
        done = self._threads.run(lambda: self.read(send()))
        while not done.event.wait(self.check_s):
            if (why := self._dead(model, probe)) is not None:
                raise StageDied(why)
            if (death := self._deaths.get(model, (0, "")))[0] > seen:  # (another call's probe found it: the
                raise StageDied(death[1])  # restarted model answers this call's later probes, never this call)
        return done.result()

    def _dead(self, model: str, probe: Callable[[], Any]) -> str | None:
        """The error of ``model``'s last probe when it says the process is not healthy; else sends a new
        probe when the last one was answered, or has waited ``stale_s`` (queued behind the long call in
        a live process, or lost in one that died before answering it). A dead process answers a new
        probe in ~1-2 s (the backend's health wait)."""
        now = time.monotonic()
        with self._lock:
            p = self._probes.get(model)
            if p is not None and p[0].event.is_set():
                try:
                    resp = p[0].result()
                    msg = resp.error().message() if resp is not None and resp.has_error() else ""
                except Exception as e:  # noqa: BLE001 - a probe that could not be sent says the same
                    msg = str(e)
                del self._probes[model]
                if "not healthy" in msg:
                    self._deaths[model] = (self._deaths.get(model, (0, ""))[0] + 1, msg)
                    return msg
            elif p is not None and now - p[1] <= self.stale_s:
                return None
            self._probes[model] = (self._threads.run(lambda: self.read(probe())), now)
            return None

    def stop(self) -> None:
        """End the idle call threads (one blocked on a dead call stays: daemons)."""
        self._threads.stop()
