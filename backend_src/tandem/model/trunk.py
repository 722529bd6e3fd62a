"""The glm5_next trunk and its native MTP layer, in tandem's own torch code.

Module and parameter names equal the Hugging Face checkpoint keys (``embed_tokens``,
``layers.{i}.…``, ``norm``, ``lm_head``; the MTP layer at ``layers.{num_hidden_layers}``), so
``state_dict()`` is the checkpoint and transformers' ``Glm5NextTextModel`` loads it.

Three entry points share one set of layer functions:

* :meth:`Trunk.hidden` — full causal pass from position 0 (training);
* :meth:`Trunk.prime` — prefill rows into a :class:`TrunkCache` (chunked KDA);
* :meth:`Trunk.verify` — rows appended after the committed ones, keeping every row's KDA state
  so :meth:`TrunkCache.commit` can roll back exactly.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from ..ops import dispatch
from ..ops.settings import DEFAULT, KernelSettings
from .cache import KDARows, KDAState, TrunkCache
from .config import TrunkConfig
from .block import DecoderLayer
from .layers import RMSNorm
from .mtp import MTPLayer


def _check_rows(cache: TrunkCache, ids: torch.Tensor, what: str) -> int:
    """Rows in ``ids [1, T]``; raises ``ValueError`` if a verify is pending or they overflow the cache."""
    if cache.pending is not None:
        raise ValueError(f"{what} while a verify pass is pending")
    n = ids.shape[1]
    if cache.pos + n > cache.max_ctx:
        raise ValueError(f"context full: {cache.pos} + {n} tokens > max_ctx {cache.max_ctx}")
    return n


#: parameters and buffers kept in fp32 whatever the compute dtype (name fragments)
FP32_KEEP = (
    "e_score_correction_bias",
    "gate.weight",
    "conv1d",
    "dt_bias",
    "A_log",
    "attn_hc.base",
    "attn_hc.scale",
    "ffn_hc.base",
    "ffn_hc.scale",
)


def is_fp32_param(name: str) -> bool:
    """Parameters kept in fp32 whatever the compute dtype (transformers' ``_keep_in_fp32_modules_strict``)."""
    return any(k in name for k in FP32_KEEP)


def row_groups(rows: list[int], n: int) -> list[range]:
    """Positions ``0 .. len(rows) - 1`` in order, cut into ``min(n, len(rows))`` runs (each non-empty) of
    about equal total ``rows``: a cut goes where the running total first reaches its share, or where
    the positions left are just enough for the runs left. E.g. ``row_groups([16] * 8, 2) == [range(0, 4),
    range(4, 8)]``, ``row_groups([600, 10, 10], 2) == [range(0, 1), range(1, 3)]``."""
    n, total = max(1, min(n, len(rows))), sum(rows)
    bounds, run = [0], 0
    for k, r in enumerate(rows[:-1]):
        run += r
        left = len(rows) - k - 1  # positions after this one
        if len(bounds) < n and left >= n - len(bounds) and (run * n >= total * len(bounds) or left == n - len(bounds)):
            bounds.append(k + 1)
    bounds.append(len(rows))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Trunk(nn.Module):
    """glm5_next trunk + LM head + (optional) MTP layer.

    ``dtype`` is the compute dtype (bf16 serving default, fp32 exactness mode); parameters listed
    in :data:`FP32_KEEP` stay fp32 as in transformers.
    """

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    #: a row's logits bit-identical alone (plain decoding, M=1), inside a verify block (M=k+1) or in a
    #: batch of sessions: on the CPU the verify passes and the LM head take the row-invariant GEMM of
    #: :mod:`~tandem.ops.cpu.gemm` (a BLAS sums a row differently by the number of rows); elsewhere
    #: a one-row verify is padded to two rows. The serving parameter ``batch_invariant`` sets it; setting it gives
    #: the trunk's layers the row-invariant kernel settings (:meth:`use_kernels`)
    _batch_invariant: bool = False
    #: threads of :meth:`decode_many` (groups of sequences decoded side by side; the serving parameter
    #: ``decode_threads`` sets it)
    decode_threads: int = 1
    #: threads a call of one group splits its large GEMMs and its MoE's experts across (the serving parameter
    #: ``split_threads``; :func:`~tandem.ops.cpu.groups.run_groups`)
    split_threads: int = 1
    #: what the checkpoint loader read (:func:`~tandem.model.checkpoint.load_trunk`: the layout, skipped vision
    #: tensors, FP8 dequantized), for the load log
    loaded_from: str = ""
    #: the released layout's image and video placeholder token ids, which a prompt may not hold (tandem serves
    #: the text model)
    vision_token_ids: tuple[int, ...] = ()
    #: it holds FP8 weights (:mod:`tandem.model.fp8`; set by the loader): on the CPU it then runs without the numba
    #: kernels, which read dequantized weights (:meth:`use_kernels`)
    fp8_kept: bool = False

    def __init__(self, cfg: TrunkConfig, with_mtp: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i]) for i in range(cfg.num_hidden_layers)]
        if with_mtp:
            layers.append(MTPLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def use_kernels(self, kernels: KernelSettings) -> "Trunk":
        """Run with the kernel settings ``kernels`` (:func:`tandem.ops.dispatch.install`; a loader calls it once):
        the trunk's own modules in the row-invariant mode when :attr:`batch_invariant`, the MTP layer always
        (its drafts come from the row-invariant GEMM, faster than MKL for a few rows); without the numba kernels
        when it holds FP8 weights on the CPU (:attr:`fp8_kept`). Returns the trunk."""
        if self.fp8_kept and self.lm_head.weight.device.type == "cpu":
            kernels = kernels.replace(numba=False)
        dispatch.install(self, kernels.replace(rows=self._batch_invariant))
        if self.mtp is not None:
            dispatch.install(self.mtp, kernels.replace(rows=True))
        return self

    @property
    def batch_invariant(self) -> bool:
        """See :attr:`_batch_invariant`; setting it gives the trunk's modules the matching kernel settings."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)
        self.use_kernels(self.kernels)

    @property
    def mtp(self) -> MTPLayer | None:
        """The native MTP layer (:class:`~tandem.model.mtp.MTPLayer`) or None."""
        n = self.cfg.num_hidden_layers
        return self.layers[n] if len(self.layers) > n else None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are (and the stages create the model's input tensors)."""
        return self.embed_tokens.weight.device

    def _streams(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(ids)
        return e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def _mean(self, streams: torch.Tensor) -> torch.Tensor:
        """The mean of streams ``[B, T, N, D]`` over ``N``; in the row-invariant mode the kernel the compiled
        decode steps take (:func:`~tandem.ops.cpu.trunk_pass.stream_mean`), so their rows match."""
        m = dispatch.stream_mean(self.kernels, streams)
        return streams.mean(2) if m is None else m

    def _final(self, streams: torch.Tensor) -> torch.Tensor:
        return self.norm(self._mean(streams))

    def _layers(self, s: torch.Tensor, attn_fn, features: tuple[int, ...], block_fn=None):
        """Run the trunk layers on streams ``s [B, T, N, D]`` with ``attn_fn(i, layer)`` giving each
        layer's attention function, or ``block_fn(i, layer)`` (when given and not None) the whole
        block's ``[B, T, N, D] -> [B, T, N, D]``. Returns the final hidden ``[B, T, D]``, or with
        ``features`` the pair (hidden, the mean of the streams after each listed layer, concatenated
        ``[B, T, n*D]``)."""
        feats = []
        dispatch.new_pass()
        for i, layer in enumerate(
            itertools.islice(self.layers, self.cfg.num_hidden_layers)
        ):  # (a slice: a new ModuleList)
            run = block_fn(i, layer) if block_fn is not None else None
            s = run(s) if run is not None else layer.run(s, attn_fn(i, layer))
            if i in features:
                feats.append(self._mean(s))
        h = self._final(s)
        return (h, torch.cat(feats, -1)) if features else h

    # -- training / full pass -------------------------------------------------------------------
    def hidden(self, ids: torch.Tensor, features: tuple[int, ...] = ()):
        """Full causal pass. ``ids [B, T]`` -> final normalised hidden ``[B, T, D]`` (and with
        ``features``, the target-layer features ``[B, T, len(features) * D]``)."""
        return self._layers(self._streams(ids), lambda i, layer: lambda x: layer.self_attn(x)[0], tuple(features))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head in fp32: ``[..., D] -> [..., V]`` (under :attr:`batch_invariant` row-invariant, see there)."""
        if self._invariant_rows():
            return self.lm_head(h).float()
        if self.batch_invariant and h.numel() == h.shape[-1]:
            return self.lm_head(h.reshape(1, -1).expand(2, -1)).float()[:1].view(*h.shape[:-1], -1)
        return self.lm_head(h).float()

    # -- serving ----------------------------------------------------------------------------------
    def new_cache(self, max_ctx: int | None = None) -> TrunkCache:
        """An empty cache with capacity ``max_ctx`` tokens (default ``max_position_embeddings``)."""
        return TrunkCache(self.cfg.layer_types, self.cfg.index_kpool, max_ctx or self.cfg.max_position_embeddings)

    @torch.no_grad()
    def prime(self, cache: TrunkCache, ids: torch.Tensor, features: tuple[int, ...] = ()):
        """Prefill ``ids [1, T]`` after the committed rows; commits them. Returns hidden ``[1, T, D]``
        (and with ``features`` the target-layer features, see :meth:`hidden`).

        Raises ``ValueError`` when the rows do not fit in ``cache.max_ctx`` or a verify is pending.
        """
        return self.prime_many([cache], [ids], features)[0]

    def _kda_blocks(self, on: bool, caches: list[TrunkCache], lengths: list[int], attn_fn, keep_states: bool, keep):
        """``block_fn`` of :meth:`_layers` for a pass over ``caches``' rows (``lengths``): when ``on``
        (:meth:`_invariant_rows`), each KDA block that fits runs in one
        :func:`~tandem.ops.cpu.block.kda_block` call, bit-identical to the block run kernel by kernel,
        and ``keep(i, per_sequence)`` takes layer ``i``'s KDA rows (``keep_states``) or final states;
        each MLA block that fits in one :func:`~tandem.ops.cpu.mla_block.mla_block` call (the rows
        appended to the caches, as the unfused path appends them)."""

        def block_fn(i, layer):
            if not on:
                return None
            if not dispatch.kda_fits(layer):
                if not dispatch.mla_fits(layer):
                    return None
                return lambda s: (
                    layer.run(s, attn_fn(i, layer))
                    if s.shape[0] != 1
                    else dispatch.mla_block(layer, s, [c.layers[i] for c in caches], lengths)
                )

            def run(s):
                if s.shape[0] != 1:
                    return layer.run(s, attn_fn(i, layer))
                s, per = dispatch.kda_block(layer, s, self._kda_starts(caches, i, layer), lengths, keep_states)
                keep(i, per)
                return s

            return run

        return block_fn

    def _kda_starts(self, caches: list[TrunkCache], i: int, layer, batch: int = 1) -> list:
        """Each sequence's state of KDA layer ``i`` before its rows (a zero state of ``batch`` rows
        before its first)."""
        return [
            st if (st := c.layers[i]) is not None else layer.self_attn.init_state(batch, self.device) for c in caches
        ]

    def _invariant_rows(self) -> bool:
        """The row-invariant kernels apply (:attr:`batch_invariant` on the CPU in fp32)."""
        w = self.embed_tokens.weight
        return self.batch_invariant and w.dtype == torch.float32 and dispatch.numba(self.kernels, w)

    @torch.no_grad()
    def prime_many(self, caches: list[TrunkCache], ids: list[torch.Tensor], features: tuple[int, ...] = ()) -> list:
        """:meth:`prime` of several sequences in one forward: their rows ``ids[i] [1, T_i]`` go
        concatenated through every row-wise stage, and each sequence's attention primes its own
        cache (chunked KDA, MLA). Under :attr:`batch_invariant` (CPU) the row-wise stages take the
        row-invariant kernels, so a sequence's cache and outputs do not depend on the others primed
        with it, and the sequences go in up to :attr:`decode_threads` groups of about equal rows, each
        group's forward on a thread of its own (the fused kernels release the GIL; a group alone splits its large
        GEMMs across :attr:`split_threads`). Returns per
        sequence what :meth:`prime` returns.

        Raises ``ValueError`` (before any cache changes) when a sequence's rows do not fit or it has a
        verify pending.
        """
        lengths = [_check_rows(c, x, "prime") for c, x in zip(caches, ids)]
        groups = row_groups(lengths, self.decode_threads) if self._invariant_rows() else [range(len(caches))]
        return dispatch.run_groups(
            lambda g: self._prime_rows([caches[j] for j in g], [ids[j] for j in g], [lengths[j] for j in g], features),
            groups,
            self.split_threads,
        )

    @torch.no_grad()
    def _prime_rows(
        self, caches: list[TrunkCache], ids: list[torch.Tensor], lengths: list[int], features: tuple[int, ...]
    ) -> list:
        """:meth:`prime_many`'s forward over one group of sequences (rows checked)."""

        def keep(i, finals):  # each sequence's KDA state after its rows
            for c, (tail, S) in zip(caches, finals):
                c.layers[i] = KDAState(tail, S)

        def attn_fn(i, layer):
            attn = layer.self_attn

            def fn(x):
                if layer.layer_type == "linear_attention" and dispatch.numba(self.kernels, x) and x.shape[0] == 1:
                    # the recurrence row by row, every sequence in one kernel call (faster here than
                    # the chunked form up to 256 rows, and the same whatever the chunking)
                    y, finals = attn.forward_rows_many(
                        x, self._kda_starts(caches, i, layer), lengths, keep_states=False
                    )
                    keep(i, finals)
                    return y
                ys = []
                for c, xs in zip(caches, x.split(lengths, 1)):
                    st = c.layers[i]
                    if layer.layer_type != "linear_attention":
                        ys.append(attn.prime(xs, st))
                        continue
                    y, (tail, S) = attn(xs, None if st is None else (st.tail, st.S))
                    c.layers[i] = KDAState(tail, S)
                    ys.append(y)
                return torch.cat(ys, 1) if len(ys) > 1 else ys[0]

            return fn

        fused = self._invariant_rows()
        out = self._layers(
            self._streams(torch.cat(ids, 1) if len(ids) > 1 else ids[0]),
            attn_fn,
            tuple(features),
            self._kda_blocks(fused, caches, lengths, attn_fn, False, keep),
        )
        for c, n in zip(caches, lengths):
            c.pos += n
        parts = [o.split(lengths, 1) for o in (out if features else (out,))]
        res = [tuple(ps[j] for ps in parts) for j in range(len(lengths))]
        return res if features else [r[0] for r in res]

    @torch.no_grad()
    def verify(self, cache: TrunkCache, ids: torch.Tensor, features: tuple[int, ...] = ()):
        """Run ``ids [1, R]`` (anchor + drafts) at positions ``cache.pos ..`` without committing.
        Returns hidden ``[1, R, D]`` (and with ``features`` the target-layer features); follow with
        ``cache.commit(n_rows)``.

        Raises ``ValueError`` when the rows do not fit in ``cache.max_ctx`` or a verify is pending.
        """
        return self.verify_many([cache], [ids], features)[0]

    @torch.no_grad()
    def verify_many(self, caches: list[TrunkCache], ids: list[torch.Tensor], features: tuple[int, ...] = ()) -> list:
        """:meth:`verify` of several sequences in one forward: their rows ``ids[i] [1, R_i]`` are
        concatenated ``[1, sum R, D]`` through every row-wise stage (projections, mHC, norms, MoE), and
        each sequence attends over its own cache. Returns per sequence what :meth:`verify` returns.
        Under :attr:`batch_invariant` the pass is row-invariant (see there; off the CPU a one-row
        sequence computes a second, discarded copy of its row).

        Raises ``ValueError`` (before any cache changes) when a sequence's rows do not fit or it has a
        verify pending.
        """
        lengths = [_check_rows(c, x, "verify") for c, x in zip(caches, ids)]
        kernel = self._invariant_rows()
        pad = self.batch_invariant and not kernel
        rows = [x.repeat(1, 2) if pad and n == 1 else x for x, n in zip(ids, lengths)]
        comp = [x.shape[1] for x in rows]
        pending: list[dict[int, KDARows]] = [{} for _ in caches]

        def keep(i, per):  # each sequence's KDA rows, until its commit
            for p, pr in zip(pending, per):
                p[i] = pr

        def attn_fn(i, layer):
            attn = layer.self_attn
            if layer.layer_type != "linear_attention":
                return lambda x: attn.rows_many(x, [c.layers[i] for c in caches], comp)
            sts = self._kda_starts(caches, i, layer, ids[0].shape[0])

            def fn(x):
                if dispatch.numba(self.kernels, x) and x.shape[0] == 1:
                    y, per = attn.forward_rows_many(x, sts, comp)
                else:  # the torch reference, one sequence at a time
                    res = [
                        attn.forward_rows(xs, (st.tail, st.S) if isinstance(st, KDAState) else st)
                        for xs, st in zip(x.split(comp, 1), sts)
                    ]
                    y = torch.cat([r[0] for r in res], 1)
                    per = [KDARows(full, states, full.shape[-1] - states.shape[1]) for _, full, states in res]
                keep(i, per)
                return y

            return fn

        out = self._layers(
            self._streams(torch.cat(rows, 1)),
            attn_fn,
            tuple(features),
            self._kda_blocks(kernel, caches, comp, attn_fn, True, keep),
        )
        for c, p, n in zip(caches, pending, lengths):
            c.pending, c.pending_rows = p, n
        parts = [o.split(comp, 1) for o in (out if features else (out,))]
        res = [tuple(ps[j][:, :n] for ps in parts) for j, n in enumerate(lengths)]
        return res if features else [r[0] for r in res]

    @torch.no_grad()
    def decode_many(
        self,
        caches: list[TrunkCache],
        anchors: list[int],
        steps: int,
        stop_ids: list[tuple[int, ...]],
        features: tuple[int, ...] = (),
        threads: int | None = None,
    ) -> list[dict]:
        """Up to ``steps`` plain greedy decode steps of several sequences: sequence ``j`` runs its anchor
        ``anchors[j]`` as a one-row :meth:`verify_many`, its argmax is the next step's anchor, and the
        rows of every step but the last are committed (the last stays pending, as after a verify); the
        sequences stop after the first step in which one's target is in its ``stop_ids[j]``. Under
        :attr:`batch_invariant` on the CPU the steps run compiled
        (:func:`~tandem.ops.cpu.decode.decode_steps`, in ``threads`` groups of sequences, default
        :attr:`decode_threads`, each group stopping on its own), bit-identical to the verify passes;
        else (or when a layer does not run fused) the verify passes themselves.

        Returns per sequence ``{"tokens": [n], "gaps": [n], "hidden": [n, D], "features": [n, F]}``.
        Raises ``ValueError`` (before any cache changes) when a sequence has a verify pending or no
        room for ``steps`` rows."""
        for c in caches:
            _check_rows(c, torch.empty(1, steps), "decode")
        if steps < 1 or len(anchors) != len(caches) or len(stop_ids) != len(caches):
            raise ValueError(f"decode: steps {steps} >= 1 and one anchor and stop set per cache ({len(caches)})")
        if self._invariant_rows():
            out = dispatch.decode_steps(
                self, caches, anchors, steps, stop_ids, features, threads or self.decode_threads, self.split_threads
            )
            if out is not None:
                return out
        return self._decode_reference(caches, anchors, steps, stop_ids, features)

    @torch.no_grad()
    def verify_targets(
        self, caches: list[TrunkCache], ids: list[list[int]], features: tuple[int, ...] = (), threads: int | None = None
    ) -> list[dict]:
        """A greedy :meth:`verify_many` of sequence ``j``'s rows ``ids[j]`` (its anchor, then its drafts) with the LM
        head and every row's greedy target: under :attr:`batch_invariant` on the CPU one compiled call per group of
        sequences (:func:`~tandem.ops.cpu.trunk_pass.verify_rows`, up to ``threads`` groups of about equal rows,
        default :attr:`decode_threads`), bit-identical to the passes; else (or when a layer does not run fused)
        :meth:`verify_many` itself. Every sequence's rows stay pending, as after :meth:`verify_many`.

        Returns per sequence ``{"tokens": [R], "gaps": [R], "hidden": [R, D], "features": [R, F]}``. Raises
        ``ValueError`` (before any cache changes) when a sequence's rows do not fit or it has a verify pending."""
        for c, x in zip(caches, ids):
            _check_rows(c, torch.empty(1, len(x)), "verify")
        if self._invariant_rows():
            groups = row_groups([len(x) for x in ids], threads or self.decode_threads)
            out = dispatch.verify_rows(self, caches, ids, features, groups, self.split_threads)
            if out is not None:
                return out
        return self._verify_reference(caches, ids, features)

    def _verify_reference(self, caches: list[TrunkCache], ids: list[list[int]], features: tuple[int, ...]) -> list:
        """:meth:`verify_targets` as :meth:`verify_many`, the LM head and the greedy top-2 (its reference)."""
        outs = self.verify_many(caches, [torch.tensor([x], device=self.device) for x in ids], features)
        h = torch.cat([o[0] if features else o for o in outs], 1)[0]
        logits = self.logits(h)
        got = dispatch.top2(self.kernels, logits)
        if got is not None:
            tgt, gap = got
        else:
            top = logits.topk(2, dim=-1)
            tgt, gap = top.indices[:, 0], top.values[:, 0] - top.values[:, 1]
        f = torch.cat([o[1] for o in outs], 1)[0].float() if features else h.new_zeros(h.shape[0], 0)
        lengths = [len(r) for r in ids]
        cols = [x.split(lengths) for x in (tgt, gap.float(), h.float(), f)]
        return [dict(zip(("tokens", "gaps", "hidden", "features"), parts)) for parts in zip(*cols)]

    def _decode_reference(self, caches, anchors, steps, stop_ids, features=()) -> list[dict]:
        """:meth:`decode_many` as verify passes, one a step, every sequence stopping together (its reference)."""
        steps_out = []
        anchor = list(anchors)
        for t in range(steps):
            if t:
                for c in caches:
                    c.commit(1)
            out = self._verify_reference(caches, [[a] for a in anchor], features)
            anchor = [int(q["tokens"][0]) for q in out]
            steps_out.append(out)
            if any(a in ids for a, ids in zip(anchor, stop_ids)):
                break
        return [
            {k: torch.cat([out[j][k] for out in steps_out]) for k in ("tokens", "gaps", "hidden", "features")}
            for j in range(len(caches))
        ]
