"""What every drafter stage shares: per-sequence state keyed by sequence id, batched open / close,
and the common part of the wire form (``OP``, ``SIDS``, ``NUM_DRAFT_TOKENS``, the packed drafts)."""

from __future__ import annotations

import numpy as np

from .. import schema
from ..schema import WireError
from .protocols import DraftRequest, KeyedStates


class DrafterStage(KeyedStates):
    """Base of :class:`~tandem.engine.mtp_stage.MTPStage` and :class:`~tandem.engine.dflash_stage.DFlashStage`.

    Per-sequence state as in :class:`~tandem.engine.protocols.KeyedStates`. Subclasses set ``wire``
    (their :class:`~tandem.schema.ModelWire`) and implement ``new_state()``,
    ``draft(items)`` and ``requests(arrays, sids, ks)`` (the per-sequence :class:`DraftRequest` s of a
    packed draft request, checked).
    """

    wire: schema.ModelWire

    def __init__(self, max_num_draft_tokens: int) -> None:
        super().__init__()
        self.max_num_draft_tokens = max_num_draft_tokens

    def requests(self, arrays: schema.Arrays, sids: list[int], ks: list[int]) -> list[DraftRequest]:
        raise NotImplementedError

    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        raise NotImplementedError

    def handle(self, arrays: schema.Arrays) -> schema.Arrays:
        """Run one packed request of this stage's model, checked before any state changes. Returns
        ``DRAFTS [sum k]`` int64 and ``DRAFT_LENGTHS [S]`` int32. Raises :class:`~tandem.schema.WireError`
        naming the field."""
        op = schema.get_op(arrays, self.wire)
        sids = schema.get_sids(arrays)
        if op in ("open", "close"):
            getattr(self, op)(sids)
            return {"DRAFTS": np.zeros(0, np.int64), "DRAFT_LENGTHS": np.zeros(len(sids), np.int32)}
        for s in sids:
            if s not in self.states:
                raise WireError(f"SIDS: unknown sequence id {s} (not open in the drafter)")
        k_wire = self.wire.input(schema.NUM_DRAFT_TOKENS)
        ks = [int(x) for x in schema.get_vector(arrays, k_wire)]
        if len(ks) != len(sids):
            raise WireError(f"{k_wire.name} has {len(ks)} entries for {len(sids)} SIDS")
        for k in ks:
            schema.check_range(k_wire, k, hi=self.max_num_draft_tokens)
        res = self.draft(self.requests(arrays, sids, ks))
        return {
            "DRAFTS": np.array([t for d in res for t in d], dtype=np.int64),
            "DRAFT_LENGTHS": np.array([len(d) for d in res], dtype=np.int32),
        }
