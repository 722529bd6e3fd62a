"""The recurrent state of a KDA layer for one sequence, as the kernels and the trunk cache hand it on.

:class:`KDARows` holds a verify pass's rows (views of its buffers, shared by its sequences);
:class:`KDAState` the state after some of them, or a tail and state of its own. Plain torch data, no
kernel code: :mod:`tandem.model.cache` keeps them per layer, :mod:`tandem.ops.cpu.kda` and
:mod:`tandem.ops.cpu.decode` make them.
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
