"""The trunk stage: one :class:`~tandem.model.cache.TrunkCache` per open sequence, batched prime /
verify / commit, each pass exporting the rows' argmax, hidden and (for the DFlash specs)
target-layer features. It runs in the engine core's process (the ``tandem`` model's, or in-process).
"""

from __future__ import annotations

import dataclasses

import torch
from ..ops import dispatch
from ..ops.settings import KernelSettings

from .. import schema
from ..model.cache import KDAState, MLACache, TrunkCache
from ..model.trunk import Trunk, row_groups
from . import sampling
from .structured import apply_masks
from .prefix import split_points
from .protocols import Commit, KeyedStates, Rows, VerifyOut

_MLA_ROWS = ("latent", "ik", "ig")  # [1, L, .] per token
_MLA_HEAD_ROWS = ("k", "v")  # [1, H, L, .] per token


@dataclasses.dataclass
class TrunkBlock:
    """A published prefix block of ``PREFIX_BLOCK`` rows: per MLA layer its rows (``latent, ik, ig
    [1, C, .]``, ``k, v [1, H, C, .]``, ``pk [1, C / kp, .]``), per KDA layer the state after the block's
    last row (``tail, S``). Clones: nothing a session does later can change them."""

    mla: dict[int, dict[str, torch.Tensor]]
    kda: dict[int, KDAState]

    def nbytes(self) -> int:
        ts = [t for d in self.mla.values() for t in d.values()] + [
            t for st in self.kda.values() for t in (st.tail, st.S)
        ]
        return sum(t.numel() * t.element_size() for t in ts)


@torch.no_grad()
def _outs(
    model: Trunk,
    outs: list,
    features: tuple[int, ...],
    samplers: list | None = None,
    last_only: bool = False,
    masks: list | None = None,
) -> list[VerifyOut]:
    """Per sequence a :class:`VerifyOut` from its pass output (hidden ``[1, R, D]``, or the pair with
    features): one LM-head GEMM and one top-2 over all sequences' rows. ``samplers[j]`` (None:
    greedy) is ``(params, row tokens, position of row 0, last row only)`` for
    :func:`~tandem.engine.sampling.row_targets`, which then gives sequence ``j``'s targets (on CUDA,
    or with the Triton kernels forced, the fused :func:`tandem.ops.triton.sampler.targets_and_gaps`).

    ``last_only`` (a prime: only its last row decides a token): the LM head runs on each sequence's
    last row alone (as vLLM and SGLang do for prefill), and the rows before it carry argmax ``-1`` and
    gap ``NaN`` (:class:`VerifyOut`). A prompt of ``R`` rows then costs one LM-head row, not ``R``.

    ``masks[j]`` (None: unconstrained): sequence ``j``'s structured-output bitmasks, one per row deciding a
    token (:meth:`~tandem.engine.structured.Constraint.row_masks`), applied to the logits before any target."""
    hs = [o[0] if features else o for o in outs]
    lengths = [h.shape[1] for h in hs]
    h = torch.cat(hs, 1)[0] if len(hs) > 1 else hs[0][0]
    if last_only:
        ends = torch.tensor(lengths, device=h.device).cumsum(0) - 1
        smp = (
            None
            if samplers is None
            else [None if x is None else (x[0], x[1][-1:], x[2] + n - 1, True) for x, n in zip(samplers, lengths)]
        )
        last_t, last_g = _targets(model.kernels, model.logits(h[ends]), [1] * len(lengths), smp, masks)
        target = torch.full((h.shape[0],), -1, dtype=last_t.dtype, device=last_t.device)
        gap = torch.full((h.shape[0],), float("nan"), dtype=last_g.dtype, device=last_g.device)
        target[ends], gap[ends] = last_t, last_g
    else:
        target, gap = _targets(model.kernels, model.logits(h), lengths, samplers, masks)
    cols = (target, h.float(), gap)
    res = []
    for j, parts in enumerate(zip(*(c.split(lengths) for c in cols))):
        f = outs[j][1][0] if features else hs[j].new_zeros(lengths[j], 0)
        res.append(VerifyOut(*parts, f.float()))
    return res


def _targets(
    kernels: KernelSettings, logits: torch.Tensor, lengths: list[int], samplers: list | None, masks: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets ``[R]`` and top-2 gaps ``[R]`` of ``logits [R, V]`` (the fused Triton sampler on CUDA), the
    model's kernel settings ``kernels`` choosing the implementation; ``masks`` (see :func:`_outs`) applied to the
    logits in place first."""
    if masks is not None and any(m is not None for m in masks):
        apply_masks(logits, lengths, masks)
    samplers = samplers if samplers is not None and any(samplers) else None
    got = dispatch.sampler_targets(kernels, logits, lengths, samplers)
    return sampling.targets_and_gaps(logits, lengths, samplers, kernels) if got is None else got


class TrunkStage(KeyedStates):
    """Implements :class:`~tandem.engine.protocols.TrunkAPI` in this process.

    Args: ``model``; ``max_ctx`` tokens per sequence (default ``max_position_embeddings``);
    ``feature_layers`` — trunk layers whose outputs every pass exports as ``features`` (the DFlash
    drafter's ``target_layer_ids``; empty: none); ``batch_invariant`` — see :attr:`Trunk.batch_invariant`;
    ``decode_threads``, ``split_threads`` — see :attr:`Trunk.decode_threads`, :attr:`Trunk.split_threads`.
    Raises :class:`UnknownSequence` for ids it does not hold and ``ValueError`` (from the cache)
    for context overflow or out-of-order calls.
    """

    def __init__(
        self,
        model: Trunk,
        max_ctx: int | None = None,
        feature_layers: tuple[int, ...] = (),
        batch_invariant: bool = schema.DEFAULTS.batch_invariant,
        decode_threads: int = schema.DEFAULTS.decode_threads,
        split_threads: int = schema.DEFAULTS.split_threads,
    ) -> None:
        super().__init__()
        self.model = model
        model.batch_invariant = batch_invariant
        model.decode_threads, model.split_threads = decode_threads, split_threads
        self.feature_layers = tuple(feature_layers)
        self.max_ctx = max_ctx or model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size
        self.vision_token_ids = tuple(model.vision_token_ids)
        #: published prefix blocks by chain key (changed only by :meth:`publish` / :meth:`evict`)
        self.blocks: dict[int, TrunkBlock] = {}
        #: per sequence, the KDA states captured at each multiple of PREFIX_BLOCK its prime reached
        self.captures: dict[int, dict[int, dict[int, KDAState]]] = {}
        #: per sampled sequence, its current turn's sampling (set by each prime; absent: greedy)
        self.sampling: dict[int, sampling.SamplingParams] = {}
        #: per constrained sequence, its current turn's structured-output constraint (set by each prime)
        self.constraints: dict = {}

    def open(self, sids: list[int]) -> None:
        super().open(sids)
        for s in sids:
            self.captures.pop(s, None)
            self.sampling.pop(s, None)
            self.constraints.pop(s, None)

    def close(self, sids: list[int]) -> None:
        super().close(sids)
        for s in sids:
            self.captures.pop(s, None)
            self.sampling.pop(s, None)
            self.constraints.pop(s, None)

    def _masks(self, items: list[Rows], last_only: bool) -> list | None:
        """Each item's structured-output masks for :func:`_outs` (None when no item is constrained)."""
        if not any(it.sid in self.constraints for it in items):
            return None
        return [
            None if (c := self.constraints.get(it.sid)) is None else c.row_masks([] if last_only else it.tokens[1:])
            for it in items
        ]

    def _sampler(self, it: Rows, pos0: int, last_only: bool):
        """The :func:`_outs` sampler of an item (None: greedy)."""
        p = self.sampling.get(it.sid)
        return None if p is None else (p, it.tokens, pos0, last_only)

    @property
    def caches(self) -> dict[int, TrunkCache]:
        """The open sequences' caches (read-only use)."""
        return self.states

    def new_state(self) -> TrunkCache:
        return self.model.new_cache(self.max_ctx)

    def cache(self, sid: int) -> TrunkCache:
        """The cache of ``sid``. Raises :class:`~tandem.engine.protocols.UnknownSequence`."""
        return self.state(sid)

    @torch.no_grad()  # also for the kernels' choice made here (``together``): they apply with autograd off
    def prime(self, items: list[Rows]) -> list[VerifyOut]:
        """Prefill each item (see :class:`~tandem.engine.protocols.Rows` for ``prefix``): restore its
        published blocks, then run its rows, in pieces ending at multiples of ``PREFIX_BLOCK`` when it uses
        the prefix cache; piece j of every item runs in one forward (:meth:`Trunk.prime_many`). Outputs
        cover the rows run (not the restored ones). Raises ``KeyError`` for an
        unpublished key, ``ValueError`` when restoring into a non-empty cache."""
        f = self.feature_layers
        for it in items:
            self.cache(it.sid)  # every sequence is open before any changes
        self._commit_first(items)
        plans = []  # per item: its cache, its rows, their piece boundaries
        for it in items:
            self.sampling.pop(it.sid, None)  # this turn's sampling (absent: greedy) for it and its verifies
            if it.sampling is not None and not it.sampling.greedy:
                self.sampling[it.sid] = it.sampling
            self.constraints.pop(it.sid, None)
            if it.constraint is not None:
                self.constraints[it.sid] = it.constraint
            cache = self.cache(it.sid)
            if it.prefix:
                self._restore(it.sid, cache, it.prefix)
            end = cache.pos + len(it.tokens)
            pts = [cache.pos, end] if it.prefix is None else split_points(cache.pos, end)
            plans.append((cache, torch.tensor([it.tokens], device=self.model.device), pts))
        parts: list[list[tuple]] = [[] for _ in items]
        together = self.model._invariant_rows()  # else one item a forward: a row's sums would depend on the others'
        for w in range(max((len(p[2]) for p in plans), default=1) - 1):  # piece w of every item, one forward
            live = [j for j, (_, _, pts) in enumerate(plans) if w + 1 < len(pts)]
            for group in [live] if together else [[j] for j in live]:
                self._prime_piece(items, plans, parts, group, w)
        cats = [tuple(torch.cat(xs, 1) for xs in zip(*ps)) for ps in parts]
        return _outs(
            self.model,
            [c if f else c[0] for c in cats],
            f,
            [self._sampler(it, p[0].pos - len(it.tokens), True) for it, p in zip(items, plans)],
            last_only=True,
            masks=self._masks(items, True),
        )

    def _prime_piece(self, items: list[Rows], plans: list, parts: list[list[tuple]], group: list[int], w: int) -> None:
        """Piece ``w`` of the items ``group`` in one forward; their outputs into ``parts``, and the
        KDA state captured where a piece ends at a multiple of ``PREFIX_BLOCK`` (prefix cache)."""
        f = self.feature_layers
        ids = [plans[j][1][:, plans[j][2][w] - plans[j][2][0] : plans[j][2][w + 1] - plans[j][2][0]] for j in group]
        for j, o in zip(group, self.model.prime_many([plans[j][0] for j in group], ids, f)):
            parts[j].append(o if f else (o,))
            cache = plans[j][0]
            if (
                items[j].prefix is not None and cache.pos % schema.PREFIX_BLOCK == 0
            ):  # also at the end: a chunked prime goes on from there
                self.captures.setdefault(items[j].sid, {})[cache.pos] = {
                    i: layer.clone() for i, layer in enumerate(cache.layers) if isinstance(layer, KDAState)
                }

    def _restore(self, sid: int, cache: TrunkCache, keys: list[int]) -> None:
        if cache.pos != 0:
            raise ValueError(f"sequence {sid}: a prefix can only start an empty cache (it holds {cache.pos} rows)")
        blocks = [self.blocks[k] for k in keys]
        C = schema.PREFIX_BLOCK
        caps = self.captures.setdefault(sid, {})
        for j, b in enumerate(blocks):
            caps[(j + 1) * C] = b.kda
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, MLACache):
                layer.latent, layer.ik, layer.ig = (torch.cat([b.mla[i][n] for b in blocks], 1) for n in _MLA_ROWS)
                layer.k, layer.v = (torch.cat([b.mla[i][n] for b in blocks], 2) for n in _MLA_HEAD_ROWS)
                layer.pk = torch.cat([b.mla[i]["pk"] for b in blocks], 1)
            elif i in blocks[-1].kda:
                cache.layers[i] = blocks[-1].kda[i].clone()
        cache.pos = len(keys) * C

    def publish(self, items: list[tuple[int, list[int]]]) -> list[int]:
        """See :meth:`~tandem.engine.protocols.TrunkAPI.publish`. The rows come from the sequence's
        cache (append-only below its prime boundary), the KDA states from its prime capture, which is
        dropped. Raises ``ValueError`` when a block was not captured."""
        C, out = schema.PREFIX_BLOCK, []
        for sid, keys in items:  # check everything first: a refused publish stores nothing
            cache, caps = self.cache(sid), self.captures.get(sid, {})
            for j, key in enumerate(keys):
                if key not in self.blocks and ((j + 1) * C not in caps or cache.pos < (j + 1) * C):
                    raise ValueError(f"sequence {sid}: block {j} (rows < {(j + 1) * C}) was not captured by its prime")
        for sid, keys in items:
            cache, caps = self.cache(sid), self.captures.pop(sid, {})
            n = 0
            for j, key in enumerate(keys):
                if key in self.blocks:
                    continue
                lo, end = j * C, (j + 1) * C
                mla = {}
                for i, layer in enumerate(cache.layers):
                    if isinstance(layer, MLACache):
                        d = {n: getattr(layer, n)[:, lo:end].clone() for n in _MLA_ROWS}
                        d.update({n: getattr(layer, n)[:, :, lo:end].clone() for n in _MLA_HEAD_ROWS})
                        d["pk"] = layer.pk[:, lo // layer.kp : end // layer.kp].clone()
                        mla[i] = d
                self.blocks[key] = blk = TrunkBlock(mla, {i: st.clone() for i, st in caps[end].items()})
                n += blk.nbytes()
            out.append(n)
        return out

    def evict(self, keys: list[int]) -> None:
        for k in keys:
            self.blocks.pop(k, None)

    def _commit_first(self, items: list[Rows]) -> None:
        for it in items:
            if it.commit:
                self.cache(it.sid).commit(it.commit)

    @torch.no_grad()  # (the compiled pass applies with autograd off)
    def verify(self, items: list[Rows]) -> list[VerifyOut]:
        f = self.feature_layers
        self._commit_first(items)
        if not items:
            return []
        caches = [self.cache(it.sid) for it in items]
        masks = self._masks(items, False)  # (from the drafts alone: before the pass)
        smp = [self._sampler(it, c.pos, False) for it, c in zip(items, caches)]
        if self.model._invariant_rows():  # on the CPU: the rows, the LM head and greedy targets in the compiled pass
            r = self.model.verify_targets(caches, [list(it.tokens) for it in items], f)
            outs = [VerifyOut(q["tokens"], q["hidden"], q["gaps"], q["features"]) for q in r]
            mine = [
                j for j, it in enumerate(items) if smp[j] is not None or (masks is not None and masks[j] is not None)
            ]
            if mine:  # sampled or constrained: their targets again from the same hidden rows
                self._retarget(
                    [outs[j] for j in mine], [smp[j] for j in mine], [masks[j] if masks else None for j in mine]
                )
            return outs
        outs = self.model.verify_many(caches, [torch.tensor([it.tokens], device=self.model.device) for it in items], f)
        return _outs(self.model, outs, f, smp, masks=masks)

    def _retarget(self, outs: list[VerifyOut], samplers: list, masks: list) -> None:
        """Replace the greedy targets and gaps of ``outs`` (compiled verify rows, in place) by those of their
        sequences' ``samplers`` under their ``masks`` (each None: greedy, unconstrained): the LM head once more
        over their hidden rows (row-invariant, so the logits equal the verify pass's), the masks, the targets."""
        lengths = [o.argmax.shape[0] for o in outs]
        logits = self.model.logits(torch.cat([o.hidden for o in outs]).to(self.model.dtype))
        tgt, gap = _targets(self.model.kernels, logits, lengths, samplers, masks)
        for o, t, g in zip(outs, tgt.split(lengths), gap.split(lengths)):
            o.argmax, o.top2_gap = t, g.float()

    def decode(self, items: list[Rows], steps: int, stop_ids: list[tuple[int, ...]]) -> list[list[VerifyOut]]:
        """Up to ``steps`` plain greedy rounds of every item in one call (:meth:`Trunk.decode_many
        <tandem.model.trunk.Trunk.decode_many>`; compiled on the CPU): each item's pending verify is
        committed first (``commit``), then round ``t`` verifies its anchor (``tokens == [anchor]``;
        round ``t + 1``'s anchor is round ``t``'s argmax) and every round but the last is committed;
        the items stop after the first round whose target is in one's ``stop_ids`` (each group of
        :meth:`Trunk.decode_many <tandem.model.trunk.Trunk.decode_many>` on its own). Returns per item
        the :class:`VerifyOut` of each round it ran (one row each), as :meth:`verify` would.

        Raises ``ValueError`` for a sampled or constrained sequence (greedy, unconstrained only), an item that is
        not one anchor, or no room for ``steps`` rows."""
        return [[o.rows_at(t) for t in range(o.argmax.shape[0])] for o in self.decode_rows(items, steps, stop_ids)]

    def decode_rows(self, items: list[Rows], steps: int, stop_ids: list[tuple[int, ...]]) -> list[VerifyOut]:
        """:meth:`decode` with each item's rounds as one :class:`VerifyOut` of one row a round
        (``argmax [n]``, ``hidden [n, D]``, ...; ``n`` the rounds it ran). Raises as :meth:`decode`."""
        for it in items:
            self.cache(it.sid)
            if len(it.tokens) != 1:
                raise ValueError(f"decode: sequence {it.sid} takes its anchor alone, got {len(it.tokens)} tokens")
            if it.sid in self.sampling:
                raise ValueError(f"decode: sequence {it.sid} samples (decode is greedy)")
            if it.sid in self.constraints:
                raise ValueError(f"decode: sequence {it.sid} is constrained (decode is unconstrained)")
        self._commit_first(items)
        if not items:
            return []
        r = self.model.decode_many(
            [self.cache(it.sid) for it in items], [it.tokens[0] for it in items], steps, stop_ids, self.feature_layers
        )
        return [VerifyOut(q["tokens"], q["hidden"], q["gaps"], q["features"]) for q in r]

    @torch.no_grad()
    def spec_burst(
        self,
        items: list[Rows],
        drafter,
        spec: str,
        ks: list[int],
        feats: list[torch.Tensor | None],
        stop_ids: list[tuple[int, ...]],
        budgets: list[int],
        rounds: int,
    ) -> list[dict] | None:
        """Up to ``rounds`` greedy speculative rounds of every item with the DFlash ``drafter`` stage's ``spec`` in
        one compiled call per group of sequences (:func:`tandem.ops.dispatch.spec_burst`): each item's pending
        verify is committed first (``commit``); with ``ks[j] >= 1`` its drafter takes in ``feats[j] [n, F]`` (the
        committed rows it has not seen) and drafts ``ks[j]`` tokens a round after the anchor (``tokens ==
        [anchor]``), with ``ks[j] == 0`` it verifies its anchor alone (``feats[j]`` unused); the walk stops the items
        after a round in which one's emitted tokens reach one of its ``stop_ids`` or its ``budgets``. Afterwards each
        item's last round is pending, as after :meth:`verify` (its emitted count is the next commit). Returns per item
        the rounds' ``emitted``, ``accepted``, ``drafts`` and ``gaps``, the committed rows its drafter has yet to
        take in (``hidden``, ``features``) and its group's ``seconds`` drafting, verifying and walking; or None
        (nothing changed) when the compiled rounds do not serve them (the row-invariant CPU path, the drafter's
        compiled round). Raises ``ValueError`` for a sampled or constrained sequence, or one without room for
        ``rounds * (k + 1)`` rows."""
        for it, k in zip(items, ks):
            c = self.cache(it.sid)
            if it.sid in self.sampling or it.sid in self.constraints:
                raise ValueError(f"spec_burst: sequence {it.sid} samples or is constrained (the burst is greedy)")
            if len(it.tokens) != 1 or k < 0 or c.pos + it.commit + rounds * (k + 1) > c.max_ctx:
                raise ValueError(f"spec_burst: sequence {it.sid} takes its anchor alone and room for {rounds} rounds")
        if not items or not self.model._invariant_rows() or not dispatch.compiled_pass_fits(self.model):
            return None
        drafting = [it.sid for it, k in zip(items, ks) if k > 0]
        got = drafter.contexts(drafting, spec)
        if got is None:
            return None
        model, mine = got
        ctxs = dict(zip(drafting, mine))
        self._commit_first(items)
        out = dispatch.spec_burst(
            self.model,
            model,
            drafter.head,
            [self.cache(it.sid) for it in items],
            [ctxs.get(it.sid) for it in items],
            [it.tokens[0] for it in items],
            ks,
            feats,
            stop_ids,
            budgets,
            rounds,
            self.feature_layers,
            row_groups([k + 1 for k in ks], self.model.decode_threads),
            self.model.split_threads,
        )
        assert out is not None  # (what it needs was checked above)
        drafter.ingested(drafting)
        return out

    def commit(self, items: list[Commit]) -> None:
        for it in items:
            self.cache(it.sid).commit(it.n_rows)
