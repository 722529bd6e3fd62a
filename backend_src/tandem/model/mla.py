"""``indexed_attention``: NoPE multi-head latent attention (MLA) with the DSA k-pool indexer.

Selection (DeepSeek-V3.2 DSA with GLM's k-pool compression), defined per query token at absolute
position ``p``, causally and identically in every mode (training, prime, verify):

* complete pools ``j`` (tokens ``[j*kp, (j+1)*kp)``) with ``(j+1)*kp - 1 <= p`` are candidates;
* a pool's key is the softmax(gate + ape)-weighted mean of its tokens' indexer keys;
* pool score ``sum_h w_h * relu(q_h . pk_j / sqrt(di))``; the ``index_topk / kp`` best pools are
  kept, ties broken toward the earlier pool (stable sort);
* the incomplete tail ``[floor((p+1)/kp)*kp, p]`` is always visible.

With ``index_topk >= p + 1`` this is plain causal attention (the dense regime in which
transformers' ``Glm5NextTextModel`` is the oracle).

:func:`pool_scores`, :func:`select_pools` and :func:`masked_attention` are the torch references of
the Triton kernels ``tandem.ops.triton.dsa_indexer`` and ``tandem.ops.triton.mla_attention``, which the
model takes instead when :func:`tandem.ops.dispatch.use_triton` says so (CUDA, or forced) and
autograd is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..ops import dispatch

from ..ops.settings import DEFAULT, KernelSettings
from .config import TrunkConfig
from .layers import RMSNorm, fused_linear

if TYPE_CHECKING:
    from .cache import MLACache


def pool_scores(iq: torch.Tensor, iw: torch.Tensor, pk: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """DSA pool scores ``sum_h (w_h Hi^-1/2) relu(q_h . pk_j di^-1/2)`` (fp32 ``[B, T, P]``) of
    indexer queries ``iq [B, T, Hi, di]`` with head weights ``iw [B, T, Hi]`` over pool keys ``pk [B, P, di]``;
    ``heads``: the ``Hi`` of the scale when ``iq`` holds some of the heads (tensor parallelism)."""
    hi, di = iq.shape[-2:]
    hi = heads or hi
    s = F.relu(torch.matmul(iq.float(), pk.float().transpose(-1, -2).unsqueeze(1)) * di**-0.5)  # [B,T,H,P]
    w = iw.float() * hi**-0.5
    return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)


def select_pools(scores: torch.Tensor, q_pos: torch.Tensor, kv_len: int, kp: int, k_pools: int) -> torch.Tensor:
    """DSA visibility mask ``[B, T, kv_len]`` (bool) from pool scores ``[B, T, P]`` for queries at
    absolute positions ``q_pos [T]``: the ``k_pools`` best candidate pools (ties toward the earlier
    pool) of ``kp`` tokens each, plus the incomplete tail (module docstring)."""
    b, t, p = scores.shape
    dev = scores.device
    pool_end = (torch.arange(p, device=dev) + 1) * kp - 1
    cand = pool_end[None, :] <= q_pos[:, None]  # [T, P]
    mask = torch.zeros(b, t, kv_len, dtype=torch.bool, device=dev)
    if p > 0:
        s = scores.masked_fill(~cand, float("-inf"))
        k = min(k_pools, p)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]  # [B,T,k]
        ok = cand.expand(b, t, p).gather(-1, order)
        pool_sel = torch.zeros(b, t, p, dtype=torch.bool, device=dev)
        pool_sel.scatter_(-1, order, ok)
        mask[..., : p * kp] = pool_sel.repeat_interleave(kp, dim=-1)
    kv = torch.arange(kv_len, device=dev)
    tail_start = ((q_pos + 1) // kp) * kp
    tail = (kv[None, :] >= tail_start[:, None]) & (kv[None, :] <= q_pos[:, None])
    return mask | tail.unsqueeze(0)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Softmax attention of ``q [B, H, T, dqk]`` over ``k [B, H, L, dqk]``, ``v [B, H, L, dv]`` where
    ``mask [B, T, L]`` (bool) is True, logits scaled by ``scaling``. Returns ``[B, H, T, dv]``."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scaling)


class Indexer(nn.Module):
    """DSA indexer weights (checkpoint names of transformers' ``Glm5NextTextIndexer``)."""

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT
    #: tensor parallelism (:mod:`tandem.model.parallel`): the group, and the head count of the whole layer
    #: (this rank's heads' scores are summed across ranks); None: one rank
    tp = None
    heads_total: int | None = None

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.h, self.d = cfg.index_n_heads, cfg.index_head_dim
        self.kp = cfg.index_kpool
        self.k_pools = cfg.index_topk // cfg.index_kpool
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.h * self.d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.d, bias=False)
        self.k_norm = nn.LayerNorm(self.d, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.h, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kp, self.d))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(self.d, cfg.hidden_size))

    def token_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token indexer key and pool gate logits, both ``[B, T, di]``."""
        return self.key_norm(self.wk(x)), dispatch.linear(self.kernels, x, self.index_kpool_compress_gate)

    def key_norm(self, k: torch.Tensor) -> torch.Tensor:
        """``k_norm`` (LayerNorm) of keys ``[..., di]``; fp32 with the serving kernels on, one kernel call
        (:func:`~tandem.ops.cpu.kernels.layer_norm`)."""
        y = dispatch.layer_norm(self.kernels, k, self.k_norm)
        return self.k_norm(k) if y is None else y

    def pool_keys(self, keys: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Compress complete pools. ``keys, gates [B, P*kp, di]`` -> ``[B, P, di]`` (serving, one fp32
        sequence: :func:`~tandem.ops.cpu.attention.pool_keys`, the arithmetic of the pools the
        decode kernel completes)."""
        b, n, d = keys.shape
        got = dispatch.pool_keys(self.kernels, keys, gates, self.index_kpool_compress_ape)
        if got is not None:
            return got
        p = n // self.kp
        kk = keys[:, : p * self.kp].view(b, p, self.kp, d)
        lg = gates[:, : p * self.kp].view(b, p, self.kp, d).float() + self.index_kpool_compress_ape.float()
        return (lg.softmax(dim=2).to(kk.dtype) * kk).sum(2)

    def mask(
        self, x: torch.Tensor, rows: dict[str, torch.Tensor], pk: torch.Tensor, q_pos: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """Visibility mask ``[B, T, kv_len]`` of rows ``x [B, T, D]`` (``rows`` from
        :meth:`MLAttention.project`) over pool keys ``pk [B, P, di]``: :meth:`select` of
        :meth:`scores`, or for one sequence in serving :func:`~tandem.ops.cpu.kernels.dsa_mask`."""
        # (under tensor parallelism the pool scores sum every rank's heads: the torch path's all-reduce, no kernel)
        mask = dispatch.dsa_mask(self.kernels, self, x, rows, pk, q_pos, kv_len) if self.tp is None else None
        return self.select(self.scores(x, rows["q_resid"], pk), q_pos, kv_len) if mask is None else mask

    def queries(self, x: torch.Tensor, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries ``[B, T, Hi, di]`` and head weights ``[B, T, Hi]`` of rows ``x [B, T, D]``
        (taken from ``rows`` in the fused serving layout)."""
        b, t = x.shape[:2]
        if "iq" in rows:
            return rows["iq"].view(b, t, self.h, self.d), rows["iw"]
        return self.wq_b(rows["q_resid"]).view(b, t, self.h, self.d), self.weights_proj(x)

    def scores(self, x: torch.Tensor, q_resid: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
        """Pool scores ``[B, T, P]`` (fp32) for queries ``x [B,T,D]`` over pool keys ``pk [B,P,di]``."""
        b, t = x.shape[:2]
        s = pool_scores(self.wq_b(q_resid).view(b, t, self.h, self.d), self.weights_proj(x), pk, self.heads_total)
        return s if self.tp is None else self.tp.all_reduce(s)

    def select(self, scores: torch.Tensor, q_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Visibility mask ``[B, T, kv_len]`` (bool) from pool scores ``[B, T, P]`` for queries at
        absolute positions ``q_pos [T]`` (:func:`select_pools`)."""
        return select_pools(scores, q_pos, kv_len, self.kp, self.k_pools)


class MLAttention(nn.Module):
    """NoPE MLA (checkpoint names of transformers' ``Glm5NextTextAttention``).

    Cached per token: latent ``c_kv [kv_lora]`` plus its expansion ``K [H, dqk]``, ``V [H, dv]``,
    indexer key and gate ``[di]``; per complete pool its compressed key ``[di]``.
    """

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.h = cfg.num_attention_heads
        self.dqk, self.dv = cfg.qk_head_dim, cfg.v_head_dim
        D = cfg.hidden_size
        self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * self.dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.h * (cfg.qk_nope_head_dim + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, D, bias=False)
        self.indexer = Indexer(cfg)
        self.scaling = self.dqk**-0.5
        self.last_aux_loss: torch.Tensor | None = None

    #: linears reading the same input, fused in the serving layout
    FUSED = {
        "_fused_x": (
            "q_a_proj",
            "kv_a_proj_with_mqa",
            "indexer.wk",
            "indexer.weights_proj",
            "indexer.index_kpool_compress_gate",
        ),
        "_fused_q": ("q_b_proj", "indexer.wq_b"),
    }

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token tensors of rows ``x [B, T, D]``: query ``q [B,H,T,dqk]``, ``q_resid``, and the
        cacheable ``latent [B,T,r]``, ``k [B,H,T,dqk]``, ``v [B,H,T,dv]``, ``ik``/``ig [B,T,di]``; in
        the fused serving layout also the indexer queries ``iq [B,T,Hi*di]`` and head weights ``iw [B,T,Hi]``."""
        b, t, _ = x.shape
        rows: dict[str, torch.Tensor] = {}
        fx, fq = fused_linear(self, "_fused_x", x), getattr(self, "_fused_q", None)
        if fx is not None and fq is not None:  # serving layout: one GEMM per shared input
            qa, kva, ikr, rows["iw"], ig = fx.split(self._fused_x[1], -1)
            q_resid = self.q_a_layernorm(qa)
            q, rows["iq"] = dispatch.linear(self.kernels, q_resid, fq[0]).split(fq[1], -1)
            ik = self.indexer.key_norm(ikr)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q, kva = self.q_b_proj(q_resid), self.kv_a_proj_with_mqa(x)
            ik, ig = self.indexer.token_keys(x)
        latent = self.kv_a_layernorm(kva)
        kv = self.kv_b_proj(latent).view(b, t, self.h, self.dqk + self.dv).transpose(1, 2)
        k, v = kv.split([self.dqk, self.dv], dim=-1)
        rows.update(
            q=q.view(b, t, self.h, self.dqk).transpose(1, 2),
            q_resid=q_resid,
            latent=latent,
            k=k.contiguous(),
            v=v.contiguous(),
            ik=ik,
            ig=ig,
        )
        return rows

    def attend(self, x, rows, k_all, v_all, pk_all, q_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the rows' queries over ``k_all [B,H,L,dqk]``/``v_all`` with DSA selection.
        Returns ``y [B, T, D]`` and the visibility mask ``[B, T, L]``."""
        o, mask = self._heads_out(x, rows, k_all, v_all, pk_all, q_pos)
        return self.o_proj(o), mask

    def _heads_out(self, x, rows, k_all, v_all, pk_all, q_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` before ``o_proj``: the heads' outputs ``[B, T, H*dv]`` and the mask (the reference
        of :func:`~tandem.ops.cpu.attention.mla_rows_into` and of
        :func:`~tandem.ops.cpu.attention.mla_many`, which serving's :meth:`rows_many` calls)."""
        b, t, _ = x.shape
        mask = self.indexer.mask(x, rows, pk_all, q_pos, k_all.shape[2])
        o = dispatch.mla_attention(self.kernels, x, rows["q"], k_all, v_all, mask, self.scaling)  # Triton, or None
        if o is None and dispatch.numba(self.kernels, x) and t <= 16:
            # few rows: two GEMMs, each row's sums independent of the row count;
            # K @ Q^T, not Q @ K^T: this CPU's GEMM gives each column the same sums whatever the column
            # count, but not each row whatever the row count (measured)
            att = torch.matmul(k_all, (rows["q"] * self.scaling).transpose(-1, -2)).transpose(-1, -2)
            att = att.masked_fill(~mask.unsqueeze(1), float("-inf"))
            o = torch.matmul(att.softmax(-1), v_all)
        elif o is None:
            o = masked_attention(rows["q"], k_all, v_all, mask, self.scaling)
        return o.transpose(1, 2).reshape(b, t, -1), mask

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Full causal pass from position 0 (training, prime). ``x [B,T,D]`` -> ``y [B,T,D]`` and the
        cache tensors (``latent, k, v, ik, ig, pk``)."""
        rows = self.project(x)
        pk = self.indexer.pool_keys(rows["ik"], rows["ig"])
        q_pos = torch.arange(x.shape[1], device=x.device)
        y, _ = self.attend(x, rows, rows["k"], rows["v"], pk, q_pos)
        rows["pk"] = pk
        if self.training and pk.shape[1] > 0:
            self.last_aux_loss = self.indexer_kl(x, rows, pk)
        return y, rows

    def rows(self, x: torch.Tensor, cache: "MLACache") -> torch.Tensor:
        """Run rows ``x [1, R, D]`` at positions ``len(cache) ..``, appending them (and any pools they
        complete) to ``cache``. Returns ``[1, R, D]``."""
        return self.rows_many(x, [cache], [x.shape[1]])

    def rows_many(self, x: torch.Tensor, caches: list["MLACache"], lengths: list[int]) -> torch.Tensor:
        """:meth:`rows` for several sequences at once: ``x [1, sum R, D]`` holds each sequence's rows in
        turn (``lengths``); projections and ``o_proj`` run over all rows, attention per sequence over
        its own ``caches[i]``. Returns ``[1, sum R, D]``."""
        rows, outs, off = self.project(x), [], 0
        if "iq" in rows and dispatch.mla_rows_fit(self.kernels, x, max(lengths)):
            return self.o_proj(dispatch.mla_rows(self, rows, caches, lengths))
        if self.indexer.tp is None and dispatch.mla_rows_triton(self.kernels, x):  # (its DSA selection: one rank's)
            return self.o_proj(self._triton_rows(x, rows, caches, lengths))
        for cache, n in zip(caches, lengths):
            seg = {k: v[:, :, off : off + n] if k in ("q", "k", "v") else v[:, off : off + n] for k, v in rows.items()}
            outs.append(self._cached(x[:, off : off + n], seg, cache))
            off += n
        return self.o_proj(torch.cat(outs, 1) if len(outs) > 1 else outs[0])

    def _triton_rows(
        self, x: torch.Tensor, rows: dict[str, torch.Tensor], caches: list["MLACache"], lengths: list[int]
    ) -> torch.Tensor:
        """CUDA path of :meth:`rows_many` before ``o_proj``: each sequence's rows appended to its cache,
        then one DSA indexer and one attention launch over all sequences' rows (ragged; each reads its
        own cache in place). Returns the heads' outputs ``[1, sum R, H * dv]``."""
        ix, pos, off = self.indexer, [], 0
        for cache, n in zip(caches, lengths):
            pos.append(torch.arange(len(cache), len(cache) + n, device=x.device))
            cache.append(rows, off, n)
            self._add_pools(cache)
            off += n
        iq, iw = ix.queries(x, rows)
        pks = [c.pk[0] if c.pk is not None else iq.new_zeros(0, ix.d) for c in caches]
        _, mask = dispatch.dsa_select_rows(
            iq[0], iw[0], pks, lengths, torch.cat(pos), [len(c) for c in caches], ix.kp, ix.k_pools
        )
        o = dispatch.mla_attend_rows(
            rows["q"][0].transpose(0, 1),
            [c.k[0] for c in caches],
            [c.v[0] for c in caches],
            mask,
            lengths,
            self.scaling,
        )
        return o.reshape(1, o.shape[0], -1)

    def _add_pools(self, cache: "MLACache") -> None:
        """Compress the pools the cache's rows completed since the last call."""
        n_complete = len(cache) // cache.kp
        if n_complete > cache.n_pools():
            lo, hi = cache.n_pools() * cache.kp, n_complete * cache.kp
            cache.add_pools(self.indexer.pool_keys(cache.ik[:, lo:hi], cache.ig[:, lo:hi]))

    def _cached(self, x: torch.Tensor, rows: dict[str, torch.Tensor], cache: "MLACache") -> torch.Tensor:
        pos0 = len(cache)
        cache.append(rows)
        self._add_pools(cache)
        q_pos = pos0 + torch.arange(x.shape[1], device=x.device)
        pk = cache.pk if cache.pk is not None else cache.ik.new_zeros(1, 0, cache.ik.shape[-1])
        return self._heads_out(x, rows, cache.k, cache.v, pk, q_pos)[0]

    def prime(self, x: torch.Tensor, cache: "MLACache") -> torch.Tensor:
        """Prefill rows ``x [1, T, D]``: the full causal pass when ``cache`` is empty, else :meth:`rows`."""
        if len(cache) > 0 or (self.kernels.rows and dispatch.mla_rows_fit(self.kernels, x, x.shape[1])):
            return self.rows(x, cache)
        y, rows = self(x)
        cache.append(rows)
        cache.add_pools(rows["pk"])
        return y

    def indexer_kl(self, x: torch.Tensor, rows: dict[str, torch.Tensor], pk: torch.Tensor) -> torch.Tensor:
        """DSA indexer warm-up loss (DeepSeek-V3.2, §2.1): KL(p_attn || p_index) per query, where
        ``p_attn`` is the dense causal attention mass (summed over heads, detached) pooled per
        candidate pool and ``p_index`` the softmax of the indexer's pool scores. Scalar."""
        b, t, _ = x.shape
        kp = self.indexer.kp
        p = pk.shape[1]
        with torch.no_grad():
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = torch.matmul(rows["q"].float(), rows["k"].float().transpose(-1, -2)) * self.scaling
            att = att.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)  # [B,T,T]
            target = att[..., : p * kp].reshape(b, t, p, kp).sum(-1)
            pool_end = (torch.arange(p, device=x.device) + 1) * kp - 1
            cand = pool_end[None, :] <= torch.arange(t, device=x.device)[:, None]  # [T,P]
            target = target.masked_fill(~cand, 0.0)
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
            has = cand.any(-1)
        sc = self.indexer.scores(x, rows["q_resid"].detach(), pk).masked_fill(~cand, float("-inf"))
        logq = sc.log_softmax(-1).masked_fill(~cand, 0.0)
        kl = (target * (target.clamp_min(1e-9).log() - logq)).sum(-1)
        return kl[:, has].mean()
