"""Chunked prefill for the engine core (:class:`PrefillPlanner`), under a budget of prompt rows
per burst (the policy of vLLM's chunked prefill with ``max_num_batched_tokens``: decode first, then
prompt chunks from the budget). A burst cycle (the admissions before a burst, then the burst) primes at
most ``config.prefill_budget`` prompt rows, shared by every turn being primed, shortest remaining prompt
first; the streaming sessions' rounds run after them in the same burst. So a burst's prefill work is
bounded however many prompts wait, a short prompt arriving behind long ones is primed at its admission
(or in the next burst), and of several long prompts one finishes first instead of all finishing late.
With ``prefill_budget`` 0 every prompt is primed whole at its admission.

A prompt beyond its share keeps the rest in ``s.prefill`` (:class:`PendingPrefill`). Its first piece
goes with the admission's prime call (with the turn's prefix keys and the previous turn's commit): every
admitted turn primes at least its :meth:`PendingPrefill.least` piece there, since the prime call opens the
session and a prime has one row at least. Each later piece rides in one batched prime call at the start
of a burst (:meth:`PrefillPlanner.step`), with an empty prefix list where the prefix cache is in use (so
the trunk keeps cutting at multiples of ``PREFIX_BLOCK`` and capturing the states there).

Exactness: under ``batch_invariant`` on the CPU every prime row runs the row-wise kernels, so pieces of
any size leave every row bit-identical to one prime (``tests/test_trunk.py``;
:func:`tandem.model.device.invariant_prime`). Otherwise, with the prefix cache on, every piece but a
prompt's last ends at a multiple of ``PREFIX_BLOCK`` of the sequence's position, so the pieces are the ones
the trunk cuts an unchunked prime into anyway (the trunk cuts at multiples of ``PREFIX_BLOCK`` of the
sequence's position, so a piece may start anywhere). The pieces' outputs are joined, and the
turn's first token is emitted after the last one, exactly as after one prime.
"""

from __future__ import annotations

import dataclasses

from .. import schema
from ..model.device import invariant_prime
from ..schema import ServingConfig
from .session_table import SessionTable
from .protocols import Rows, TrunkAPI, VerifyOut
from .session import SpecSession


#: a burst's prefill rows at least while no turn decodes: a long prompt alone is primed in pieces this big
#: (a piece's fixed cost stays small), and a prompt arriving meanwhile waits at most one of them
IDLE_PREFILL_ROWS = 256
#: the smallest piece of a prompt when pieces may end anywhere (a budget under it still primes this much)
LEAST_PIECE_ROWS = 1


@dataclasses.dataclass
class PendingPrefill:
    """A turn being primed in pieces: its whole prime ``item``, the sequence position ``start`` of the
    item's first row, the rows ``done`` so far, their joined trunk outputs ``out``, the turn's
    ``max_tokens``, and whether pieces must end at multiples of ``PREFIX_BLOCK`` (``aligned``: the item
    uses the prefix cache and the trunk's prime rows depend on the pieces)."""

    item: Rows
    max_tokens: int
    start: int = 0
    aligned: bool = False
    done: int = 0
    out: VerifyOut | None = None

    def left(self) -> int:
        """Rows still to prime."""
        return len(self.item.tokens) - self.done

    def fit(self, budget: int) -> int:
        """Rows of the next piece within ``budget`` rows: the rest of the prompt when it fits, else as many
        as fit, ending at a multiple of ``PREFIX_BLOCK`` when ``aligned`` (0: none fits)."""
        if self.left() <= budget:
            return self.left()
        pos, c = self.start + self.done, schema.PREFIX_BLOCK
        return max((pos + budget) // c * c - pos if self.aligned else budget, 0)

    def least(self) -> int:
        """The smallest piece: the rest of the prompt, or ``LEAST_PIECE_ROWS`` of it (``aligned``: the rows
        up to the next multiple of ``PREFIX_BLOCK``)."""
        pos, c = self.start + self.done, schema.PREFIX_BLOCK
        return min(self.left(), (pos // c + 1) * c - pos if self.aligned else LEAST_PIECE_ROWS)

    def piece(self, n: int, first: bool) -> Rows:
        """The prime item of the next ``n`` rows (the first carries the prefix keys and the pending commit)."""
        it = self.item
        rows = it.tokens[self.done : self.done + n]
        if first:
            return Rows(it.sid, rows, it.prefix, it.commit, it.sampling)
        return Rows(it.sid, rows, None if it.prefix is None else [], 0, it.sampling)

    def add(self, n: int, out: VerifyOut) -> bool:
        """Record a primed piece of ``n`` rows; True once every row is primed."""
        self.done += n
        self.out = out if self.out is None else self.out.then(out)
        return self.done == len(self.item.tokens)


class PrefillPlanner:
    """Which prompt rows each prime call carries: the admission's first pieces (:meth:`chunk`) and each
    burst's later ones (:meth:`step`), within the burst cycle's budget; joins a turn's pieces' outputs.

    Args: ``config`` — ``prefill_budget`` (and the trunk settings :func:`invariant_prime` reads);
    ``table`` — the sessions and running turns; ``trunk`` — the stage :meth:`step` primes on.
    """

    def __init__(self, config: ServingConfig, table: SessionTable, trunk: TrunkAPI) -> None:
        self.config, self.table, self.trunk = config, table, trunk
        #: a prime's rows do not depend on its pieces, so prompts are cut anywhere (module docstring)
        self.invariant_prime = invariant_prime(config)
        #: prompt rows the admissions since the last :meth:`step` primed (the burst cycle's budget spent)
        self._used = 0

    def chunk(self, ok: list[tuple]) -> list[tuple]:
        """The admission's prime items. ``ok`` holds each admitted ``(turn, session, whole prime item)``;
        returns them in the same order with each item cut to the piece primed now, the rest left in the
        session's ``prefill`` (None: primed whole). Shortest prompt first, from the burst cycle's budget
        (:meth:`_burst_budget`, counting the turns already running, not these);
        a turn the budget does not reach still primes its least piece."""
        budget = self._burst_budget() if self.config.prefill_budget else 0  # (idle: IDLE_PREFILL_ROWS at least)
        if not self.table.busy():  # no burst ran after the last admissions: their rows were never a burst's
            self._used = 0
        cut = {}
        for j in sorted(range(len(ok)), key=lambda j: len(ok[j][2].tokens)):
            t, s, item = ok[j]
            start = s.warm_rows if item.prefix is not None else len(s.committed)
            p = PendingPrefill(item, t.max_tokens, start, aligned=item.prefix is not None and not self.invariant_prime)
            n = p.left() if not budget else max(p.fit(budget - self._used), p.least())
            self._used += n
            s.prefill = None if n == p.left() else p
            cut[j] = item if s.prefill is None else p.piece(n, first=True)
        return [(t, s, cut[j]) for j, (t, s, _) in enumerate(ok)]

    def primed(self, s: SpecSession, item: Rows, out: VerifyOut) -> tuple[Rows, VerifyOut, int] | None:
        """After a prime call of ``s``'s piece ``item`` (outputs ``out``): once its prompt is primed whole,
        the whole prime item, its joined outputs and the turn's ``max_tokens``; else None."""
        p = s.prefill
        if p is None:
            return item, out, self.table.turns[s.sid].max_tokens
        if not p.add(len(item.tokens), out):
            return None
        s.prefill = None
        return p.item, p.out, p.max_tokens

    def _burst_budget(self) -> int:
        """This burst's prefill rows: ``prefill_budget`` while any turn decodes (its gap between responses
        is what the budget bounds), else at least :data:`IDLE_PREFILL_ROWS` (nobody waits on the burst but a
        prompt arriving meanwhile, which waits one piece)."""
        b, sessions = self.config.prefill_budget, self.table.sessions
        decoding = any(sessions[sid].prefill is None for sid in self.table.turns if sid in sessions)
        return b if decoding else max(b, IDLE_PREFILL_ROWS)

    def _plan(self, group: list, budget: int, full: int) -> list[tuple]:
        """``(session, rows)`` of this burst's pieces over the prefilling ``group`` within ``budget`` rows,
        shortest remaining prompt first. With no budget spent this cycle (``budget == full``) and none fitting
        (a budget under one block), the shortest primes its least piece, so every prompt goes on."""
        if not self.config.prefill_budget:  # (the budget turned off meanwhile) the rest at once
            return [(s, s.prefill.left()) for s in group]
        plan, left = [], budget
        for s in sorted(group, key=lambda s: s.prefill.left()):
            if (n := s.prefill.fit(left)) > 0:
                plan.append((s, n))
                left -= n
        if not plan and budget == full:
            s = min(group, key=lambda s: s.prefill.left())
            plan = [(s, s.prefill.least())]
        return plan

    def step(self) -> list[tuple[SpecSession, Rows, VerifyOut]]:
        """Prime this burst's pieces (one trunk call; the budget the admissions left). Returns each
        piece's ``(session, item, outputs)`` (for :meth:`primed`), in the call's order."""
        group, used, self._used = self.table.prefilling(), self._used, 0
        full = self._burst_budget()
        plan = self._plan(group, full - used, full) if group else []
        if not plan:
            return []
        items = [s.prefill.piece(n, first=False) for s, n in plan]
        return [(s, it, out) for (s, _), it, out in zip(plan, items, self.trunk.prime(items))]
