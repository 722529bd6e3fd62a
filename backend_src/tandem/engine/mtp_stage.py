"""The native MTP drafter stage: per-sequence MTP KV, ingest committed trunk rows, chain
``num_draft_tokens`` greedy steps. Its wire form (``handle``, :data:`tandem.schema.DRAFTER_MTP`)
runs inside the ``drafter_mtp`` Triton model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import schema
from ..model.cache import MLACache
from ..model.trunk import Trunk
from ..schema import WireError
from .drafter_stage import DrafterStage
from .protocols import DraftRequest


@dataclasses.dataclass
class MTPState:
    """MTP drafter state of one sequence: its MLA cache and how many entries are committed (the
    rest are the previous round's chained draft steps, dropped before the next ingest)."""

    cache: MLACache
    committed: int = 0


class MTPStage(DrafterStage):
    """Implements :class:`~tandem.engine.protocols.DrafterAPI` with the trunk's native MTP layer.

    MTP entry ``i`` takes the trunk hidden of position ``i`` and the token at ``i + 1`` and
    predicts the token at ``i + 2``; chained steps carry the MTP's normalised hidden.
    Raises ``ValueError`` when the checkpoint has no MTP layer.
    """

    wire = schema.DRAFTER_MTP

    def __init__(self, model: Trunk, max_num_draft_tokens: int = schema.DEFAULTS.max_num_draft_tokens) -> None:
        if model.mtp is None:
            raise ValueError("checkpoint has no MTP layer")
        super().__init__(max_num_draft_tokens)
        self.model = model.use_kernels(model.kernels)  # the MTP layer row-invariant, whatever loaded it

    def new_state(self) -> MTPState:
        return MTPState(MLACache(self.model.cfg.index_kpool))

    @torch.no_grad()
    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        """For each item: drop speculative entries, ingest its ``n`` committed rows, return
        ``num_draft_tokens`` greedy drafts (``[]`` for 0). Raises :class:`~tandem.engine.protocols.UnknownSequence`."""
        # the MTP layer runs row-invariant (:meth:`~tandem.model.trunk.Trunk.use_kernels`)
        mtp, emb, dev = self.model.mtp, self.model.embed_tokens, self.model.device
        res = []
        for it in items:
            st = self.state(it.sid)
            st.cache.truncate(st.committed)
            h = it.hidden.to(device=dev, dtype=self.model.dtype).unsqueeze(0)
            hn = mtp.rows(emb(torch.tensor([it.next_tokens], device=dev)), h, st.cache)[:, -1:]
            st.committed = len(st.cache)
            out: list[int] = []
            for j in range(it.num_draft_tokens):
                tok = int(mtp.shared_head.head(hn[0, -1]).float().argmax())
                out.append(tok)
                if j + 1 < it.num_draft_tokens:
                    hn = mtp.rows(emb(torch.tensor([[tok]], device=dev)), hn, st.cache)
            res.append(out)
        return res

    def requests(self, arrays: schema.Arrays, sids: list[int], ks: list[int]) -> list[DraftRequest]:
        """The draft items of a packed request: ``HIDDEN [N, D]`` (copied to the model's device),
        ``NEXT_TOKENS [N]``, ``LENGTHS [S]``."""
        hidden = schema.get_vector(arrays, self.wire.input("HIDDEN"), ndim=2)
        nxt = schema.get_vector(arrays, self.wire.input("NEXT_TOKENS"))
        D = self.model.cfg.hidden_size
        if hidden.shape[1] != D:
            raise WireError(f"HIDDEN must be [N, {D}], got {list(hidden.shape)}")
        if hidden.shape[0] != nxt.size:
            raise WireError(f"HIDDEN has {hidden.shape[0]} rows but NEXT_TOKENS has {nxt.size}")
        lengths = schema.lengths_of(arrays, len(sids), nxt.size, "NEXT_TOKENS")
        schema.check_tokens("NEXT_TOKENS", nxt, self.model.cfg.vocab_size)
        hs = schema.split_rows(torch.from_numpy(np.ascontiguousarray(hidden)).to(self.model.device), lengths)
        return [DraftRequest(s, h, n.tolist(), k) for s, h, n, k in zip(sids, hs, schema.split_rows(nxt, lengths), ks)]
