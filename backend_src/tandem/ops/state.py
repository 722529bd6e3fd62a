"""The recurrent state of a KDA layer for one sequence, as the kernels and the trunk cache hand it on.

:class:`KDARows` holds a verify pass's rows (views of its buffers, shared by its sequences);
:class:`KDAState` the state after some of them, or a tail and state of its own. Plain torch data, no
kernel code: :mod:`tandem.model.cache` keeps them per layer, :mod:`tandem.ops.cpu.kda` and
:mod:`tandem.ops.cpu.decode` make them. :class:`ContextKV` is a DFlash drafter's context keys and values
(:mod:`tandem.engine.dflash_stage` keeps one per sequence, :mod:`tandem.ops.cpu.dflash` appends to it in place).
"""

from __future__ import annotations

import typing

import torch


class KDARows(typing.NamedTuple):
    """One sequence's rows of a KDA verify pass, kept until :meth:`tandem.model.cache.TrunkCache.commit`: views of the
    pass's buffers shared by all its sequences (no per-sequence slices are made until one row is
    kept). ``full [1, 3C, W]`` pre-conv inputs, this sequence's ``km1 = K - 1`` tail columns then its
    rows starting at column ``col``; ``states [1, N, H, dk, dv]`` every row's state, this sequence's
    from row ``row``."""

    full: torch.Tensor
    states: torch.Tensor
    km1: int
    col: int = 0
    row: int = 0

    def after(self, n_rows: int) -> "KDAState":
        """The state after this sequence's first ``n_rows`` rows (views, not copies, made on first use)."""
        return KDAState(rows=self, n_rows=n_rows)


class KDAState:
    """Recurrent state of one linear layer for one sequence: conv ``tail [1, 3*qkv, K-1]`` and
    ``S [1, H, dk, dv]`` (both fp32). Made by :meth:`KDARows.after` it refers to that pass's buffers
    (``rows``, after its first ``n_rows`` rows) and makes the two views on first use: a decode round's
    kernel reads the buffers in place without them (:func:`~tandem.ops.cpu.kda.kda_rows_fused`).
    Raises ``ValueError`` unless given either both tensors or ``rows``."""

    __slots__ = ("_tail", "_S", "rows", "n_rows")

    def __init__(
        self,
        tail: torch.Tensor | None = None,
        S: torch.Tensor | None = None,
        rows: KDARows | None = None,
        n_rows: int = 0,
    ) -> None:
        if (tail is None) != (S is None) or (tail is None) == (rows is None):
            raise ValueError("KDAState takes tail and S, or rows (a KDARows) and n_rows")
        self._tail, self._S, self.rows, self.n_rows = tail, S, rows, n_rows

    @property
    def tail(self) -> torch.Tensor:
        if self._tail is None:
            c = self.rows.col + self.n_rows
            self._tail = self.rows.full[:, :, c : c + self.rows.km1]
        return self._tail

    @property
    def S(self) -> torch.Tensor:
        if self._S is None:
            self._S = self.rows.states[:, self.rows.row + self.n_rows - 1]
        return self._S

    def clone(self) -> "KDAState":
        return KDAState(self.tail.clone(), self.S.clone())


class ContextKV:
    """One sequence's DFlash drafter context keys and values: per layer a buffer ``[1, H, capacity, d]`` (dtype and
    device of ``like``) whose first ``rows`` positions are filled, grown by doubling, so a round's new rows are
    written in place, not the whole context copied; :meth:`views` gives ``[1, H, rows, d]`` views."""

    def __init__(self, layers: int, heads: int, d: int, like: torch.Tensor, capacity: int = 256) -> None:
        self.k = [like.new_empty(1, heads, capacity, d) for _ in range(layers)]
        self.v = [like.new_empty(1, heads, capacity, d) for _ in range(layers)]
        self.rows = 0

    @classmethod
    def of(cls, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> "ContextKV":
        """A buffer holding the per-layer ``(k, v) [1, H, rows, d]`` given."""
        _, H, rows, d = kv[0][0].shape
        out = cls(len(kv), H, d, kv[0][0], max(256, 2 * rows))
        for i, (k, v) in enumerate(kv):
            out.k[i][:, :, :rows], out.v[i][:, :, :rows] = k, v
        out.rows = rows
        return out

    def room(self, n: int) -> None:
        """Make room for ``n`` more rows (a new buffer, double the size, when full)."""
        cap = self.k[0].shape[2]
        if self.rows + n <= cap:
            return
        new = max(2 * cap, self.rows + n)
        for bufs in (self.k, self.v):
            for i, b in enumerate(bufs):
                g = b.new_empty(1, b.shape[1], new, b.shape[3])
                g[:, :, : self.rows] = b[:, :, : self.rows]
                bufs[i] = g

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the filled keys and values ``[1, H, rows, d]`` (views: a later :meth:`room` may move the rows)."""
        return [(k[:, :, : self.rows], v[:, :, : self.rows]) for k, v in zip(self.k, self.v)]
