"""Pipelined ``draft_verify`` calls (``pipeline``, with ``colocate``): while the ``trunk`` runs call N, the
``tandem`` process has already sent call N+1, a ``draft_verify_next`` that continues the same sequences
from wherever call N leaves them (the trunk's process knows each one's next anchor, pending commit,
budget and room: :func:`~tandem.engine.run_ahead.next_call`). The decoupled ``trunk`` model takes it in
while N runs (:class:`~tandem.serving.stage_worker.StageWorker`) and starts it the moment N is done, so
the trunk does not idle while N's answer travels to ``tandem``, is replayed and published, and the next
call travels back (a few milliseconds a call, several calls a turn; docs/serving.md). The ``tandem``
process replays N+1 exactly like any call (:mod:`tandem.engine.hosted`):
the anchors are checked, the tokens are the same.

Both sides:

- :class:`LastCall` (the ``trunk`` process) remembers the last ``draft_verify`` / ``draft_verify_next``
  (its number ``CALL``, items, plans and where each sequence ended); any other op forgets it. A
  ``draft_verify_next`` numbered ``c`` is run only when the call remembered is ``c - 1`` over the same
  ``SIDS``; otherwise it is refused (:data:`NOT_NEXT`) before it changes anything.
- :class:`Pipeline` (the ``tandem`` process) is the transport of every call to the ``trunk`` model: it
  sends each ``draft_verify_next`` on a helper thread (``delay_s`` after call N was sent, so
  that N reaches Triton's queue first: BLS gives no order between threads; when the next call still
  arrives first it is refused, costing one short call), and any other call first waits for them to
  answer, so the next call is always the trunk's next op after N. The scheduler launches one only
  when nothing else can need the trunk first (:meth:`~tandem.engine.hosted.HostedRounds._may_chain`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

from .. import schema
from ..schema import WireError
from .protocols import RoundsPlan, Rows
from .run_ahead import next_call

#: the op of a pipelined call (in :data:`tandem.schema.TRUNK` ops)
NEXT_OP = "draft_verify_next"
#: the start of the trunk's answer to a ``draft_verify_next`` that is not the next call (refused, nothing ran)
NOT_NEXT = "CALL: draft_verify_next is not the call after"
#: seconds between sending call N and its ``draft_verify_next`` (BLS request transit here: ~0.7 ms)
DELAY_S = 0.002


class LastCall:
    """The ``trunk`` side: the last ``draft_verify`` call with a number (``CALL``), to continue it."""

    def __init__(self) -> None:
        self._last: tuple[int, list[Rows], list[RoundsPlan], list] | None = None
        #: a numbered ``prime`` (the last call): ``(number, sids, each sequence's first token)``
        self._primed: tuple[int, list[int], list[int]] | None = None

    def record(self, number: int | None, items: list[Rows], plans: list[RoundsPlan], cont: list) -> None:
        """After a call: ``cont[j]`` is ``(anchor, commit, used, alive)`` or None (no round), as
        :meth:`~tandem.engine.colocated.StageHost._run_rounds` returns; ``number`` None forgets."""
        self._last, self._primed = None if number is None else (number, items, plans, cont), None

    def record_prime(self, number: int, sids: list[int], anchors: list[int]) -> None:
        """After ``prime`` call ``number`` over ``sids``: ``anchors[j]`` is sequence j's first token (its
        last prompt row's target), the anchor of the ``draft_verify_next`` that continues it."""
        self._last, self._primed = None, (number, list(sids), list(anchors))

    def primed(self, number: int, sids: list[int]) -> list[int] | None:
        """The anchors of prime ``number - 1`` when that is the last call and was over ``sids``; else None."""
        p = self._primed
        return p[2] if p is not None and p[0] == number - 1 and p[1] == sids else None

    def forget(self) -> None:
        """Any other op ran: the trunk's state is no longer where the last call left it."""
        self._last = self._primed = None

    def next(self, number: int, sids: list[int], rounds: list[int]) -> tuple[list[Rows], list[RoundsPlan]]:
        """The items and plans of ``draft_verify_next`` ``number`` over ``sids`` with ``rounds[j]`` rounds
        at most: each sequence from its anchor and pending commit, with the arm, draft count and stop
        ids of the last call, the budget and room it left; a sequence whose turn ended there runs no
        round. Raises :class:`~tandem.schema.WireError` (:data:`NOT_NEXT`) when the remembered call is
        not ``number - 1`` over the same ``sids``."""
        last = self._last
        if last is None or last[0] != number - 1 or [it.sid for it in last[1]] != sids:
            have = (
                f"prime {self._primed[0]} over {len(self._primed[1])} sequences"
                if self._primed is not None
                else "none"
                if last is None
                else f"call {last[0]} over {len(last[1])} sequences"
            )
            raise WireError(f"{NOT_NEXT} {number - 1} over these SIDS (the trunk's last call: {have})")
        _, items, plans, cont = last
        nxt_items, nxt_plans = next_call(items, plans, cont)
        by_sid = {it.sid: (it, dataclasses.replace(p, rounds=0)) for it, p in zip(items, plans)}  # ended: no round
        by_sid.update((it.sid, (it, p)) for it, p in zip(nxt_items, nxt_plans))
        out = [by_sid[s] for s in sids]
        return [it for it, _ in out], [
            dataclasses.replace(p, rounds=r if p.rounds else 0) for (_, p), r in zip(out, rounds)
        ]


@dataclasses.dataclass
class Queued:
    """A ``draft_verify_next`` in flight: ``number``; ``sids`` (the call it continues, in order);
    ``plan``: sid -> (drafts?, rounds at most) as :meth:`~tandem.engine.demotion.Demotion.steady`
    fixed it; ``most``: the load bound that plan assumed; ``owners``: sid -> the session object it
    continues (a sequence id closed and opened again since is another session: its rounds are not
    replayed on it); ``future``: the per-sequence rounds."""

    number: int
    sids: list[int]
    plan: dict[int, tuple[bool, int]]
    most: int
    owners: dict
    future: Future
    #: another op reached the trunk after it (a close): a call continuing it would be refused
    followed: bool = False


class Pipeline:
    """The ``tandem`` side: a :class:`~tandem.serving.proxies.Transport` to the stage models (``inner``)
    that holds up to two pipelined calls in flight (the one running and the next, which is sent before
    the first is replayed), each sent on a helper thread. Every other call waits for them first.
    ``delay_s``: see :data:`DELAY_S`. Numbers the calls (:meth:`number`); counts ``calls`` (sent) and
    ``refused`` (answered :data:`NOT_NEXT`: nothing ran) in :attr:`counts`."""

    pipelines = True

    def __init__(self, inner, delay_s: float = DELAY_S) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.stats = getattr(inner, "stats", None)
        self.counts = {"calls": 0, "refused": 0}
        #: the last number given to a call (``draft_verify`` or ``draft_verify_next``)
        self.numbered = 0
        self._flight: deque[Queued] = deque()

    def number(self) -> int:
        """The next call's number (numbers only grow: a late call is refused, never mistaken for another)."""
        self.numbered += 1
        return self.numbered

    @property
    def queued(self) -> Queued | None:
        """The oldest pipelined call in flight (the next :meth:`take`), None when none."""
        return self._flight[0] if self._flight else None

    def __call__(self, model: schema.ModelSpec, op: str, arrays: schema.Arrays) -> schema.Arrays:
        if op != NEXT_OP:  # (a numbered call does not wait for the calls that will continue it)
            self.wait(int(arrays["CALL"][0]) if "CALL" in arrays else None)
            if "CALL" not in arrays:
                for q in self._flight:  # another op follows them on the trunk: nothing can continue them
                    q.followed = True
        return self.inner(model, op, arrays)

    def launch(
        self,
        number: int,
        sids: list[int],
        plan: dict[int, tuple[bool, int]],
        most: int,
        owners: dict,
        send: Callable[[], list],
    ) -> None:
        """Send ``send()`` (the proxy's ``draft_verify_next``) ``delay_s`` from now on a helper thread (a
        daemon: a call that never answers cannot hold the process at exit)."""
        assert len(self._flight) < 2, "two pipelined calls in flight at most"
        start, fut = time.perf_counter() + self.delay_s, Future()

        def run():
            time.sleep(max(0.0, start - time.perf_counter()))
            try:
                fut.set_result(send())
            except BaseException as e:  # noqa: BLE001 - the worker gets it from take()
                fut.set_exception(e)

        self.counts["calls"] += 1
        self._flight.append(Queued(number, list(sids), dict(plan), most, dict(owners), fut))
        threading.Thread(target=run, name=f"tandem-pipeline-{number}", daemon=True).start()

    def wait(self, before: int | None = None) -> None:
        """Block until the calls in flight (numbered below ``before``, None: all) have answered; their
        answers stay for :meth:`take`."""
        for q in list(self._flight):
            if before is not None and q.number >= before:
                continue
            try:
                q.future.exception()
            except Exception:  # noqa: BLE001 - taken by take()
                pass

    def take(self) -> tuple[Queued, list | None] | None:
        """The oldest call in flight and its answer (None: refused, nothing ran), after it answered;
        None when there is none. A failure other than a refusal raises here (the stage's error)."""
        if not self._flight:
            return None
        q = self._flight.popleft()
        try:
            return q, q.future.result()
        except Exception as e:  # noqa: BLE001 - a refusal is no failure
            if NOT_NEXT not in str(e):
                raise
            self.counts["refused"] += 1
            return q, None

    def drop(self) -> None:
        """Forget the calls in flight without waiting (a failure is ending their turns: the stage may not
        answer). Their sessions are closed next; a close that reaches the trunk first makes them refused."""
        self._flight.clear()
