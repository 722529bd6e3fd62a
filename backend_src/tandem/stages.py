"""Engine stages: the trunk (prime / verify / commit) and the MTP drafter, each holding the
per-sequence state of every open session, keyed by sequence id.

The same classes run in-process and inside the ``trunk`` / ``drafter_mtp`` Triton models; the
``tandem`` model reaches them over BLS with the same batched calls (one per stage per round).
"""

from __future__ import annotations

import dataclasses

import torch

from .cache import MLACache, TrunkCache
from .trunk import Trunk


class UnknownSequence(KeyError):
    """A stage was asked about a sequence id it does not hold."""


@dataclasses.dataclass
class VerifyOut:
    """Result of a trunk pass over ``R`` rows: ``argmax [R]`` (int64), ``hidden [R, D]`` (fp32),
    ``top2_gap [R]`` (fp32, top-1 minus top-2 logit, for near-tie analysis)."""

    argmax: torch.Tensor
    hidden: torch.Tensor
    top2_gap: torch.Tensor


def _out(model: Trunk, h: torch.Tensor) -> VerifyOut:
    logits = model.logits(h[0])
    top = logits.topk(2, dim=-1)
    return VerifyOut(top.indices[:, 0], h[0].float(), top.values[:, 0] - top.values[:, 1])


class TrunkStage:
    """Owns one :class:`TrunkCache` per open sequence.

    Raises :class:`UnknownSequence` for ids it does not hold and ``ValueError`` (from the cache)
    for context overflow or out-of-order calls.
    """

    def __init__(self, model: Trunk, max_ctx: int | None = None) -> None:
        self.model = model
        self.max_ctx = max_ctx or model.cfg.max_position_embeddings
        self.caches: dict[int, TrunkCache] = {}

    def open(self, sid: int) -> None:
        self.caches[sid] = self.model.new_cache(self.max_ctx)

    def close(self, sid: int) -> None:
        self.caches.pop(sid, None)

    def cache(self, sid: int) -> TrunkCache:
        try:
            return self.caches[sid]
        except KeyError:
            raise UnknownSequence(sid) from None

    def prime(self, items: list[tuple[int, list[int]]], all_rows: bool = True) -> list[VerifyOut]:
        """Prefill each ``(sid, ids)``; rows are committed. Returns per item the rows' outputs
        (only the last row when ``all_rows`` is False)."""
        outs = []
        for sid, ids in items:
            c = self.cache(sid)
            h = self.model.prime(c, torch.tensor([ids], dtype=torch.long))
            outs.append(_out(self.model, h if all_rows else h[:, -1:]))
        return outs

    def verify(self, items: list[tuple[int, list[int]]]) -> list[VerifyOut]:
        """Run each ``(sid, [anchor, *drafts])`` without committing."""
        outs = []
        for sid, ids in items:
            c = self.cache(sid)
            h = self.model.verify(c, torch.tensor([ids], dtype=torch.long))
            outs.append(_out(self.model, h))
        return outs

    def commit(self, items: list[tuple[int, int]]) -> None:
        """Keep ``n_rows`` of each sequence's pending verify."""
        for sid, n in items:
            self.cache(sid).commit(n)


@dataclasses.dataclass
class DraftState:
    """MTP drafter state of one sequence: its MLA cache and how many entries are committed."""

    cache: MLACache
    committed: int = 0


class MTPStage:
    """The native MTP drafter: ingest trunk rows, then chain ``k`` draft steps.

    MTP entry ``i`` takes the trunk hidden of position ``i`` and the token at ``i + 1`` and
    predicts the token at ``i + 2``; chained steps carry the MTP's normalised hidden.
    """

    def __init__(self, model: Trunk) -> None:
        if model.mtp is None:
            raise ValueError("checkpoint has no MTP layer")
        self.model = model
        self.states: dict[int, DraftState] = {}

    def open(self, sid: int) -> None:
        self.states[sid] = DraftState(MLACache(self.model.cfg.index_kpool))

    def close(self, sid: int) -> None:
        self.states.pop(sid, None)

    @torch.no_grad()
    def draft(self, items: list[tuple[int, torch.Tensor, list[int], int]]) -> list[list[int]]:
        """For each ``(sid, hidden [n, D], next_tokens [n], k)``: drop speculative entries, ingest
        the ``n`` committed rows, and return ``k`` greedy draft tokens (``[]`` when k == 0)."""
        mtp, emb = self.model.mtp, self.model.embed_tokens
        dt = self.model.dtype
        res = []
        for sid, hidden, nxt, k in items:
            try:
                st = self.states[sid]
            except KeyError:
                raise UnknownSequence(sid) from None
            st.cache.truncate(st.committed)
            h = hidden.to(dt).unsqueeze(0)
            e = emb(torch.tensor([nxt], dtype=torch.long))
            hn = mtp.rows(e, h, st.cache)[:, -1:]
            st.committed = len(st.cache)
            out: list[int] = []
            for j in range(k):
                tokn = int(mtp.shared_head.head(hn[0, -1]).float().argmax())
                out.append(tokn)
                if j + 1 < k:
                    hn = mtp.rows(emb(torch.tensor([[tokn]])), hn, st.cache)
            res.append(out)
        return res
