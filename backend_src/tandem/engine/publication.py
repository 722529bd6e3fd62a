"""The engine core's side of the prefix cache (:mod:`tandem.engine.prefix`): a new session's prompt is
looked up and captured at admission, and its leading blocks published once the turn has computed them
(after its first burst, or at its first token when that ends it); an idle session's unpublished
capture is dropped so it holds its cache and nothing more."""

from __future__ import annotations

from .. import schema
from .session_table import SessionTable
from .prefix import PrefixIndex, publish_ready, reusable_blocks
from .protocols import Rows
from .session import SpecSession
from .stage_set import StageSet


class PrefixPublisher:
    """Lookup, capture and publication of prompt blocks.

    Args: ``index`` — the prefix cache's :class:`~tandem.engine.prefix.PrefixIndex` (None: the cache is
    off; :attr:`index` may be replaced, e.g. to forget every published prefix); ``stages`` — the
    stores' stages; ``table`` — the sessions (for :meth:`drop_captures`).
    """

    def __init__(self, index: PrefixIndex | None, stages: StageSet, table: SessionTable) -> None:
        self.index, self.stages, self.table = index, stages, table

    def prime_item(self, s: SpecSession, rows: list[int], salt: str = "") -> Rows:
        """The prime item of a turn's ``rows``: with the prefix cache on, a new session's prompt (plain or
        DFlash spec) is looked up block by block in the namespace of its turn's cache ``salt`` and
        captured; its published leading blocks are skipped (``s.warm_rows``)."""
        if self.index is None or s.committed or s.spec == schema.MTP or reusable_blocks(len(rows)) == 0:
            return Rows(s.sid, rows)
        cap = self.index.capture(rows, salt)
        hit = self.index.lookup(cap, s.spec)
        s.prefix_capture, s.warm_rows = cap, hit * schema.PREFIX_BLOCK
        s.drafter_rows = s.warm_rows if s.spec in schema.DFLASH_SPECS else 0
        return Rows(s.sid, rows[s.warm_rows :], cap.keys[:hit])

    def publish(self, sessions: list[SpecSession]) -> None:
        """Publish the prefix captures of ``sessions`` that are ready (:func:`publish_ready`); a failure
        loses only the cache entries (counted in ``index.stats["errors"]``)."""
        if self.index is None or not sessions:
            return
        try:
            publish_ready(self.index, sessions, self.stages.trunk, self.stages.drafters)
        except Exception as e:  # noqa: BLE001 - a prefix the stores could not take is only a lost cache entry
            self.index.stats["last_error"] = f"{type(e).__name__}: {e}"  # counted in stats["errors"]

    def drop_captures(self) -> None:
        """Publish or drop the prompt-boundary captures of open sessions whose turn has ended, so an idle
        session holds its cache and nothing more: a ready capture is published (a turn that ended at its
        first token on the plain spec), the others (a DFlash turn that ended at its first token: its drafter
        had not read the prompt) are dropped with one trunk ``publish`` of no blocks, which drops the
        trunk's capture (KDA states at each block end)."""
        turns, trunk = self.table.turns, self.stages.trunk
        idle = [s for sid, s in self.table.sessions.items() if s.prefix_capture is not None and sid not in turns]
        if not idle or not self.stages.usable(trunk):
            return
        self.publish(idle)
        stale = [s for s in idle if s.prefix_capture is not None]
        if not stale:
            return
        for s in stale:
            s.prefix_capture = None
        try:
            trunk.publish([(s.sid, []) for s in stale])
        except Exception as e:  # noqa: BLE001 - the capture goes with the session's close instead
            self.stages.on_event(f"dropping prompt captures failed: {type(e).__name__}: {e}")
