"""The engine core's plain decode rounds in one trunk call: while every active session decodes plain
greedy rows (greedy, no stop strings, and no drafts: spec ``off``, a degraded session, or a resting one
until its probe round), the rounds of a burst go to the trunk as one
:meth:`~tandem.engine.trunk_stage.TrunkStage.decode` call (compiled on the CPU,
:mod:`tandem.ops.cpu.decode`) instead of one verify call each, and are then applied as the
speculative round (:class:`~tandem.engine.spec_round.SpecRound`) applies rounds without drafts: the
same tokens, receipts, caches, drafter rows and probe clocks as the rounds one at a time."""

from __future__ import annotations

import math
import time

from .draft_length import DraftLength
from .protocols import Rows, TrunkAPI, VerifyOut
from .session import Receipt, SpecSession, finish


class PlainRounds:
    """A burst's plain greedy rounds in one trunk ``decode`` call (:meth:`run`).

    Args: ``trunk`` — the trunk stage (rounds in one call need its ``decode_rows``); ``policy`` — which
    sessions draft in the coming rounds (a resting session decodes plain until its probe round; its costs
    are told each call's pace); ``stats`` and ``timing`` — the engine core's counters (``rounds``) and stage
    clocks (``verify_s``, ``accept_s``, ``rounds``), added to in place.
    """

    def __init__(self, trunk: TrunkAPI, policy: DraftLength, stats: dict, timing: dict) -> None:
        self.trunk, self.policy, self.stats, self.timing = trunk, policy, stats, timing
        #: seconds a round of the last decode call took (0: none yet), to end a burst near ``burst_ms``
        self.round_s = 0.0

    def plain_rounds(self, act: list[SpecSession], most: int) -> int:
        """How many of the next ``most`` rounds every session of ``act`` decodes plain greedy rows (greedy, no
        stop strings, no structured output, no drafts: :meth:`~tandem.engine.draft_length.DraftLength.rests`) on
        a trunk that decodes them in one call; 0 when one of them may draft (or samples, has stop strings or is
        constrained) in the next round."""
        if not act or getattr(self.trunk, "decode_rows", None) is None:
            return 0
        n = most
        for s in act:
            if not s.plain_greedy():
                return 0
            n = min(n, self.policy.rests(s, len(act)))
            if n == 0:
                return 0
        return n

    def run(
        self, act: list[SpecSession], receipts: dict[int, Receipt], most: int, deadline: float | None = None
    ) -> tuple[int, bool]:
        """Run up to ``most`` rounds of the active sessions ``act`` in one trunk ``decode`` call when they
        all decode plain greedy rows for a round at least (:meth:`plain_rounds`, each session's budget and
        context room); with a ``deadline`` (``time.perf_counter()`` seconds), only the rounds that end
        at the first round boundary after it at the last call's pace (:func:`rounds_until`). Each
        session's receipt in ``receipts`` (made when missing) gets its rounds. Returns the rounds run
        (0: not applicable, nothing ran) and whether they were every round the deadline gave (the
        burst then ends: a second call for the time left would be mostly its fixed cost)."""
        plain = self.plain_rounds(act, most)
        if not plain:
            return 0, False
        paced = rounds_until(deadline, self.round_s)
        steps = min(plain, paced, *(min(s.turn_remaining, s.max_ctx - 1 - len(s.committed)) for s in act))
        if steps < 1:
            return 0, False
        t0 = time.perf_counter()
        outs = self.trunk.decode_rows(
            [Rows(s.sid, [s.anchor], commit=s.trunk_commit) for s in act], steps, [tuple(s.stop_ids) for s in act]
        )
        t1 = time.perf_counter()
        n = max(o.argmax.shape[0] for o in outs)  # (groups of sequences may stop at different rounds)
        self.round_s = (t1 - t0) / n
        self.policy.costs.saw_plain(len(act), self.round_s)
        for s, o in zip(act, outs):
            r = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
            s.trunk_commit = _apply(s, o, r)
            self.policy.ran_plain(s, o.argmax.shape[0])
        self.stats["rounds"] += sum(o.argmax.shape[0] for o in outs)
        tm = self.timing
        tm["verify_s"] += t1 - t0
        tm["accept_s"] += time.perf_counter() - t1
        tm["rounds"] += n
        return n, n == steps == paced


def _apply(s: SpecSession, out: VerifyOut, r: Receipt) -> int:
    """``n`` plain greedy rounds of ``s`` (no drafts) applied at once: ``out`` holds one row a round (round
    ``t`` verified its anchor as row ``t`` and emitted its target ``out.argmax[t]``). The session, the
    receipt ``r``, the rows the drafter has yet to take in (a resting session's, kept until its probe round)
    and the finish are what the speculative round (:class:`~tandem.engine.spec_round.SpecRound`) leaves
    after those rounds one at a time (a round without drafts emits its target; the turn ends at a stop id,
    at its budget or at the context end), without a walk a round. Returns the rows the next call commits
    (1). Raises ``AssertionError`` (nothing changed) when the turn ended before the last round."""
    targets, gaps = out.argmax.tolist(), out.top2_gap.tolist()
    n, n0, budget = len(targets), len(s.committed), s.turn_remaining
    assert s.stop_text is None and not s.turn_done and n >= 1, (s.sid, s.spec, s.turn_done, n)
    end = min(
        budget,
        max(1, s.max_ctx - 1 - n0),  # the first round that ends the turn (1-based)
        next((t + 1 for t, x in enumerate(targets) if x in s.stop_ids), n),
    )
    assert end >= n, f"sequence {s.sid}: a plain decode call ran past a finished turn (round {end} of {n})"
    s.rounds += n
    r.rounds += n
    s.committed.append(s.anchor)
    s.committed.extend(targets[:-1])
    s.anchor, s.turn_remaining = targets[-1], budget - n
    r.tokens.extend(targets)
    r.top2_gaps.extend(gaps)
    if s.drafts_later:  # a resting session: its rows wait for the drafter's next (probe) round
        s.queue_for_drafter(out, targets)
    else:
        s.ingest = (out.rows_at(n - 1), targets[-1:])
    s.last_active = time.monotonic()
    finish(s, r, "stop" if targets[-1] in s.stop_ids else ("length" if n == budget else None))
    return 1


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
