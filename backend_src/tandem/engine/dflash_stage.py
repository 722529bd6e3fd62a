"""The DFlash drafter stage (specs ``dflash`` and ``dflash2``): per-sequence drafter KV of committed
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
from ..ops import dispatch
from ..model.dflash import DFlashDrafter
from ..ops.state import ContextKV
from ..schema import WireError
from .drafter_stage import DrafterStage
from .prefix import split_points
from .protocols import DraftRequest

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: keys, values [1, H, rows, d]


@dataclasses.dataclass
class DFlashState:
    """One sequence's drafter state: ``spec`` (fixed at its first draft), the per-layer context keys
    and values ``[1, H, rows, d]`` of committed positions ``0 .. rows - 1``. Only committed rows are
    ever ingested, so a rejected draft needs no rollback."""

    spec: str | None = None
    kv: ContextKV | None = None
    rows: int = 0


class DFlashStage(DrafterStage):
    """Implements :class:`~tandem.engine.protocols.DrafterAPI` for the DFlash specs.

    Args: ``drafters`` — spec -> :class:`~tandem.model.dflash.DFlashDrafter` (``dflash``, ``dflash2``);
    ``embed`` / ``head`` — the trunk's embedding and LM head (the drafter has none of its own);
    ``max_num_draft_tokens``. Raises ``ValueError`` on drafters that disagree in shape.
    """

    wire = schema.DRAFTER_DFLASH

    def __init__(
        self,
        drafters: dict[str, DFlashDrafter],
        embed: nn.Embedding,
        head: nn.Linear,
        max_num_draft_tokens: int = schema.DEFAULTS.max_num_draft_tokens,
        threads: int = 1,
    ) -> None:
        if not drafters:
            raise ValueError("DFlashStage needs at least one drafter")
        sizes = {m.cfg.feature_size for m in drafters.values()}
        if len(sizes) != 1:
            raise ValueError(f"DFlash drafters disagree on the feature width: {sorted(sizes)}")
        super().__init__(max_num_draft_tokens)
        self.drafters, self.embed, self.head = drafters, embed, head
        #: the threads a compiled round splits its large GEMMs across (the serving parameter ``split_threads``)
        self.threads = threads
        for d in drafters.values():  # row-invariant, whatever loaded them
            d.use_kernels(d.kernels)
        self.feature_size = sizes.pop()
        #: where the drafters' weights are: every tensor made for them is created there
        self.device = embed.weight.device
        #: published drafter tails: (spec, chain key) -> the context K/V of that block's rows
        self.tails: dict[tuple[str, int], KV] = {}

    def new_state(self) -> DFlashState:
        return DFlashState()

    def open(self, sids: list[int], prefixes: list[tuple[str, list[int]] | None] | None = None) -> None:
        """Fresh state for ``sids``; a sequence with a prefix ``(spec, keys)`` starts from those published
        tails (``len(keys) * PREFIX_BLOCK`` rows covered, spec fixed). Raises ``KeyError`` (nothing
        opened) when a tail is not published."""
        prefixes = prefixes or [None] * len(sids)
        for p in prefixes:
            for k in p[1] if p else []:
                if (p[0], k) not in self.tails:
                    raise KeyError(f"no {p[0]} drafter tail for prefix block {k}")
        super().open(sids)
        for sid, p in zip(sids, prefixes):
            if p and p[1]:
                st, blocks = self.states[sid], [self.tails[(p[0], k)] for k in p[1]]
                st.spec, st.rows = p[0], len(p[1]) * schema.PREFIX_BLOCK
                st.kv = ContextKV.of(
                    [
                        (torch.cat([b[i][0] for b in blocks], 2), torch.cat([b[i][1] for b in blocks], 2))
                        for i in range(len(blocks[0]))
                    ]
                )

    def export_tail(self, sid: int, upto: int) -> KV | None:
        """The context K/V of rows ``[0, upto)`` (views), or None when the drafter covers fewer rows."""
        st = self.state(sid)
        if st.kv is None or st.rows < upto or upto < 1:
            return None
        return [(k[:, :, :upto], v[:, :, :upto]) for k, v in st.kv.views()]

    def publish(self, items: list[tuple[int, list[int]]]) -> list[int]:
        """Store each sequence's tail blocks ``keys`` (block ``i`` = rows ``[i*C, (i+1)*C)``; blocks already
        stored for its spec are skipped). Returns bytes newly stored per item. Raises ``ValueError``
        (nothing stored) when a sequence covers fewer rows than its keys."""
        C = schema.PREFIX_BLOCK
        for sid, keys in items:
            if keys and self.export_tail(sid, len(keys) * C) is None:
                raise ValueError(
                    f"sequence {sid}: the drafter covers {self.state(sid).rows} rows, "
                    f"not the {len(keys) * C} of its prefix"
                )
        out = []
        for sid, keys in items:
            st, n = self.state(sid), 0
            for j, key in enumerate(keys):
                if (st.spec, key) in self.tails:
                    continue
                blk = [
                    (k[:, :, j * C : (j + 1) * C].clone(), v[:, :, j * C : (j + 1) * C].clone())
                    for k, v in st.kv.views()
                ]
                self.tails[(st.spec, key)] = blk
                n += sum(t.numel() * t.element_size() for kv in blk for t in kv)
            out.append(n)
        return out

    def evict(self, keys: list[int]) -> None:
        """Drop the tails of ``keys`` for every spec (unknown ones ignored)."""
        for k in keys:
            for spec in self.drafters:
                self.tails.pop((spec, k), None)

    def covered_rows(self, sid: int) -> int:
        """Committed positions the drafter KV of ``sid`` covers. Raises :class:`~tandem.engine.protocols.UnknownSequence`."""
        return self.state(sid).rows

    @torch.no_grad()
    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        """For each item: ingest its committed rows' ``features`` at the next positions, then draft the
        block ``[anchor, MASK x k]`` (``anchor = next_tokens[-1]``, ``k = num_draft_tokens``, at most
        ``block_size - 1``) and return ``k`` tokens: the argmax per position (``dflash``) or the
        selector's path (``dflash2``). Raises :class:`~tandem.engine.protocols.UnknownSequence`, ``ValueError`` on a spec change."""
        # the drafter runs row-invariant (:meth:`~tandem.model.dflash.DFlashDrafter.use_kernels`)
        res: list[list[int]] = []
        blocks: dict[tuple[str, int], list[int]] = {}  # (spec, k) -> item indices drafting a block of k
        for it in items:
            st = self.state(it.sid)
            if st.spec is None:
                st.spec = it.spec
            elif st.spec != it.spec:
                raise ValueError(f"sequence {it.sid} drafts with {st.spec}, not {it.spec}")
            model = self.drafters[it.spec]
            n = len(it.next_tokens)
            feats = it.features.to(self.device).reshape(n, -1)
            if st.kv is None:
                a = model.layers[0].self_attn
                st.kv = ContextKV(len(model.layers), a.h, a.d, model.fc.weight)
            k = min(it.num_draft_tokens, model.cfg.block_size - 1)
            res.append([])
            if k > 0:  # ingest and draft in one compiled call where the CPU kernels serve the drafter
                got = dispatch.dflash_round(
                    model, self.embed.weight, self.head, st.kv, feats, int(it.next_tokens[-1]), k, self.threads
                )
                if got is not None:
                    res[-1], st.rows = got, st.rows + n
                    continue
            self._ingest(model, st, feats)
            if k > 0:
                blocks.setdefault((it.spec, k), []).append(len(res) - 1)
        for (spec, k), idx in blocks.items():  # one block forward per spec and block size, all sequences
            model, sts = self.drafters[spec], [self.state(items[i].sid) for i in idx]
            anchors = [int(items[i].next_tokens[-1]) for i in idx]
            x = model.block_input(torch.tensor(anchors, device=self.device), self.embed, k + 1).reshape(
                1, -1, model.cfg.hidden_size
            )
            pos = torch.cat([torch.arange(st.rows, st.rows + k + 1, device=self.device) for st in sts])
            views = [st.kv.views() for st in sts]
            kv = [([v[i][0] for v in views], [v[i][1] for v in views]) for i in range(len(model.layers))]
            h = model(x, pos, kv, block=k + 1)[0].view(len(idx), k + 1, -1)[:, 1:]
            logits = self._head(h).float()
            for j, (i, a) in enumerate(zip(idx, anchors)):
                res[i] = (
                    model.selector.walk(h[j], logits[j], a)
                    if model.selector is not None
                    else logits[j].argmax(-1).tolist()
                )
        return res

    def contexts(self, sids: list[int], spec: str) -> tuple[DFlashDrafter, list[ContextKV]] | None:
        """The drafter of ``spec`` and each sequence's context K/V (made when missing, the spec fixed as a first draft
        fixes it), for rounds that draft inside the trunk's call (:meth:`~tandem.engine.trunk_stage.TrunkStage.spec_burst`;
        :meth:`ingested` then records the rows they took in); None (nothing changed) when the compiled drafter round
        does not serve ``spec`` here (:func:`tandem.ops.dispatch.dflash_burst_fits`). Raises
        :class:`~tandem.engine.protocols.UnknownSequence`, ``ValueError`` on a spec change."""
        model = self.drafters[spec]
        if not dispatch.dflash_burst_fits(model, self.head):
            return None
        sts = [self.state(sid) for sid in sids]
        for sid, st in zip(sids, sts):
            if st.spec not in (None, spec):
                raise ValueError(f"sequence {sid} drafts with {st.spec}, not {spec}")
        out = []
        for st in sts:
            st.spec = spec
            if st.kv is None:
                a = model.layers[0].self_attn
                st.kv = ContextKV(len(model.layers), a.h, a.d, model.fc.weight)
            out.append(st.kv)
        return model, out

    def ingested(self, sids: list[int]) -> None:
        """Record the rows a call that drafted in place (:meth:`contexts`) took into each sequence's context."""
        for sid in sids:
            st = self.state(sid)
            st.rows = st.kv.rows

    def _ingest(self, model: DFlashDrafter, st: DFlashState, feats: torch.Tensor) -> None:
        """The torch path's ingest of committed rows' ``feats [n, F]`` at the next positions into ``st``'s context
        K/V, in pieces ending at multiples of ``PREFIX_BLOCK`` (warm prefix starts equal cold ones)."""
        n = feats.shape[0]
        pts = split_points(st.rows, st.rows + n)
        st.kv.room(n)
        for a, b in zip(pts, pts[1:]):
            kv = model.context_kv(
                model.context(feats[None, a - pts[0] : b - pts[0]]), torch.arange(a, b, device=self.device)
            )
            for i, (k, v) in enumerate(kv):
                st.kv.k[i][:, :, a:b], st.kv.v[i][:, :, a:b] = k, v
        st.kv.rows = st.rows = st.rows + n

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The trunk's LM head on drafted rows ``h [..., D] -> [..., V]``, row-invariant as the drafter is (the
        tandem GEMM: faster than MKL for a few rows, cold weights as bf16), whatever the trunk's setting."""
        head = self.head
        if isinstance(head, dispatch.ServingLinear):
            return dispatch.linear(head.kernels.replace(rows=True), h, head.weight, head.bias)
        return head(h)

    def handle(self, arrays: schema.Arrays) -> schema.Arrays:
        """The wire form (:data:`tandem.schema.DRAFTER_DFLASH`): ``draft`` and ``close`` as every drafter;
        ``open`` with optional ``SPEC`` + ``PREFIX_KEYS`` / ``PREFIX_LENGTHS`` (warm start), ``publish``
        (``NBYTES`` per sequence), ``evict`` (keys in one ``PREFIX_LENGTHS`` entry). Raises
        :class:`~tandem.schema.WireError` naming the field."""
        op = schema.get_op(arrays, self.wire)
        nbytes = np.zeros(0, np.int64)
        if op in ("open", "publish", "evict"):
            sids = schema.get_sids(arrays)
            try:
                if op == "evict":
                    self.evict(schema.prefixes_from_wire(arrays, 1)[0] or [])
                elif op == "open":
                    pre = schema.prefixes_from_wire(arrays, len(sids))
                    specs = self._specs(arrays, len(sids)) if any(pre) else [None] * len(sids)
                    self.open(sids, [(a, p) if p else None for a, p in zip(specs, pre)])
                else:
                    for s in sids:
                        if s not in self.states:
                            raise WireError(f"SIDS: unknown sequence id {s} (not open in the drafter)")
                    nbytes = np.array(
                        self.publish(list(zip(sids, [p or [] for p in schema.prefixes_from_wire(arrays, len(sids))]))),
                        np.int64,
                    )
            except WireError:
                raise
            except (KeyError, ValueError) as e:  # an unpublished tail, a too-short drafter cover
                raise WireError(f"PREFIX_KEYS: {e.args[0] if e.args else e}") from None
            return {"DRAFTS": np.zeros(0, np.int64), "DRAFT_LENGTHS": np.zeros(len(sids), np.int32), "NBYTES": nbytes}
        return {**super().handle(arrays), "NBYTES": nbytes}

    def _specs(self, arrays: schema.Arrays, n: int) -> list[str]:
        specs = [
            a.decode() if isinstance(a, bytes) else str(a) for a in np.asarray(arrays.get(schema.SPEC, [])).reshape(-1)
        ]
        if len(specs) != n:
            raise WireError(f"{schema.SPEC} has {len(specs)} entries for {n} SIDS")
        for a in specs:
            if a not in self.drafters:
                raise WireError(f"{schema.SPEC}: {a!r} is not served here (loaded: {sorted(self.drafters)})")
        return specs

    def requests(self, arrays: schema.Arrays, sids: list[int], ks: list[int]) -> list[DraftRequest]:
        """The draft items of a packed request: ``FEATURES [N, F]``, ``LENGTHS [S]``, ``ANCHORS [S]``,
        ``SPEC [S]`` (``FEATURES`` copied to the drafters' device)."""
        feats = schema.get_vector(arrays, self.wire.input("FEATURES"), ndim=2)
        if feats.shape[1] != self.feature_size:
            raise WireError(f"FEATURES must be [N, {self.feature_size}], got {list(feats.shape)}")
        lengths = schema.lengths_of(arrays, len(sids), feats.shape[0], "FEATURES")
        anchors = schema.get_vector(arrays, self.wire.input("ANCHORS"))
        if anchors.size != len(sids):
            raise WireError(f"ANCHORS has {anchors.size} entries for {len(sids)} SIDS")
        specs = self._specs(arrays, len(sids))
        for s, a in zip(sids, specs):
            if self.states[s].spec not in (None, a):
                raise WireError(f"{schema.SPEC}: sequence {s} drafts with {self.states[s].spec}, not {a}")
        schema.check_tokens("ANCHORS", anchors, self.embed.num_embeddings)
        fs = schema.split_rows(torch.from_numpy(np.ascontiguousarray(feats)).to(self.device), lengths)
        # the stage reads only each sequence's anchor (the last next token); the others are not sent
        return [
            DraftRequest(s, torch.zeros(0), [0] * (n - 1) + [int(a)], k, f, spec)
            for s, n, a, k, f, spec in zip(sids, lengths, anchors.tolist(), ks, fs, specs)
        ]
