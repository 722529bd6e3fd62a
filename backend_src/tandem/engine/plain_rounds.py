"""The scheduler's plain decode rounds in one trunk call: when every active session decodes plain
greedy rows (arm ``off``, no sampling, no stop strings), the rounds of a burst go to the trunk as
one :meth:`~tandem.engine.trunk_stage.TrunkStage.decode` call (compiled on the CPU,
:mod:`tandem.model.cpu_decode`) instead of one verify call each, and are then applied round by round
with the same accept walk: the same tokens, receipts and caches as the rounds one at a time."""

from __future__ import annotations

import math
import time

from .. import schema
from .protocols import Rows
from .session import Receipt


class PlainRounds:
    """Mixin of :class:`~tandem.engine.scheduler.Scheduler`: a burst's rounds without a hosting trunk
    (:meth:`_rounds_burst`), the plain greedy ones in one call (:meth:`_plain_rounds`)."""

    def _rounds_burst(self, receipts: dict, deadline: float | None) -> None:
        """Up to ``burst_rounds`` rounds (:meth:`~tandem.engine.scheduler.Scheduler.round`, or several in
        one :meth:`_plain_rounds` call), ending at the first round boundary after ``deadline``."""
        n = 0
        plain = self._all_plain(self.active())  # once a burst: a speculative burst never asks again
        while n < self.config.burst_rounds and self.active():
            if deadline is not None and receipts and time.perf_counter() >= deadline:
                break
            k = self._plain_rounds(receipts, self.config.burst_rounds - n, deadline) if plain else 0
            if not k:
                self.round(receipts)
            n += k or 1

    #: seconds a round of the last decode call took (0: none yet), to end a burst near ``burst_ms``
    _decode_round_s = 0.0

    def _all_plain(self, act: list) -> bool:
        """Whether the sessions ``act`` (some) all decode plain greedy rows (arm ``off``, no sampling, no
        stop strings) on a trunk that decodes them in one call (not a hosting one: it decides itself)."""
        return (bool(act) and getattr(self.trunk, "decode", None) is not None
                and not getattr(self.trunk, "hosts_drafters", False)
                and all(s.arm == schema.OFF and s.sampling is None and s.stop_text is None for s in act))

    def _plain_rounds(self, receipts: dict, most: int, deadline: float | None = None) -> int:
        """Run up to ``most`` rounds of every active session in one trunk ``decode`` call when they all
        decode plain greedy rows and each can run two rounds at least (its budget and context room);
        with a ``deadline`` (``time.perf_counter()`` seconds), only the rounds that end at the first
        round boundary after it at the last call's pace (:func:`rounds_until`). Returns the rounds run
        (0: not applicable, nothing ran)."""
        act = self.active()
        if not self._all_plain(act):
            return 0
        steps = min(most, rounds_until(deadline, self._decode_round_s),
                    *(min(s.turn_remaining, s.max_ctx - 1 - len(s.committed)) for s in act))
        if steps < 2:
            return 0
        t0 = time.perf_counter()
        outs = self.trunk.decode([Rows(s.sid, [s.anchor], commit=s.trunk_commit) for s in act], steps,
                                 [tuple(s.stop_ids) for s in act])
        t1 = time.perf_counter()
        n = max(len(os) for os in outs)  # (groups of sequences may stop at different rounds)
        self._decode_round_s = (t1 - t0) / n
        for t in range(n):
            for s, os in zip(act, outs):
                if t < len(os):
                    assert not s.turn_done, "a plain decode call ran past a finished turn"
                    r = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
                    s.trunk_commit = self._after_verify(s, [], os[t], r, None)
        self.stats["rounds"] += sum(len(os) for os in outs)
        tm = self.timing
        tm["verify_s"] += t1 - t0
        tm["accept_s"] += time.perf_counter() - t1
        tm["rounds"] += n
        return n


def rounds_until(deadline: float | None, round_s: float) -> int:
    """Rounds of ``round_s`` seconds each that end at the first round boundary after ``deadline``
    (``time.perf_counter()`` seconds; None: no limit): one once it has passed, else two at least (a
    slow call, e.g. the first one's compile, must not keep every later burst from one call); before a
    pace is measured, no limit."""
    if deadline is None:
        return 1 << 30
    left = deadline - time.perf_counter()
    if left <= 0:
        return 1
    return max(2, math.ceil(left / round_s)) if round_s > 0 else 1 << 30
