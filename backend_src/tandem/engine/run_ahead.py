"""Run-ahead for the co-located stage host (``run_ahead`` with ``colocate``; off by default): while a
``draft_verify`` answer travels back to the ``tandem`` process and its next call travels here
(~1.4-1.9 ms a call on these machines, ~10 calls a 128-token turn), the trunk's process runs the
call it expects next: the same sequences that continue, each from the anchor and commit its last
round's accept walk gave, with the same arm, draft count, rounds and stop ids and the budget and room
the call used up. When the next call is that one, its answer is ready (or being finished); when it is
not (a new session was admitted, a turn was cut by a stop string only the ``tandem`` process sees,
the demotion policy changed a plan, a session was cancelled), the speculative call is stopped at its
next round boundary and every state it touched is put back, then the real call runs. The answer of a
call is the same either way: the rows are computed by the same code on the same states.

Measured on this 2-core machine (README, Serving) it does not pay: the client, ``tritonserver`` and the
``tandem`` process use the cores while a call travels, and the speculative call, slowed by them, has
hardly begun when the real one arrives (a 6 ms head start, then a 34 ms wait for a ~26 ms call).

What a speculative call changes, and how :class:`Snapshot` puts it back (per sequence it runs):

- the trunk cache (:class:`~tandem.model.cache.TrunkCache`): ``pos``, the layer list (a commit
  replaces KDA states; the states of a verify pass live in buffers made for that pass, so earlier
  states are never written), ``pending`` / ``pending_rows``, and each MLA cache's row and pool
  counts. MLA rows are written in place after the committed ones: the speculative call kept the
  first ``m`` rows of the pending verify (its predicted commit) and wrote its own rows after them,
  so after a restore only those ``m`` pending rows are intact and ``pending_rows`` says so (a real
  commit of more rows would be refused, never read stale rows; the tandem process's walk, a replay of
  the same walk, commits at most ``m``);
- the host's pending verify output and not-yet-ingested rows of the sequence;
- the drafter state: MTP (its cache's counts and ``committed``: rows after it are the previous
  round's chained steps, dropped by the next draft) or DFlash (``arm``, ``kv``: rebuilt by
  concatenation, never written in place; ``rows``).

Sampled rows draw from counter-based streams keyed by position (:mod:`tandem.engine.sampling`), so
a call computed ahead draws exactly what the real call would.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import torch

from ..model.cache import MLACache
from .protocols import RoundsPlan, Rows

#: a call's identity: per sequence (sid, anchor, commit, arm, k, rounds, budget, stop ids, room)
Key = tuple


def call_key(items: list[Rows], plans: list[RoundsPlan]) -> Key:
    """The identity of a ``draft_verify`` call: equal keys, equal answers (on equal states)."""
    return tuple(
        (it.sid, tuple(it.tokens), it.commit, p.arm, p.k, p.rounds, p.budget, tuple(p.stop_ids), p.room)
        for it, p in zip(items, plans)
    )


def next_call(
    items: list[Rows], plans: list[RoundsPlan], cont: list[tuple[int, int, int, bool] | None]
) -> tuple[list[Rows], list[RoundsPlan]]:
    """The call the scheduler makes next when nothing else happens: per sequence whose turn goes on
    (``cont[j] = (anchor, commit, used, alive)`` from :meth:`StageHost._run_rounds`; ``used``: the
    tokens this call committed, the pending commit of its last round included) its next anchor and
    commit, the same arm, ``k``, rounds and stop ids, the budget and room left."""
    nxt_items, nxt_plans = [], []
    for it, p, c in zip(items, plans, cont):
        if c is None or not c[3]:
            continue
        anchor, commit, used, _ = c
        nxt_items.append(Rows(it.sid, [anchor], commit=commit))
        nxt_plans.append(RoundsPlan(p.arm, p.k, p.rounds, p.budget - used, p.stop_ids, p.room - used))
    return nxt_items, nxt_plans


@dataclasses.dataclass
class _Seq:
    pos: int
    layers: list
    pending: object
    pending_rows: int
    mla: list[tuple[MLACache, int, int]]
    host_pending: object
    ingest: object
    drafter: tuple | None
    kept: int = 0  # the pending rows the speculative call commits (its first round's commit)


class Snapshot:
    """What a speculative ``draft_verify`` call may change, for the sequences of ``items``/``plans``,
    taken on ``host`` (a :class:`~tandem.engine.colocated.StageHost`) before the call.
    :meth:`restore` puts it back (see the module's docstring for why references suffice)."""

    def __init__(self, host, items: list[Rows], plans: list[RoundsPlan]) -> None:
        self.host = host
        self.seqs: dict[int, _Seq] = {}
        for it, p in zip(items, plans):
            c = host.trunk.cache(it.sid)
            ing = host.ingest.get(it.sid)
            self.seqs[it.sid] = _Seq(
                c.pos,
                list(c.layers),
                c.pending,
                c.pending_rows,
                [(m, m._n, m._np) for m in c.layers if isinstance(m, MLACache)],
                host.pending.get(it.sid),
                None if ing is None else (ing, list(ing.outs), list(ing.tokens)),
                self._drafter(host, p.arm, it.sid),
                it.commit,
            )

    @staticmethod
    def _drafter(host, arm: str | None, sid: int) -> tuple | None:
        stage = host.drafters.get(arm) if arm else None
        st = None if stage is None else stage.states.get(sid)
        if st is None:
            return None
        if hasattr(st, "kv"):  # DFlash
            return st, ("dflash", st.arm, st.kv, st.rows)
        return st, ("mtp", st.committed, st.cache._n, st.cache._np)

    def restore(self) -> None:
        """Put every recorded state back (the sequences must still be open: nothing closes them while
        a speculative call may run, :class:`RunAhead` settles it first)."""
        host = self.host
        for sid, s in self.seqs.items():
            c = host.trunk.cache(sid)
            c.pos, c.layers[:] = s.pos, s.layers
            kept = s.kept if s.pending is not None and s.kept else s.pending_rows
            c.pending, c.pending_rows = s.pending, min(s.pending_rows, kept)
            for m, n, npools in s.mla:
                m._n, m._np = min(n, s.pos + c.pending_rows), min(npools, (s.pos + c.pending_rows) // m.kp)
            if s.host_pending is None:
                host.pending.pop(sid, None)
            else:
                host.pending[sid] = s.host_pending
            if s.ingest is None:
                host.ingest.pop(sid, None)
            else:
                ing, outs, tokens = s.ingest
                ing.outs[:], ing.tokens[:] = outs, tokens
                host.ingest[sid] = ing
            if s.drafter is not None:
                st, saved = s.drafter
                if saved[0] == "dflash":
                    st.arm, st.kv, st.rows = saved[1:]
                else:
                    st.committed, st.cache._n, st.cache._np = saved[1:]


class RunAhead:
    """The speculative call in flight on a background thread, at most one.

    ``run(items, plans, should_stop)`` is the host's rounds function (returns ``(result, cont)``);
    :meth:`start` snapshots and starts it; :meth:`take` answers a real call: the result when the keys
    match (waiting for it), else None after stopping it and restoring the states; :meth:`settle` does
    the latter for any other op. ``hits`` / ``misses`` count calls answered ahead / not."""

    def __init__(self, host, run: Callable) -> None:
        self.host, self.run = host, run
        self.hits = self.misses = 0
        #: over the hits: seconds from a speculative call's start to the real call's arrival (its head
        #: start), and seconds the real call then waited for it
        self.head_s = self.wait_s = 0.0
        self._t0 = 0.0
        self._key: Key | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._snap: Snapshot | None = None
        self._out: tuple | None = None
        self._error: BaseException | None = None
        #: the speculative call's (items, plans) (its answer's call, after a hit)
        self.call: tuple[list[Rows], list[RoundsPlan]] = ([], [])
        self._shapes: dict[int, tuple] = {}  # per sequence (arm, k, rounds) of the last real call

    @property
    def busy(self) -> bool:
        """A speculative call was started and not yet taken or settled."""
        return self._thread is not None

    def steady(self, items: list[Rows], plans: list[RoundsPlan]) -> bool:
        """Whether a call keeps each sequence's arm, draft count and rounds of its previous call (or is
        its first): only then is the call after it worth running ahead. A sequence whose plan changes
        from call to call (the demotion policy probing, a burst split around a probe) would make the
        guess miss, and a miss costs the real call the rest of a speculative round."""
        shapes = {it.sid: (p.arm, p.k, p.rounds) for it, p in zip(items, plans)}
        ok = all(self._shapes.get(sid, v) == v for sid, v in shapes.items())
        self._shapes = shapes
        return ok

    def start(self, items: list[Rows], plans: list[RoundsPlan]) -> None:
        """Run the call ``items``/``plans`` on a thread of its own (nothing when there is no sequence)."""
        assert self._thread is None, "one speculative call at a time"
        if not items:
            return
        self._key, self._snap, self._out, self._error = (
            call_key(items, plans),
            Snapshot(self.host, items, plans),
            None,
            None,
        )
        self.call = (items, plans)
        self._stop.clear()
        self._t0 = time.perf_counter()

        def body():
            try:
                with torch.no_grad():  # grad mode is per thread (the row-invariant kernels need it off)
                    self._out = self.run(items, plans, self._stop.is_set)
            except BaseException as e:  # noqa: BLE001 - a failed speculative call is only undone
                self._error = e

        self._thread = threading.Thread(target=body, name="tandem-run-ahead", daemon=True)
        self._thread.start()

    def take(self, key: Key) -> tuple | None:
        """The speculative call's ``(result, cont)`` when its key is ``key`` and it ran to its end;
        else None, with every state it changed put back."""
        if self._thread is None:
            return None
        if key != self._key:
            self._stop.set()
        t = time.perf_counter()
        self._thread.join()
        self._thread = None
        if key == self._key and self._error is None and not self._stop.is_set():
            self.hits += 1
            self.head_s += t - self._t0
            self.wait_s += time.perf_counter() - t
            return self._out
        self.misses += 1
        self._snap.restore()
        return None

    def summary(self) -> str:
        """Hits, misses and the hits' mean head start and wait (ms), for the log."""
        n = max(self.hits, 1)
        return (
            f"run-ahead {self.hits} hits (head start {1e3 * self.head_s / n:.1f} ms, then waited "
            f"{1e3 * self.wait_s / n:.1f} ms), {self.misses} misses"
        )

    def settle(self) -> None:
        """Stop and undo the speculative call, if any (before any op but a ``draft_verify``)."""
        if self._thread is not None:
            self.take(None)
