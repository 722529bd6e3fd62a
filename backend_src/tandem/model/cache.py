"""The hybrid trunk cache: append-only MLA/DSA rows for ``indexed_attention`` layers, recurrent
KDA state + conv tail for ``linear_attention`` layers, with exact rollback.

Rollback after a verify pass: MLA rows are truncated; for KDA the verify pass keeps every row's
state (``pending``) and :meth:`TrunkCache.commit` selects the state after the last kept row.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class MLACache:
    """Append-only per-token tensors of one indexed layer for one sequence (batch dim 1).

    ``latent [1,L,r]``, ``k [1,H,L,dqk]``, ``v [1,H,L,dv]``, ``ik``/``ig [1,L,di]``,
    ``pk [1, L // kp, di]`` (compressed keys of complete pools).
    """

    kp: int
    latent: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    ik: torch.Tensor | None = None
    ig: torch.Tensor | None = None
    pk: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, rows: dict[str, torch.Tensor]) -> None:
        """Append rows (``latent, k, v, ik, ig`` as produced by ``MLAttention.project``)."""
        if self.latent is None:
            self.latent, self.k, self.v, self.ik, self.ig = (rows[n] for n in ("latent", "k", "v", "ik", "ig"))
            return
        self.latent = torch.cat([self.latent, rows["latent"]], 1)
        self.k = torch.cat([self.k, rows["k"]], 2)
        self.v = torch.cat([self.v, rows["v"]], 2)
        self.ik = torch.cat([self.ik, rows["ik"]], 1)
        self.ig = torch.cat([self.ig, rows["ig"]], 1)

    def add_pools(self, pk_new: torch.Tensor) -> None:
        self.pk = pk_new if self.pk is None else torch.cat([self.pk, pk_new], 1)

    def n_pools(self) -> int:
        return 0 if self.pk is None else self.pk.shape[1]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (and the ``n // kp`` pools they complete)."""
        if self.latent is None:
            return
        assert 0 <= n <= len(self), (n, len(self))
        self.latent, self.ik, self.ig = self.latent[:, :n], self.ik[:, :n], self.ig[:, :n]
        self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
        if self.pk is not None:
            self.pk = self.pk[:, : n // self.kp]

    def clone(self) -> "MLACache":
        c = MLACache(self.kp)
        for f in ("latent", "k", "v", "ik", "ig", "pk"):
            t = getattr(self, f)
            setattr(c, f, None if t is None else t.clone())
        return c

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latent, self.k, self.v, self.ik, self.ig, self.pk)
                   if t is not None)


@dataclasses.dataclass
class KDAState:
    """Recurrent state of one linear layer for one sequence: conv ``tail [1, 3*qkv, K-1]`` and
    ``S [1, H, dk, dv]`` (both fp32)."""

    tail: torch.Tensor
    S: torch.Tensor

    def clone(self) -> "KDAState":
        return KDAState(self.tail.clone(), self.S.clone())


class TrunkCache:
    """Per-sequence trunk cache. ``pos`` rows are committed; between :meth:`Trunk.verify` and
    :meth:`commit` the MLA parts also hold the uncommitted verify rows and ``pending`` holds
    the KDA per-row states.

    Raises ``ValueError`` on a commit that keeps no row or more rows than were verified.
    """

    def __init__(self, layer_types: list[str], kp: int, max_ctx: int) -> None:
        self.layer_types = list(layer_types)
        self.max_ctx = max_ctx
        self.pos = 0
        self.layers: list[MLACache | KDAState | None] = [
            MLACache(kp) if t == "indexed_attention" else None for t in layer_types
        ]
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.pending_rows = 0

    def commit(self, n_rows: int) -> None:
        """Keep the first ``n_rows`` rows of the last verify pass; drop the rest."""
        if self.pending is None:
            raise ValueError("commit without a verify pass")
        if not 1 <= n_rows <= self.pending_rows:
            raise ValueError(f"commit n_rows={n_rows} outside [1, {self.pending_rows}]")
        for i, (full, states) in self.pending.items():
            km1 = full.shape[-1] - self.pending_rows
            self.layers[i] = KDAState(full[:, :, n_rows: n_rows + km1].contiguous(), states[:, n_rows - 1].contiguous())
        self.pos += n_rows
        for layer in self.layers:
            if isinstance(layer, MLACache):
                layer.truncate(self.pos)
        self.pending, self.pending_rows = None, 0

    def clone(self) -> "TrunkCache":
        c = TrunkCache(self.layer_types, 1, self.max_ctx)
        c.pos = self.pos
        c.layers = [None if l is None else l.clone() for l in self.layers]
        return c

    def nbytes(self) -> int:
        """Bytes held by the committed state."""
        n = 0
        for l in self.layers:
            if isinstance(l, MLACache):
                n += l.nbytes()
            elif isinstance(l, KDAState):
                n += l.tail.numel() * l.tail.element_size() + l.S.numel() * l.S.element_size()
        return n
