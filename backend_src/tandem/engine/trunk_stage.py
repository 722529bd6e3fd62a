"""The trunk stage: one :class:`~tandem.model.cache.TrunkCache` per open sequence, batched prime /
verify / commit, each pass exporting the rows' argmax, hidden and (for the DFlash arms)
target-layer features. :meth:`TrunkStage.handle` is the same API in wire form (:data:`tandem.schema.TRUNK`):
it is what runs inside the ``trunk`` Triton model, and in-process behind a local transport.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tandem_kernels import dispatch

from .. import schema
from ..model.cache import KDAState, MLACache, TrunkCache
from ..model.trunk import Trunk
from ..schema import WireError
from . import sampling
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
    model: Trunk, outs: list, features: tuple[int, ...], samplers: list | None = None, last_only: bool = False
) -> list[VerifyOut]:
    """Per sequence a :class:`VerifyOut` from its pass output (hidden ``[1, R, D]``, or the pair with
    features): one LM-head GEMM and one top-2 over all sequences' rows. ``samplers[j]`` (None:
    greedy) is ``(params, row tokens, position of row 0, last row only)`` for
    :func:`~tandem.engine.sampling.row_targets`, which then gives sequence ``j``'s targets (on CUDA,
    or with the Triton kernels forced, the fused :func:`tandem_kernels.sampler.targets_and_gaps`).

    ``last_only`` (a prime: only its last row decides a token): the LM head runs on each sequence's
    last row alone (as vLLM and SGLang do for prefill), and the rows before it carry argmax ``-1`` and
    gap ``NaN`` (:class:`VerifyOut`). A prompt of ``R`` rows then costs one LM-head row, not ``R``."""
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
        last_t, last_g = _targets(model.logits(h[ends]), [1] * len(lengths), smp)
        target = torch.full((h.shape[0],), -1, dtype=last_t.dtype, device=last_t.device)
        gap = torch.full((h.shape[0],), float("nan"), dtype=last_g.dtype, device=last_g.device)
        target[ends], gap[ends] = last_t, last_g
    else:
        target, gap = _targets(model.logits(h), lengths, samplers)
    cols = (target, h.float(), gap)
    res = []
    for j, parts in enumerate(zip(*(c.split(lengths) for c in cols))):
        f = outs[j][1][0] if features else hs[j].new_zeros(lengths[j], 0)
        res.append(VerifyOut(*parts, f.float()))
    return res


def _targets(logits: torch.Tensor, lengths: list[int], samplers: list | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets ``[R]`` and top-2 gaps ``[R]`` of ``logits [R, V]`` (the fused Triton sampler on CUDA)."""
    if dispatch.use_triton(logits):
        from tandem_kernels import sampler

        return sampler.targets_and_gaps(logits, lengths, samplers)
    return sampling.targets_and_gaps(logits, lengths, samplers)


class TrunkStage(KeyedStates):
    """Implements :class:`~tandem.engine.protocols.TrunkAPI` in this process.

    Args: ``model``; ``max_ctx`` tokens per sequence (default ``max_position_embeddings``);
    ``feature_layers`` — trunk layers whose outputs every pass exports as ``features`` (the DFlash
    drafter's ``target_layer_ids``; empty: none); ``batch_invariant`` — see :attr:`Trunk.batch_invariant`;
    ``decode_threads`` — see :attr:`Trunk.decode_threads`.
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
    ) -> None:
        super().__init__()
        self.model = model
        model.batch_invariant = batch_invariant
        model.decode_threads = decode_threads
        self.feature_layers = tuple(feature_layers)
        self.max_ctx = max_ctx or model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size
        #: published prefix blocks by chain key (changed only by :meth:`publish` / :meth:`evict`)
        self.blocks: dict[int, TrunkBlock] = {}
        #: per sequence, the KDA states captured at each multiple of PREFIX_BLOCK its prime reached
        self.captures: dict[int, dict[int, dict[int, KDAState]]] = {}
        #: per sampled sequence, its current turn's sampling (set by each prime; absent: greedy)
        self.sampling: dict[int, sampling.SamplingParams] = {}

    def open(self, sids: list[int]) -> None:
        super().open(sids)
        for s in sids:
            self.captures.pop(s, None)
            self.sampling.pop(s, None)

    def close(self, sids: list[int]) -> None:
        super().close(sids)
        for s in sids:
            self.captures.pop(s, None)
            self.sampling.pop(s, None)

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

    def verify(self, items: list[Rows]) -> list[VerifyOut]:
        f = self.feature_layers
        self._commit_first(items)
        if not items:
            return []
        caches = [self.cache(it.sid) for it in items]
        outs = self.model.verify_many(caches, [torch.tensor([it.tokens], device=self.model.device) for it in items], f)
        return _outs(self.model, outs, f, [self._sampler(it, c.pos, False) for it, c in zip(items, caches)])

    def decode(self, items: list[Rows], steps: int, stop_ids: list[tuple[int, ...]]) -> list[list[VerifyOut]]:
        """Up to ``steps`` plain greedy rounds of every item in one call (:meth:`Trunk.decode_many
        <tandem.model.trunk.Trunk.decode_many>`; compiled on the CPU): each item's pending verify is
        committed first (``commit``), then round ``t`` verifies its anchor (``tokens == [anchor]``;
        round ``t + 1``'s anchor is round ``t``'s argmax) and every round but the last is committed;
        the items stop after the first round whose target is in one's ``stop_ids`` (each group of
        :meth:`Trunk.decode_many <tandem.model.trunk.Trunk.decode_many>` on its own). Returns per item
        the :class:`VerifyOut` of each round it ran (one row each), as :meth:`verify` would.

        Raises ``ValueError`` for a sampled sequence (greedy only), an item that is not one anchor,
        or no room for ``steps`` rows."""
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
        self._commit_first(items)
        if not items:
            return []
        r = self.model.decode_many(
            [self.cache(it.sid) for it in items], [it.tokens[0] for it in items], steps, stop_ids, self.feature_layers
        )
        return [VerifyOut(q["tokens"], q["hidden"], q["gaps"], q["features"]) for q in r]

    def commit(self, items: list[Commit]) -> None:
        for it in items:
            self.cache(it.sid).commit(it.n_rows)

    # -- wire form ----------------------------------------------------------------------------------
    def handle(self, arrays: schema.Arrays, run=None, with_rows: bool = True) -> schema.Arrays:
        """Run one packed request (:data:`tandem.schema.TRUNK`). Every sequence is checked before
        any is touched, so a rejected request changes no cache. Returns ``ARGMAX [R]``,
        ``HIDDEN [R, D]``, ``TOP2_GAP [R]``, ``FEATURES [R, F]`` over all rows (``R = 0`` but for
        prime / verify) and ``NBYTES [S]`` (publish; else empty). ``PREFIX_KEYS`` / ``PREFIX_LENGTHS``
        carry prime's prefix (-1: none), publish's chains and (one entry, no SIDS) evict's keys.
        Raises :class:`~tandem.schema.WireError` naming the field.
        ``run``: the object whose open / close / prime / verify / commit / publish / evict run the
        checked request (default this stage; the co-located :class:`~tandem.engine.colocated.StageHost`
        passes itself); ``with_rows`` False: ``HIDDEN`` / ``FEATURES`` go out as ``[R, 0]``.
        """
        op = schema.get_op(arrays, schema.TRUNK)
        if op == "draft_verify" or op in schema.HOSTED_OPS:
            raise WireError(
                f"OP {op!r}: this trunk does not run the drafters (the trunk model's parameter colocate "
                "is false; the tandem model's must be too)"
            )
        run, pack = run or self, lambda outs, nbytes=(): self._pack(outs, nbytes, with_rows)
        sids = schema.get_sids(arrays)
        if op in ("open", "close"):
            getattr(run, op)(sids)
            return pack([])
        if op == "evict":
            run.evict(schema.prefixes_from_wire(arrays, 1)[0] or [])
            return pack([])
        for s in sids:
            if s not in self.caches:
                raise WireError(f"SIDS: unknown sequence id {s} (not open in the trunk)")
        prefixes = schema.prefixes_from_wire(arrays, len(sids))
        if op == "publish":
            try:
                return pack([], run.publish([(s, p or []) for s, p in zip(sids, prefixes)]))
            except ValueError as e:
                raise WireError(f"PREFIX_KEYS: {e}") from None
        n_rows = self._n_rows(arrays, sids, required=op == "commit")
        if op == "commit":
            run.commit([Commit(s, n) for s, n in zip(sids, n_rows)])
            return pack([])
        toks = schema.get_vector(arrays, schema.TRUNK.input("TOKENS"))
        lengths = schema.lengths_of(arrays, len(sids), toks.size, "TOKENS")
        schema.check_tokens("TOKENS", toks, self.vocab_size)
        for s, n, p, kept in zip(sids, lengths, prefixes, n_rows):
            c = self.caches[s]
            if c.pending is not None and not kept:
                raise WireError(f"OP: {op} for sequence {s} while a verify is pending (commit first, or N_ROWS)")
            if op == "prime" and p:
                if c.pos != 0:
                    raise WireError(
                        f"PREFIX_KEYS: sequence {s} is not empty ({c.pos} rows); a prefix starts a sequence"
                    )
                missing = [k for k in p if k not in self.blocks]
                if missing:
                    raise WireError(f"PREFIX_KEYS: block {missing[0]} is not published")
                n += len(p) * schema.PREFIX_BLOCK
            if c.pos + n > c.max_ctx:
                raise WireError(f"TOKENS: context full for sequence {s}: {c.pos} + {n} rows > max_ctx {c.max_ctx}")
        smp = sampling.from_wire(arrays, len(sids)) if op == "prime" else [None] * len(sids)
        items = [
            Rows(s, rows.tolist(), p if op == "prime" else None, n, sp)
            for s, rows, p, n, sp in zip(sids, schema.split_rows(toks, lengths), prefixes, n_rows, smp)
        ]
        return pack(getattr(run, op)(items))

    def _n_rows(self, arrays: schema.Arrays, sids: list[int], required: bool, check: bool = True) -> list[int]:
        """``N_ROWS`` per sequence, checked against its pending verify (``check``; else only its count):
        commit's rows to keep, or for prime / verify the previous round's commit folded in (0 or
        absent: none). Raises ``WireError``."""
        if schema.TRUNK.input("N_ROWS").name not in arrays and not required:
            return [0] * len(sids)
        n_rows = [int(x) for x in schema.get_vector(arrays, schema.TRUNK.input("N_ROWS"))]
        if len(n_rows) != len(sids):
            raise WireError(f"N_ROWS has {len(n_rows)} entries for {len(sids)} SIDS")
        for s, n in zip(sids, n_rows if check else ()):
            c = self.caches[s]
            if n == 0 and not required:
                continue
            if c.pending is None:
                raise WireError(f"N_ROWS: sequence {s} has no pending verify to commit")
            if not 1 <= n <= c.pending_rows:
                raise WireError(f"N_ROWS: {n} for sequence {s} outside [1, {c.pending_rows}]")
        return n_rows

    def _pack(self, outs: list[VerifyOut], nbytes: list[int] = (), with_rows: bool = True) -> schema.Arrays:
        """The wire outputs over ``outs``' rows (``with_rows`` False: ``HIDDEN`` / ``FEATURES`` ``[R, 0]``, the
        rows stay in this process)."""
        nb = np.array(list(nbytes), np.int64)
        none = {
            "DRAFTS": np.zeros(0, np.int64),
            "DRAFT_LENGTHS": np.zeros(0, np.int32),  # draft_verify's (colocate)
            "ROUNDS_RUN": np.zeros(0, np.int32),
            "ANCHORS": np.zeros(0, np.int64),
        }
        R = sum(o.argmax.shape[0] for o in outs)
        D, F = self.model.cfg.hidden_size, len(self.feature_layers) * self.model.cfg.hidden_size

        def wire(
            name: str, dtype, width: int | None = None
        ) -> np.ndarray:  # the one copy back to the host (bf16 has no numpy dtype)
            if not outs or (width is not None and not with_rows):
                return np.zeros((R, width if with_rows else 0) if width is not None else 0, dtype)
            t = torch.cat([getattr(o, name) for o in outs])
            return (t if dtype is np.int64 else t.float()).cpu().numpy().astype(dtype, copy=False)

        return {
            "ARGMAX": wire("argmax", np.int64),
            "HIDDEN": wire("hidden", np.float32, D),
            "TOP2_GAP": wire("top2_gap", np.float32),
            "FEATURES": wire("features", np.float32, F),
            "NBYTES": nb,
            **none,
        }
