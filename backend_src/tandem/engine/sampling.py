"""Sampled decoding: the request's transforms, session-owned Philox noise, and each verify row's
target token, so that the greedy accept walk (:func:`tandem.engine.accept.accept_walk`) run on
those targets *is* lossless speculative sampling.

Noise: one uniform stream per (seed, absolute position, purpose) from numpy's Philox counter-based
bit generator (Philox4x64-10; Salmon et al. 2011): key ``(seed, purpose)``, counter
``(0, position, 0, 0)``. No global RNG; a position's numbers do not depend on batching, burst size
or draft length. ``position`` is the index in the sequence of the token being decided.

Rejection mode (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2): with ``p`` the
transformed trunk distribution at a row and ``q`` the drafter's at the same row, draft ``x`` is
accepted when ``u_accept < min(1, p(x) / q(x))``; else the token comes from
``norm(max(0, p - q))`` (``u_residual``); after the last draft the bonus comes from ``p``
(``u_bonus``). A row's target is ``x`` when accepted, else the residual sample (never ``x``: a
rejected ``x`` has ``p(x) < q(x)``), so "accept drafts while they equal the targets, then emit the
target" is the rejection walk. Plain sampled decoding draws from ``p`` with ``u_bonus``.

Coupled mode: every decided token is ``argmax(log p + G)``, ``G`` Gumbel noise of (seed, position),
on the plain path and in the walk alike: the speculative stream is token-identical to plain
sampling with the same seed (Gumbel-max trick; the coupling of e.g. Sun et al. 2023, SpecTr).
"""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np
import torch

from .. import schema
from ..ops import dispatch
from ..ops.noise import ACCEPT, BONUS, DRAFT, GUMBEL, RESIDUAL  # noqa: F401 - the noise purposes, used here and by callers
from ..ops.settings import DEFAULT, KernelSettings
from ..schema import WireError

_SEED_MAX = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One turn's sampling: ``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p`` (1 = off),
    ``seed`` (the Philox key, ``[0, 2**63)``) and ``mode`` (:data:`tandem.schema.SAMPLING_MODES`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    mode: str = schema.REJECTION

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def create(
        cls,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        mode: str = schema.REJECTION,
    ) -> "SamplingParams":
        """Checked parameters (``seed`` None: a fresh random seed, never a shared stream). Raises
        :class:`~tandem.schema.WireError` naming the field and its range."""
        specs = {t.name: t for t in schema.SAMPLING_INPUTS}
        for name, v in ((schema.TEMPERATURE, temperature), (schema.TOP_K, top_k), (schema.TOP_P, top_p)):
            if not np.isfinite(v):
                raise WireError(f"{name} must be a finite number, got {v}")
            schema.check_range(specs[name], v)
        if seed is not None:
            schema.check_range(specs[schema.SEED], seed, hi=_SEED_MAX)
        if mode not in schema.SAMPLING_MODES:
            raise WireError(f"{schema.SAMPLING} must be one of {schema.SAMPLING_MODES}, got {mode!r}")
        return cls(
            float(temperature), int(top_k), float(top_p), secrets.randbits(63) if seed is None else int(seed), mode
        )


def uniforms(seed: int, position: int, purpose: int, n: int = 1) -> np.ndarray:
    """``n`` uniforms in ``[0, 1)`` (float64) of the stream keyed by (``seed``, ``position``, ``purpose``)."""
    bg = np.random.Philox(key=np.array([seed, purpose], np.uint64), counter=np.array([0, position, 0, 0], np.uint64))
    return np.random.Generator(bg).random(n)


def transform(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """The request's distribution: ``softmax(logits / T)`` over the ``top_k`` most likely tokens
    (ties at the k-th value kept) and then the smallest most-likely set of mass ``>= top_p``.
    ``logits [R, V]`` -> probabilities ``[R, V]`` float64 (zeros outside the kept set)."""
    z = logits.double().numpy() / p.temperature
    z = z - z.max(-1, keepdims=True)
    if 0 < p.top_k < z.shape[-1]:
        kth = np.partition(z, -p.top_k, axis=-1)[:, -p.top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
    e = np.exp(z)
    probs = e / e.sum(-1, keepdims=True)
    if p.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sp = np.take_along_axis(probs, order, -1)
        drop = np.cumsum(sp, -1) - sp >= p.top_p  # mass before a token already reaches top_p
        np.put_along_axis(probs, order, np.where(drop, 0.0, sp), -1)
        probs /= probs.sum(-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: ``probs [B, V]`` (any non-negative weights), ``u [B]`` in ``[0, 1)`` ->
    token ids ``[B]``; never a zero-weight token."""
    cdf = np.cumsum(probs, -1)
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)  # the first token whose cdf exceeds u * total
    return np.minimum(idx, probs.shape[-1] - 1)


def rejection_targets(
    probs: np.ndarray,
    drafts: np.ndarray,
    u_accept: np.ndarray,
    u_residual: np.ndarray,
    u_bonus: np.ndarray,
    q: np.ndarray | None = None,
) -> np.ndarray:
    """Per-row targets of lossless speculative sampling, batched over ``B`` independent walks.

    Args: ``probs [B, R, V]`` the transformed trunk distribution at each of the ``R = k + 1`` rows;
    ``drafts [B, k]`` (draft ``i`` is tested at row ``i``); ``u_accept``, ``u_residual [B, k]`` and
    ``u_bonus [B]`` uniforms; ``q [B, k, V]`` the drafter's distributions, or None for one-hot drafts
    (argmax drafters: ``q(x) = 1``). Returns ``[B, R]`` int64: at row ``i < k`` the draft when
    accepted (``u < min(1, p(x)/q(x))``) else a draw from ``norm(max(0, p - q))``; at row ``k`` a
    draw from ``p`` (the bonus)."""
    B, R, V = probs.shape
    k = R - 1
    out = np.empty((B, R), np.int64)
    if k:
        b = np.arange(B)[:, None]
        pr = probs[:, :k]
        px = pr[b, np.arange(k)[None], drafts]
        qx = np.ones_like(px) if q is None else q[b, np.arange(k)[None], drafts]
        ok = u_accept < np.minimum(1.0, px / np.maximum(qx, 1e-300))
        if q is None:
            resid = pr.copy()
            np.put_along_axis(resid, drafts[..., None], 0.0, -1)
        else:
            resid = np.maximum(pr - q, 0.0)
        res = sample(resid.reshape(B * k, V), u_residual.reshape(-1)).reshape(B, k)
        out[:, :k] = np.where(ok, drafts, res)
    out[:, k] = sample(probs[:, k], u_bonus)
    return out


def row_targets(
    logits: torch.Tensor, tokens: list[int], pos0: int, p: SamplingParams, last_only: bool = False
) -> torch.Tensor:
    """Target tokens of one sequence's trunk pass under sampling ``p`` (not greedy).

    ``logits [R, V]`` of rows at positions ``pos0 .. pos0 + R - 1`` whose tokens are ``tokens``
    (verify: the anchor then the drafts, one-hot); row ``i`` decides the token at ``pos0 + i + 1``.
    ``last_only`` (prime): only the last row's target is drawn (the others stay 0). Returns ``[R]`` int64.
    """
    R, V = logits.shape
    lo = R - 1 if last_only else 0
    probs = transform(logits[lo:].cpu(), p)
    positions = range(pos0 + lo + 1, pos0 + R + 1)
    if p.mode == schema.COUPLED:
        g = np.stack([uniforms(p.seed, t, GUMBEL, V) for t in positions])
        with np.errstate(divide="ignore"):
            tgt = np.argmax(np.log(probs) - np.log(-np.log(g)), -1)
    else:
        k = 0 if last_only else R - 1
        pos = list(positions)
        drafts = np.array(tokens[1:] if k else [], np.int64)[None]
        u_a = np.array([uniforms(p.seed, t, ACCEPT)[0] for t in pos[:k]])[None]
        u_r = np.array([uniforms(p.seed, t, RESIDUAL)[0] for t in pos[:k]])[None]
        tgt = rejection_targets(
            probs[None], drafts.reshape(1, k), u_a.reshape(1, k), u_r.reshape(1, k), uniforms(p.seed, pos[-1], BONUS)
        )[0]
    out = torch.zeros(R, dtype=torch.int64, device="cpu")  # drawn on the host (numpy); the caller moves it
    out[lo:] = torch.from_numpy(np.asarray(tgt, np.int64))
    return out


def targets_and_gaps(
    logits: torch.Tensor, lengths: list[int], samplers: list | None = None, kernels: KernelSettings = DEFAULT
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's target token ``[R]`` int64 and top-2 logit gap ``[R]`` (the reference of the fused
    Triton sampler, :func:`tandem.ops.triton.sampler.targets_and_gaps`; on the CPU the greedy targets
    and gaps come from :func:`~tandem.ops.cpu.kernels.top2`).

    ``logits [R, V]`` hold the walks' rows in turn (``lengths``); ``samplers[j]`` (None: greedy, the
    argmax) is ``(params, row tokens, position of row 0, last row only)`` for :func:`row_targets`;
    ``kernels`` the model's kernel settings.
    """
    got = dispatch.top2(kernels, logits)  # one pass over each row
    if got is not None:
        target, gap = got
    else:
        top = logits.topk(2, dim=-1)
        target, gap = top.indices[:, 0], top.values[:, 0] - top.values[:, 1]
    if samplers is not None and any(samplers):
        target, off = target.clone(), 0
        for n, smp in zip(lengths, samplers):
            if smp is not None:
                target[off : off + n] = row_targets(logits[off : off + n], smp[1], smp[2], smp[0], smp[3]).to(
                    target.device
                )
            off += n
    return target, gap
