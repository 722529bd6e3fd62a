"""The ``tandem`` model's responses, sent from a thread of their own."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .stage_io import requested_only


class SendQueue:
    """A decoupled model's responses sent by one thread of their own, in the order they were queued.

    In the Python backend ``ResponseSender.send`` and ``ResponseSender.is_cancelled`` are each a
    round trip to the server process (~0.6 ms apiece here: on the engine core's thread they would hold up
    the next burst). Here the worker only queues: :meth:`stream` gives a request's ``send``
    (queues ``(arrays, error, final)``) and ``is_cancelled(sync=False)`` (a flag this thread refreshes
    after each non-final send of that stream, so a client's cancel is seen one burst later; before the
    stream's first response ``sync`` True asks the server on the caller's thread, and False has this
    thread ask, for a later call to see). ``make(arrays,
    error)`` builds the response; ``final_flag`` is the backend's final-response flag. A send that
    raises marks its stream cancelled (the worker then ends the turn) and is logged with ``log``.
    """

    def __init__(self, make: Callable, final_flag: int, log: Callable[[str], None]) -> None:
        self.make, self.final_flag, self.log = make, final_flag, log
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tandem-sender", daemon=True)
        self._thread.start()

    def stream(self, sender, requested=()) -> tuple[Callable, Callable[[], bool]]:
        """``(send(arrays, error, final), is_cancelled(sync=False))`` of one request's response ``sender``;
        ``requested``: the request's requested output names (each response carries only those, see
        :func:`stage_response`; none: all)."""
        state = {"cancelled": False, "sent": False, "probing": False}

        def send(arrays, error, final) -> None:
            self._q.put((sender, requested_only(arrays, requested) if arrays else arrays, error, final, state))

        def is_cancelled(sync: bool = False) -> bool:
            if state["cancelled"] or state["sent"]:  # (refreshed after each non-final send)
                return state["cancelled"]
            if sync:
                state["cancelled"] = bool(sender.is_cancelled())
            elif not state["probing"]:
                state["probing"] = True
                self._q.put((sender, state))
            return state["cancelled"]

        return send, is_cancelled

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait until everything queued so far has been sent (at most ``timeout_s`` seconds); returns
        whether it was. (A stage restart calls it first: ``pb_utils.load_model`` holds the GIL until
        the model is loaded, seconds in which no thread of this process runs, this one included.)"""
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout_s)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if isinstance(item, threading.Event):  # a flush mark
                item.set()
                continue
            if len(item) == 2:  # a look at a stream that has sent nothing yet (see stream)
                sender, state = item
                try:
                    state["cancelled"] = state["cancelled"] or bool(sender.is_cancelled())
                except Exception as e:  # noqa: BLE001
                    self.log(f"could not ask whether a request was cancelled: {type(e).__name__}: {e}")
                state["probing"] = False
                continue
            sender, arrays, error, final, state = item
            try:
                sender.send(self.make(arrays, error), flags=self.final_flag if final else 0)
                if not final and not state["cancelled"]:  # (a cancel, or a failed send, stays)
                    state["cancelled"] = bool(sender.is_cancelled())
                    state["sent"] = True
            except Exception as e:  # noqa: BLE001 - a broken client must not stop the others' responses
                state["cancelled"] = True
                self.log(f"could not send a response: {type(e).__name__}: {e}")

    def close(self, timeout_s: float = 2.0) -> bool:
        """Send what is queued, then stop the thread (waits up to ``timeout_s`` seconds: a model's
        ``finalize`` must end inside the server's exit timeout); returns whether everything was sent."""
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.log(f"responses still unsent after {timeout_s:g} s at shutdown")
            return False
        return True
