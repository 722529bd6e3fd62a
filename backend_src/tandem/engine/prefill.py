"""Chunked prefill for the :class:`~tandem.engine.scheduler.Scheduler`: while other sessions stream, a
turn whose prime rows exceed ``config.prefill_chunk`` is primed one chunk per burst, so they get a
burst between chunks instead of waiting for the whole prompt (with nobody streaming, the rest is
primed at once: chunks would only delay its first token). The first chunk goes with the admission's
prime call (with the turn's prefix keys and the previous turn's commit); each later chunk rides in
one batched prime call at the start of a burst, with an empty prefix list where the prefix cache is in
use (so the trunk keeps cutting pieces at multiples of ``PREFIX_BLOCK`` and capturing the states there).
Under ``batch_invariant`` on the CPU every prime row runs the row-wise kernels, so a chunk of any size
leaves every row bit-identical to an unchunked prime (``tests/test_trunk.py``); elsewhere chunks that are
multiples of the block keep it so. The chunks' outputs are
joined, and the turn's first token is emitted after the last one, exactly as after one prime.
"""

from __future__ import annotations

import dataclasses

from .protocols import Rows, VerifyOut


@dataclasses.dataclass
class PendingPrefill:
    """A turn being primed in chunks: its whole prime ``item``, the rows ``done`` so far, their joined
    trunk outputs ``out`` and the turn's ``max_tokens``."""

    item: Rows
    max_tokens: int
    done: int = 0
    out: VerifyOut | None = None

    def piece(self, chunk: int, first: bool) -> Rows:
        """The next chunk's prime item (the first carries the prefix keys and the pending commit)."""
        it = self.item
        rows = it.tokens[self.done: self.done + chunk]
        if first:
            return Rows(it.sid, rows, it.prefix, it.commit, it.sampling)
        return Rows(it.sid, rows, None if it.prefix is None else [], 0, it.sampling)

    def add(self, n: int, out: VerifyOut) -> bool:
        """Record a primed chunk of ``n`` rows; True once every row is primed."""
        self.done += n
        self.out = out if self.out is None else self.out.then(out)
        return self.done == len(self.item.tokens)


class Prefill:
    """Mixed into :class:`~tandem.engine.scheduler.Scheduler` (whose ``sessions``, ``turns``,
    ``trunk``, ``config``, ``_after_prime`` and ``_publish`` it uses)."""

    def _chunked(self, s, item: Rows, max_tokens: int) -> Rows:
        """The item the admission primes for ``s``: all of ``item``, or its first chunk (the rest is
        left in ``s.prefill``)."""
        chunk = self.config.prefill_chunk
        if not chunk or len(item.tokens) <= chunk or not self.active():
            s.prefill = None
            return item
        s.prefill = PendingPrefill(item, max_tokens)
        return s.prefill.piece(chunk, first=True)

    def _primed(self, s, item: Rows, out: VerifyOut):
        """After a prime call: the turn's first receipt once its prime is complete, else None."""
        p = s.prefill
        if p is None:
            return self._after_prime(s, item, out, self.turns[s.sid].max_tokens)
        if not p.add(len(item.tokens), out):
            return None
        s.prefill = None
        return self._after_prime(s, p.item, p.out, p.max_tokens)

    def prefilling(self) -> list:
        """Sessions whose turn is still being primed in chunks."""
        return [self.sessions[sid] for sid in self.turns if self.sessions[sid].prefill is not None]

    def _prefill_step(self) -> None:
        """Prime the next chunk of every prefilling session (one trunk call); emit the first token of
        each turn whose prime completes."""
        group = self.prefilling()
        if not group:
            return
        chunk = self.config.prefill_chunk if self.active() else self.config.max_ctx  # nobody waits: all at once
        items = [s.prefill.piece(chunk, first=False) for s in group]
        for s, it, out in zip(group, items, self.trunk.prime(items)):
            r = self._primed(s, it, out)
            if r is not None:
                self._publish(s, r)
