"""The DFlash drafter stage (arms ``dflash`` and ``dflash2``): per-sequence drafter KV of committed
context, ingest of each round's committed rows (the prompt's at round 1: deferred), and one block
forward per sequence and round. Its wire form (``handle``, :data:`tandem.schema.DRAFTER_DFLASH`)
runs inside the ``drafter_dflash`` Triton model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn as nn

from .. import schema
from ..model.dflash import DFlashDrafter
from ..schema import WireError
from .drafter_stage import DrafterStage
from .protocols import DraftRequest


@dataclasses.dataclass
class DFlashState:
    """One sequence's drafter state: ``arm`` (fixed at its first draft), the per-layer context keys
    and values ``[1, H, rows, d]`` of committed positions ``0 .. rows - 1``. Only committed rows are
    ever ingested, so a rejected draft needs no rollback."""

    arm: str | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    rows: int = 0


class DFlashStage(DrafterStage):
    """Implements :class:`~tandem.engine.protocols.DrafterAPI` for the DFlash arms.

    Args: ``drafters`` — arm -> :class:`~tandem.model.dflash.DFlashDrafter` (``dflash``, ``dflash2``);
    ``embed`` / ``head`` — the trunk's embedding and LM head (the drafter has none of its own);
    ``max_num_draft_tokens``. Raises ``ValueError`` on drafters that disagree in shape.
    """

    spec = schema.DRAFTER_DFLASH

    def __init__(self, drafters: dict[str, DFlashDrafter], embed: nn.Embedding, head: nn.Linear,
                 max_num_draft_tokens: int = schema.DEFAULTS.max_num_draft_tokens) -> None:
        if not drafters:
            raise ValueError("DFlashStage needs at least one drafter")
        sizes = {m.cfg.feature_size for m in drafters.values()}
        if len(sizes) != 1:
            raise ValueError(f"DFlash drafters disagree on the feature width: {sorted(sizes)}")
        super().__init__(max_num_draft_tokens)
        self.drafters, self.embed, self.head = drafters, embed, head
        self.feature_size = sizes.pop()

    def new_state(self) -> DFlashState:
        return DFlashState()

    def covered_rows(self, sid: int) -> int:
        """Committed positions the drafter KV of ``sid`` covers. Raises :class:`~tandem.engine.protocols.UnknownSequence`."""
        return self.state(sid).rows

    @torch.no_grad()
    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        """For each item: ingest its committed rows' ``features`` at the next positions, then draft the
        block ``[anchor, MASK x k]`` (``anchor = next_tokens[-1]``, ``k = num_draft_tokens``, at most
        ``block_size - 1``) and return ``k`` tokens: the argmax per position (``dflash``) or the
        selector's path (``dflash2``). Raises :class:`~tandem.engine.protocols.UnknownSequence`, ``ValueError`` on an arm change."""
        res = []
        for it in items:
            st = self.state(it.sid)
            if st.arm is None:
                st.arm = it.arm
            elif st.arm != it.arm:
                raise ValueError(f"sequence {it.sid} drafts with {st.arm}, not {it.arm}")
            model = self.drafters[it.arm]
            n = len(it.next_tokens)
            pos = torch.arange(st.rows, st.rows + n)
            kv = model.context_kv(model.context(it.features.reshape(1, n, -1)), pos)
            st.kv = kv if st.kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                              for (k0, v0), (k1, v1) in zip(st.kv, kv)]
            st.rows += n
            k = min(it.num_draft_tokens, model.cfg.block_size - 1)
            if k <= 0:
                res.append([])
                continue
            anchor = int(it.next_tokens[-1])
            x = model.block_input(torch.tensor([anchor]), self.embed, k + 1)
            h = model(x, torch.arange(st.rows, st.rows + k + 1), st.kv, block=k + 1)[0, 1:]
            logits = self.head(h).float()
            res.append(model.selector.walk(h, logits, anchor) if model.selector is not None
                       else logits.argmax(-1).tolist())
        return res

    def requests(self, arrays: schema.Arrays, sids: list[int], ks: list[int]) -> list[DraftRequest]:
        """The draft items of a packed request: ``FEATURES [N, F]``, ``LENGTHS [S]``, ``ANCHORS [S]``,
        ``SPEC [S]``."""
        feats = schema.get_vector(arrays, self.spec.input("FEATURES"), ndim=2)
        if feats.shape[1] != self.feature_size:
            raise WireError(f"FEATURES must be [N, {self.feature_size}], got {list(feats.shape)}")
        lengths = schema.lengths_of(arrays, len(sids), feats.shape[0], "FEATURES")
        anchors = schema.get_vector(arrays, self.spec.input("ANCHORS"))
        arms = [a.decode() if isinstance(a, bytes) else str(a) for a in np.asarray(arrays.get(schema.SPEC, [])).reshape(-1)]
        for name, got in (("ANCHORS", anchors.size), (schema.SPEC, len(arms))):
            if got != len(sids):
                raise WireError(f"{name} has {got} entries for {len(sids)} SIDS")
        for s, a in zip(sids, arms):
            if a not in self.drafters:
                raise WireError(f"{schema.SPEC}: {a!r} is not served here (loaded: {sorted(self.drafters)})")
            if self.states[s].arm not in (None, a):
                raise WireError(f"{schema.SPEC}: sequence {s} drafts with {self.states[s].arm}, not {a}")
        schema.check_tokens("ANCHORS", anchors, self.embed.num_embeddings)
        fs = schema.split_rows(torch.from_numpy(np.ascontiguousarray(feats)), lengths)
        # the stage reads only each sequence's anchor (the last next token); the others are not sent
        return [DraftRequest(s, torch.zeros(0), [0] * (n - 1) + [int(a)], k, f, arm)
                for s, n, a, k, f, arm in zip(sids, lengths, anchors.tolist(), ks, fs, arms)]
