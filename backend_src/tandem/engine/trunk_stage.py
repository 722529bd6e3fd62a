"""The trunk stage: one :class:`~tandem.model.cache.TrunkCache` per open sequence, batched prime /
verify / commit, each pass exporting the rows' argmax, hidden and (for the DFlash arms)
target-layer features. :meth:`TrunkStage.handle` is the same API in wire form (:data:`tandem.schema.TRUNK`):
it is what runs inside the ``trunk`` Triton model, and in-process behind a local transport.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import schema
from ..model.cache import TrunkCache
from ..model.trunk import Trunk
from ..schema import WireError
from .protocols import Commit, KeyedStates, Rows, VerifyOut


def _out(model: Trunk, out, features: tuple[int, ...]) -> VerifyOut:
    h, f = out if features else (out, None)
    logits = model.logits(h[0])
    top = logits.topk(2, dim=-1)
    f = h.new_zeros(h.shape[1], 0) if f is None else f[0]
    return VerifyOut(top.indices[:, 0], h[0].float(), top.values[:, 0] - top.values[:, 1], f.float())


class TrunkStage(KeyedStates):
    """Implements :class:`~tandem.engine.protocols.TrunkAPI` in this process.

    Args: ``model``; ``max_ctx`` tokens per sequence (default ``max_position_embeddings``);
    ``feature_layers`` — trunk layers whose outputs every pass exports as ``features`` (the DFlash
    drafter's ``target_layer_ids``; empty: none).
    Raises :class:`UnknownSequence` for ids it does not hold and ``ValueError`` (from the cache)
    for context overflow or out-of-order calls.
    """

    def __init__(self, model: Trunk, max_ctx: int | None = None, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.feature_layers = tuple(feature_layers)
        self.max_ctx = max_ctx or model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size

    @property
    def caches(self) -> dict[int, TrunkCache]:
        """The open sequences' caches (read-only use)."""
        return self.states

    def new_state(self) -> TrunkCache:
        return self.model.new_cache(self.max_ctx)

    def cache(self, sid: int) -> TrunkCache:
        """The cache of ``sid``. Raises :class:`~tandem.engine.protocols.UnknownSequence`."""
        return self.state(sid)

    def prime(self, items: list[Rows]) -> list[VerifyOut]:
        f = self.feature_layers
        return [_out(self.model, self.model.prime(self.cache(it.sid), torch.tensor([it.tokens]), f), f) for it in items]

    def verify(self, items: list[Rows]) -> list[VerifyOut]:
        f = self.feature_layers
        return [_out(self.model, self.model.verify(self.cache(it.sid), torch.tensor([it.tokens]), f), f) for it in items]

    def commit(self, items: list[Commit]) -> None:
        for it in items:
            self.cache(it.sid).commit(it.n_rows)

    # -- wire form ----------------------------------------------------------------------------------
    def handle(self, arrays: schema.Arrays) -> schema.Arrays:
        """Run one packed request (:data:`tandem.schema.TRUNK`). Every sequence is checked before
        any is touched, so a rejected request changes no cache. Returns ``ARGMAX [R]``,
        ``HIDDEN [R, D]``, ``TOP2_GAP [R]`` over all rows (``R = 0`` for open/close/commit).

        ``FEATURES [R, F]`` too. Raises :class:`~tandem.schema.WireError` naming the field.
        """
        op = schema.get_op(arrays, schema.TRUNK)
        sids = schema.get_sids(arrays)
        if op in ("open", "close"):
            getattr(self, op)(sids)
            return self._pack([])
        for s in sids:
            if s not in self.caches:
                raise WireError(f"SIDS: unknown sequence id {s} (not open in the trunk)")
        if op == "commit":
            n_rows = [int(x) for x in schema.get_vector(arrays, schema.TRUNK.input("N_ROWS"))]
            if len(n_rows) != len(sids):
                raise WireError(f"N_ROWS has {len(n_rows)} entries for {len(sids)} SIDS")
            for s, n in zip(sids, n_rows):
                c = self.caches[s]
                if c.pending is None:
                    raise WireError(f"N_ROWS: sequence {s} has no pending verify to commit")
                if not 1 <= n <= c.pending_rows:
                    raise WireError(f"N_ROWS: {n} for sequence {s} outside [1, {c.pending_rows}]")
            self.commit([Commit(s, n) for s, n in zip(sids, n_rows)])
            return self._pack([])
        toks = schema.get_vector(arrays, schema.TRUNK.input("TOKENS"))
        lengths = schema.lengths_of(arrays, len(sids), toks.size, "TOKENS")
        schema.check_tokens("TOKENS", toks, self.vocab_size)
        for s, n in zip(sids, lengths):
            c = self.caches[s]
            if c.pending is not None:
                raise WireError(f"OP: {op} for sequence {s} while a verify is pending (commit first)")
            if c.pos + n > c.max_ctx:
                raise WireError(f"TOKENS: context full for sequence {s}: {c.pos} + {n} rows > max_ctx {c.max_ctx}")
        items = [Rows(s, rows.tolist()) for s, rows in zip(sids, schema.split_rows(toks, lengths))]
        return self._pack(getattr(self, op)(items))

    def _pack(self, outs: list[VerifyOut]) -> schema.Arrays:
        if not outs:
            D, F = self.model.cfg.hidden_size, len(self.feature_layers) * self.model.cfg.hidden_size
            return {"ARGMAX": np.zeros(0, np.int64), "HIDDEN": np.zeros((0, D), np.float32),
                    "TOP2_GAP": np.zeros(0, np.float32), "FEATURES": np.zeros((0, F), np.float32)}
        return {"ARGMAX": torch.cat([o.argmax for o in outs]).numpy().astype(np.int64, copy=False),
                "HIDDEN": torch.cat([o.hidden for o in outs]).float().numpy(),
                "TOP2_GAP": torch.cat([o.top2_gap for o in outs]).float().numpy(),
                "FEATURES": torch.cat([o.features for o in outs]).float().numpy()}
