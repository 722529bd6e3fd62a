"""The native MTP drafter stage: per-sequence MTP KV, ingest committed trunk rows, chain
``num_draft_tokens`` greedy steps. :meth:`MTPStage.handle` is the wire form
(:data:`tandem.schema.DRAFTER_MTP`) that runs inside the ``drafter_mtp`` Triton model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import schema
from ..model.cache import MLACache
from ..model.trunk import Trunk
from ..schema import WireError
from .protocols import DraftRequest, UnknownSequence


@dataclasses.dataclass
class MTPState:
    """MTP drafter state of one sequence: its MLA cache and how many entries are committed (the
    rest are the previous round's chained draft steps, dropped before the next ingest)."""

    cache: MLACache
    committed: int = 0


class MTPStage:
    """Implements :class:`~tandem.engine.protocols.DrafterAPI` with the trunk's native MTP layer.

    MTP entry ``i`` takes the trunk hidden of position ``i`` and the token at ``i + 1`` and
    predicts the token at ``i + 2``; chained steps carry the MTP's normalised hidden.
    Raises ``ValueError`` when the checkpoint has no MTP layer.
    """

    def __init__(self, model: Trunk, max_num_draft_tokens: int = schema.DEFAULTS.max_num_draft_tokens) -> None:
        if model.mtp is None:
            raise ValueError("checkpoint has no MTP layer")
        self.model = model
        self.max_num_draft_tokens = max_num_draft_tokens
        self.states: dict[int, MTPState] = {}

    def open(self, sids: list[int]) -> None:
        for sid in sids:
            self.states[sid] = MTPState(MLACache(self.model.cfg.index_kpool))

    def close(self, sids: list[int]) -> None:
        for sid in sids:
            self.states.pop(sid, None)

    @torch.no_grad()
    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        """For each item: drop speculative entries, ingest its ``n`` committed rows, return
        ``num_draft_tokens`` greedy drafts (``[]`` for 0). Raises :class:`UnknownSequence`."""
        mtp, emb = self.model.mtp, self.model.embed_tokens
        res = []
        for it in items:
            try:
                st = self.states[it.sid]
            except KeyError:
                raise UnknownSequence(it.sid) from None
            st.cache.truncate(st.committed)
            h = it.hidden.to(self.model.dtype).unsqueeze(0)
            hn = mtp.rows(emb(torch.tensor([it.next_tokens])), h, st.cache)[:, -1:]
            st.committed = len(st.cache)
            out: list[int] = []
            for j in range(it.num_draft_tokens):
                tok = int(mtp.shared_head.head(hn[0, -1]).float().argmax())
                out.append(tok)
                if j + 1 < it.num_draft_tokens:
                    hn = mtp.rows(emb(torch.tensor([[tok]])), hn, st.cache)
            res.append(out)
        return res

    # -- wire form ----------------------------------------------------------------------------------
    def handle(self, arrays: schema.Arrays) -> schema.Arrays:
        """Run one packed request (:data:`tandem.schema.DRAFTER_MTP`), checked before any state
        changes. Returns ``DRAFTS [sum k]``, ``DRAFT_LENGTHS [S]``. Raises :class:`~tandem.schema.WireError`."""
        spec = schema.DRAFTER_MTP
        op = schema.get_op(arrays, spec)
        sids = schema.get_sids(arrays)
        if op in ("open", "close"):
            getattr(self, op)(sids)
            return {"DRAFTS": np.zeros(0, np.int64), "DRAFT_LENGTHS": np.zeros(len(sids), np.int32)}
        for s in sids:
            if s not in self.states:
                raise WireError(f"SIDS: unknown sequence id {s} (not open in the drafter)")
        hidden = schema.get_vector(arrays, spec.input("HIDDEN"), ndim=2)
        nxt = schema.get_vector(arrays, spec.input("NEXT_TOKENS"))
        D = self.model.cfg.hidden_size
        if hidden.shape[1] != D:
            raise WireError(f"HIDDEN must be [N, {D}], got {list(hidden.shape)}")
        if hidden.shape[0] != nxt.size:
            raise WireError(f"HIDDEN has {hidden.shape[0]} rows but NEXT_TOKENS has {nxt.size}")
        lengths = schema.lengths_of(arrays, len(sids), nxt.size, "NEXT_TOKENS")
        k_spec = spec.input(schema.NUM_DRAFT_TOKENS)
        ks = [int(x) for x in schema.get_vector(arrays, k_spec)]
        if len(ks) != len(sids):
            raise WireError(f"{k_spec.name} has {len(ks)} entries for {len(sids)} SIDS")
        for k in ks:
            schema.check_range(k_spec, k, hi=self.max_num_draft_tokens)
        schema.check_tokens("NEXT_TOKENS", nxt, self.model.cfg.vocab_size)
        hs = schema.split_rows(torch.from_numpy(np.ascontiguousarray(hidden)), lengths)
        res = self.draft([DraftRequest(s, h, n.tolist(), k)
                          for s, h, n, k in zip(sids, hs, schema.split_rows(nxt, lengths), ks)])
        return {"DRAFTS": np.array([t for d in res for t in d], dtype=np.int64),
                "DRAFT_LENGTHS": np.array([len(d) for d in res], dtype=np.int32)}
