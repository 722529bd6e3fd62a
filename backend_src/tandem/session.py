"""`SpecSession`: one request stream's speculative decoding state (DESIGN.md §3).

At every burst boundary: ``trunk cache pos == len(committed)``; every committed row's trunk
state equals a fresh prime of ``committed``; exactly one emitted-but-uncommitted anchor exists
(row 0 of the next verify).
"""

from __future__ import annotations

import dataclasses
import time

import torch


@dataclasses.dataclass
class Receipt:
    """What one burst produced for one session: ``tokens`` emitted, and the deltas of verify
    ``rounds``, ``drafted`` and ``accepted`` tokens; ``accepted_at[i]`` counts rounds whose draft
    ``i`` was accepted; ``finish_reason`` is None while the turn continues, else ``"stop"`` (a stop
    token), ``"length"`` (max_tokens) or ``"context"`` (context capacity)."""

    tokens: list[int]
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    top2_gaps: list[float] = dataclasses.field(default_factory=list)


class SpecSession:
    """State of one sequence: committed tokens, the anchor, counters, and the current turn.

    The trunk cache lives in the trunk stage under ``sid`` (in-process or behind BLS); members
    that read it (``pos``, ``cache_ref``) go through the stage.
    """

    def __init__(self, sid: int, trunk_stage, drafter_stage=None, k: int = 3, max_ctx: int = 4096,
                 stop_ids: tuple[int, ...] = ()) -> None:
        self.sid = sid
        self.trunk = trunk_stage
        self.drafter = drafter_stage
        self.k = k if drafter_stage is not None else 0
        self.max_ctx = max_ctx
        self.stop_ids = tuple(stop_ids)
        self.committed: list[int] = []
        self.anchor: int | None = None
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.accepted_at = [0] * max(self.k, 1)
        self.turn_remaining = 0
        self.turn_done = True
        self.finish_reason: str | None = None
        self.last_active = time.monotonic()
        # MTP ingest rows not yet sent to the drafter: (hidden [n, D], next tokens [n])
        self._ingest: tuple[torch.Tensor, list[int]] | None = None
        self._prefix_capture = None
        self.trunk.open(sid)
        if self.drafter is not None:
            self.drafter.open(sid)

    # -- DESIGN.md §3 members ---------------------------------------------------------------------
    def cache_max_ctx(self) -> int:
        """Context capacity in tokens (the ContextFull guard)."""
        return self.max_ctx

    def pos(self) -> int:
        """Trunk rows committed."""
        return len(self.committed)

    def finished(self) -> bool:
        """True once a stop token was emitted or the context guard tripped in the current turn."""
        return self.finish_reason in ("stop", "context")

    def take_prefix_capture(self):
        """Drain the prompt-boundary capture for the prefix cache (None: no capture on this arm yet)."""
        cap, self._prefix_capture = self._prefix_capture, None
        return cap

    def prefix_capture_ready(self) -> bool:
        """A capture exists and the drafter KV covers the boundary (the native arm has no capture yet)."""
        return self._prefix_capture is not None

    def export_draft_tail(self, upto: int):
        """The drafter's readable KV tail at ``upto`` rows: None on the native MTP arm."""
        return None

    def cache_ref(self):
        """Read-only view of the trunk cache (in-process stages only; None behind BLS)."""
        caches = getattr(self.trunk, "caches", None)
        return None if caches is None else caches.get(self.sid)

    def demote_eligible(self) -> bool:
        """Greedy sessions may move to plain decoding without changing their output."""
        return True

    def close(self) -> None:
        self.trunk.close(self.sid)
        if self.drafter is not None:
            self.drafter.close(self.sid)

    # -- turns ------------------------------------------------------------------------------------
    def check_turn(self, new_tokens: list[int], max_tokens: int) -> None:
        """Validate a turn before it starts. Raises ``ValueError`` naming the field and limit."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        base = len(self.committed) + (1 if self.anchor is not None else 0)
        if base + len(new_tokens) >= self.max_ctx:
            raise ValueError(f"input_ids: {base} context + {len(new_tokens)} new tokens leaves no room to generate "
                             f"within the context capacity of {self.max_ctx} tokens (at most {self.max_ctx - 1 - base} "
                             f"new tokens)")
        if self.anchor is None and not new_tokens:
            raise ValueError("input_ids: the first turn of a sequence needs at least 1 token")

    def prime_items(self, new_tokens: list[int]) -> list[int]:
        """Rows to prefill for a new turn: the previous turn's anchor (if any) then the new tokens."""
        rows = ([self.anchor] if self.anchor is not None else []) + list(new_tokens)
        return rows

    def after_prime(self, rows: list[int], out, max_tokens: int) -> Receipt:
        """Apply a prime result (``out``: :class:`VerifyOut` over ``rows``); emits the first token."""
        self.committed.extend(rows)
        tok = int(out.argmax[-1])
        self.anchor = tok
        self.turn_remaining = max_tokens - 1
        self.finish_reason = None
        self.turn_done = False
        nxt = rows[1:] + [tok]
        self._ingest = (out.hidden, nxt)
        r = Receipt(tokens=[tok], top2_gaps=[float(out.top2_gap[-1])])
        self._finish_check(r, [tok])
        return r

    def _finish_check(self, r: Receipt, emitted: list[int]) -> None:
        if any(t in self.stop_ids for t in emitted):
            r.finish_reason = "stop"
        elif self.turn_remaining <= 0:
            r.finish_reason = "length"
        elif len(self.committed) + 1 >= self.max_ctx:
            r.finish_reason = "context"
        if r.finish_reason:
            self.finish_reason = r.finish_reason
            self.turn_done = True

    # -- one round --------------------------------------------------------------------------------
    def round_k(self) -> int:
        """Drafts to propose this round: ``k`` capped by the context left after the anchor row."""
        room = self.max_ctx - len(self.committed) - 1
        return max(0, min(self.k, room))

    def draft_item(self):
        """The drafter call for this round: ``(sid, hidden, next_tokens, k)``; consumes the ingest."""
        hidden, nxt = self._ingest
        self._ingest = None
        return (self.sid, hidden, nxt, self.round_k())

    def after_verify(self, drafts: list[int], out, r: Receipt) -> int:
        """Accept walk over a verify result; updates counters and the receipt ``r``.
        Returns the number of rows to commit."""
        from .accept import greedy_accept

        target = out.argmax.tolist()
        a, emitted = greedy_accept(drafts, target)
        # stop at the first stop token and at the turn budget
        m = len(emitted)
        for i, t in enumerate(emitted):
            if t in self.stop_ids:
                m = i + 1
                break
        m = min(m, self.turn_remaining)
        emitted = emitted[:m]
        self.rounds += 1
        self.drafted += len(drafts)
        acc = min(a, m)
        self.accepted += acc
        for i in range(acc):
            self.accepted_at[i] += 1
            r.accepted_at[i] += 1
        r.rounds += 1
        r.drafted += len(drafts)
        r.accepted += acc
        rows = [self.anchor] + emitted[:-1]
        self.committed.extend(rows)
        self.anchor = emitted[-1]
        self.turn_remaining -= m
        r.tokens.extend(emitted)
        r.top2_gaps.extend(float(g) for g in out.top2_gap[:m])
        self._ingest = (out.hidden[:m], emitted)
        self.last_active = time.monotonic()
        self._finish_check(r, emitted)
        return m

    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted / rounds (bonus included); 0 before any round."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0
