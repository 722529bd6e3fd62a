"""What a round costs on this machine, measured: the model the adaptive draft length
(:mod:`tandem.engine.draft_length`) weighs expected tokens against.

Three measured quantities, each from the engine core's own rounds (and a calibration at load,
:func:`tandem.engine.calibration.calibrate`, so the first turn already has them):

- ``plain_s(L)``: seconds of one round of ``L`` sessions decoding plain greedy rows in one compiled call
  (:class:`~tandem.engine.plain_rounds.PlainRounds`), per ``L``;
- ``verify_s(R)``: seconds of a verify round over ``R`` rows in all (the trunk's pass, the accept walks and
  the Python around them, :class:`~tandem.engine.spec_round.SpecRound`), a straight line in ``R`` fitted by
  least squares over the rounds seen (older rounds weigh less) and the calibration's points;
- ``draft_s(spec, k)``: seconds of one session's drafter round: a DFlash block forward costs about the
  same for any ``k``; the MTP drafter runs its layer once per draft, so its cost is per draft.

The verify line and the drafts are kept twice: for rounds one call at a time, and for the rounds a compiled call
runs together (:class:`~tandem.engine.compiled_rounds.CompiledRounds`: no Python between its parts, so cheaper per
row); the policy asks for the kind of round it plans (``compiled``), the other kind's measures standing in until
that kind has been measured.

Each is an exponentially weighted average, the newest observation weighing :data:`WEIGHT`: the machine's
speed drifts (other tenants, the batch), and the model follows it within tens of rounds.
"""

from __future__ import annotations

from .. import schema

#: weight of the newest observation in each average (about a 20-round window)
WEIGHT = 0.05
#: weight of the calibration's verify points, kept under the rounds' (so a slope stays defined when every
#: round verifies the same number of rows)
CALIBRATION_WEIGHT = 2.0


class _Line:
    """Least-squares line ``y = a + b x`` over weighted points: ``prior`` ones kept, ``seen`` ones decaying."""

    def __init__(self) -> None:
        self.prior = [0.0] * 5  # sum w, w x, w y, w x^2, w x y
        self.seen = [0.0] * 5

    def add(self, x: float, y: float, prior: bool = False) -> None:
        if prior:
            w, sums = CALIBRATION_WEIGHT, self.prior
        else:
            sums = self.seen
            for i in range(5):
                sums[i] *= 1 - WEIGHT
            w = 1.0
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            sums[i] += v

    def at(self, x: float) -> float | None:
        """The line's value at ``x`` (None before any point); one distinct ``x`` only: the mean ``y``
        scaled by ``x`` (a round's cost grows with its rows)."""
        n, sx, sy, sxx, sxy = (p + s for p, s in zip(self.prior, self.seen))
        if n <= 0:
            return None
        var = sxx / n - (sx / n) ** 2
        if var <= 1e-9 * max(1.0, sxx / n):
            return sy / sx * x if sx > 0 else sy / n
        b = (sxy / n - sx / n * sy / n) / var
        return sy / n + b * (x - sx / n)


class RoundCosts:
    """The measured costs (see the module text), shared by the engine core's schedulers (its warm-up and
    calibration turns, then the serving one)."""

    def __init__(self) -> None:
        self.reset()
        #: whether :func:`~tandem.engine.calibration.calibrate` has run (its points are in)
        self.calibrated = False
        #: while True (the calibration's measuring turns), verify rounds are kept as lasting points of the line
        self.calibrating = False

    def reset(self) -> None:
        """Forget every measure."""
        self.plain: dict[int, float] = {}
        self.verify = _Line()
        self.draft: dict[str, list[float]] = {}  # spec -> [seconds a session's round, drafts a round]
        self.verify_compiled = _Line()
        self.draft_compiled: dict[str, list[float]] = {}

    # -- what the rounds report ------------------------------------------------------------------
    def saw_plain(self, sessions: int, seconds: float) -> None:
        """A compiled plain round of ``sessions`` sessions took ``seconds``."""
        old = self.plain.get(sessions)
        self.plain[sessions] = seconds if old is None else old + WEIGHT * (seconds - old)

    def saw_verify(self, rows: int, seconds: float, compiled: bool = False) -> None:
        """A verify round of ``rows`` rows in all took ``seconds`` (trunk pass, walks, bookkeeping; ``compiled``: a
        round of a compiled call, its share of the call's time)."""
        (self.verify_compiled if compiled else self.verify).add(rows, seconds, prior=self.calibrating)

    def saw_draft(self, spec: str, sessions: int, drafts: int, seconds: float, compiled: bool = False) -> None:
        """A drafter call for ``sessions`` sessions of ``spec`` drafting ``drafts`` tokens in all took ``seconds``
        (``compiled``: the drafters' share of a compiled round)."""
        if sessions <= 0:
            return
        per, k = seconds / sessions, drafts / sessions
        table = self.draft_compiled if compiled else self.draft
        old = table.get(spec)
        if old is None:
            table[spec] = [per, k]
        else:
            old[0] += WEIGHT * (per - old[0])
            old[1] += WEIGHT * (k - old[1])

    # -- what the policy asks ---------------------------------------------------------------------
    def known(self, specs, compiled: bool = False) -> bool:
        """Whether every quantity the policy needs for sessions of ``specs`` has been measured (for ``compiled``
        rounds, either kind's measures)."""
        line = self.verify.at(1) is not None or (compiled and self.verify_compiled.at(1) is not None)
        drafts = all(a in self.draft or (compiled and a in self.draft_compiled) for a in specs)
        return bool(self.plain) and line and drafts

    def verify_s(self, rows: int, compiled: bool = False) -> float:
        """Seconds of a verify round over ``rows`` rows in all (``compiled``: of a compiled call's round)."""
        v = self.verify_compiled.at(rows) if compiled else None
        if v is None:
            v = self.verify.at(rows)
        if v is None and not compiled:
            v = self.verify_compiled.at(rows)
        return 0.0 if v is None else max(v, 1e-6)

    def plain_s(self, sessions: int) -> float:
        """Seconds of a compiled plain round of ``sessions`` sessions: measured at that count, else the nearest
        count measured plus the verify line's cost of the rows between (the same kernels per row)."""
        got = self.plain.get(sessions)
        if got is not None:
            return got
        near = min(self.plain, key=lambda n: abs(n - sessions))
        return max(self.plain[near] + self.verify_s(sessions) - self.verify_s(near), 1e-6)

    def draft_s(self, spec: str, k: int, compiled: bool = False) -> float:
        """Seconds of one session's drafter round of ``spec`` proposing ``k`` drafts (``compiled``: in a compiled
        call's round)."""
        got = self.draft_compiled.get(spec) if compiled else None
        per, mean_k = got or self.draft.get(spec) or self.draft_compiled[spec]
        return per * k / max(mean_k, 1e-9) if spec == schema.MTP else per

    def summary(self) -> dict[str, float]:
        """The measured costs in milliseconds (plain at 1 session, verify at 1 and 8 rows, each spec's draft; the
        serving log shows them at load)."""
        out = {"plain_1_ms": self.plain_s(1) * 1e3 if self.plain else 0.0}
        out.update({f"verify_{r}_ms": self.verify_s(r) * 1e3 for r in (1, 8)})
        out.update({f"draft_{a}_ms": v[0] * 1e3 for a, v in sorted(self.draft.items())})
        if self.verify_compiled.at(1) is not None:
            out.update({f"compiled_verify_{r}_ms": self.verify_compiled.at(r) * 1e3 for r in (1, 8)})
        out.update({f"compiled_draft_{a}_ms": v[0] * 1e3 for a, v in sorted(self.draft_compiled.items())})
        return out
