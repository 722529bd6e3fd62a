"""The hybrid trunk cache: append-only MLA/DSA rows for ``indexed_attention`` layers, recurrent
KDA state + conv tail for ``linear_attention`` layers, with exact rollback.

Rollback after a verify pass: MLA rows are truncated; for KDA the verify pass keeps every row's
state (``pending``) and :meth:`TrunkCache.commit` selects the state after the last kept row.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ops.state import KDARows, KDAState


#: MLACache fields and the dimension that grows with the rows: ``latent, ik, ig [1, L, .]``,
#: ``k, v [1, H, L, .]``, ``pk [1, L // kp, .]``
_MLA_DIMS = {"latent": 1, "k": 2, "v": 2, "ik": 1, "ig": 1, "pk": 1}
#: entries a row buffer starts with (rows; pools for ``pk``): a short prompt and a 128-token answer
#: without a copy (a doubling copy of six buffers in two layers cost ~1 ms a turn, ~10 ms for 8 sessions'
#: turns); ~0.6 MiB a layer a sequence (2.4 KB a row)
MIN_ENTRIES = 256


class MLACache:
    """Append-only per-token tensors of one indexed layer for one sequence (batch dim 1).

    ``latent [1,L,r]``, ``k [1,H,L,dqk]``, ``v [1,H,L,dv]``, ``ik``/``ig [1,L,di]``,
    ``pk [1, L // kp, di]`` (compressed keys of complete pools); each attribute is a view of the used
    part of a preallocated buffer that doubles when full (an append copies only the new rows), None
    while empty. Assigning an attribute replaces its buffer (prefix restore).
    """

    def __init__(self, kp: int) -> None:
        self.kp = kp
        self._buf: dict[str, torch.Tensor | None] = dict.fromkeys(_MLA_DIMS)
        self._np_views: dict[str, tuple[torch.Tensor, np.ndarray]] = {}
        self._n = 0  # rows
        self._np = 0  # complete pools stored
        self._ptrs: tuple[int, ...] | None = None  # kernel_ptrs, while the buffers stay

    def _view(self, name: str) -> torch.Tensor | None:
        b = self._buf[name]
        return None if b is None else b.narrow(_MLA_DIMS[name], 0, self._np if name == "pk" else self._n)

    latent = property(lambda self: self._view("latent"), lambda self, t: self._set("latent", t))
    k = property(lambda self: self._view("k"), lambda self, t: self._set("k", t))
    v = property(lambda self: self._view("v"), lambda self, t: self._set("v", t))
    ik = property(lambda self: self._view("ik"), lambda self, t: self._set("ik", t))
    ig = property(lambda self: self._view("ig"), lambda self, t: self._set("ig", t))
    pk = property(lambda self: self._view("pk"), lambda self, t: self._set("pk", t))

    def _set(self, name: str, t: torch.Tensor | None) -> None:
        self._buf[name] = None if t is None else t.contiguous()
        self._np_views.pop(name, None)
        self._ptrs = None
        n = 0 if t is None else t.shape[_MLA_DIMS[name]]
        if name == "pk":
            self._np = n
        else:
            self._n = n

    def __len__(self) -> int:
        return self._n

    def _grow(self, name: str, end: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The buffer behind ``name`` with room for ``end`` entries along its growing dim: a new one
        (``like``'s shape elsewhere and device, ``dtype``) holding the used entries when it is short,
        doubling, :data:`MIN_ENTRIES` at least."""
        dim, b = _MLA_DIMS[name], self._buf[name]
        if b is None or b.shape[dim] < end:
            shape = list(like.shape)
            shape[dim] = max(end, 2 * (0 if b is None else b.shape[dim]), MIN_ENTRIES)
            nb = like.new_empty(shape, dtype=dtype)
            used = min(self._np if name == "pk" else self._n, 0 if b is None else b.shape[dim])
            if used:
                nb.narrow(dim, 0, used).copy_(b.narrow(dim, 0, used))
            self._buf[name] = b = nb
            self._np_views.pop(name, None)  # (it held the old buffer)
            self._ptrs = None
        return b

    def _put(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Write ``rows`` at ``start`` (the used entries' end) along the growing dim, growing the buffer."""
        dim = _MLA_DIMS[name]
        end = start + rows.shape[dim]
        b = self._grow(name, end, rows, rows.dtype)
        b.narrow(dim, start, end - start).copy_(rows)

    def reserve(self, n: int, like: dict[str, torch.Tensor]) -> None:
        """Room for ``n`` more rows in every row buffer and for the pools they complete (new buffers
        float32, shaped like ``like``'s rows ``[1, N, .]`` / ``[1, H, N, .]`` on their device), so a kernel can write
        them in place (:meth:`kernel_ptrs`, then :meth:`extend`)."""
        end, p = self._n + n, self._ptrs
        if p is not None and end <= p[8] and end // self.kp <= p[9]:
            return
        for name in ("latent", "k", "v", "ik", "ig"):
            self._grow(name, end, like[name], torch.float32)
        self._grow("pk", end // self.kp, like["ik"], torch.float32)

    def kernel_ptrs(self) -> tuple[int, ...]:
        """``(latent, k, v, ik, ig, pk, k_capacity, v_capacity, row_capacity, pool_capacity)``: the
        addresses of the float32 C-contiguous buffers (after :meth:`reserve`), the token capacity of
        the K and V buffers ``[1, H, capacity, .]``, the rows every row buffer has room for and the
        pools the pool buffer has room for; for the serving kernels that append rows and attend in
        place (:func:`~tandem.ops.cpu.attention.mla_many`). Made once per set of buffers.

        Raises ``ValueError`` when a buffer is missing, not float32 or not contiguous."""
        if self._ptrs is None:
            names = ("latent", "k", "v", "ik", "ig", "pk")
            bufs = [self._buf[n] for n in names]
            if any(b is None or b.dtype != torch.float32 or not b.is_contiguous() for b in bufs):
                raise ValueError("MLACache.kernel_ptrs: every buffer must be float32 and contiguous (reserve first)")
            caps = [b.shape[_MLA_DIMS[n]] for n, b in zip(names, bufs)]
            self._ptrs = (*(b.data_ptr() for b in bufs), caps[1], caps[2], min(caps[:5]), caps[5])
        return self._ptrs

    def extend(self, n: int) -> None:
        """Count ``n`` rows a kernel wrote in place after the used ones, and the pools they complete
        (:meth:`reserve` made room, :meth:`kernel_ptrs` gave the buffers)."""
        end = self._n + n
        assert self._ptrs is not None and end <= self._ptrs[8], "extend without reserve / kernel_ptrs"
        self._n, self._np = end, end // self.kp

    def append(self, rows: dict[str, torch.Tensor], off: int = 0, n: int | None = None) -> None:
        """Append rows ``off .. off + n`` (default all) of ``latent, k, v, ik, ig`` as produced by
        ``MLAttention.project``."""
        n = rows["latent"].shape[1] - off if n is None else n
        for name in ("latent", "k", "v", "ik", "ig"):
            self._put(name, self._n, rows[name].narrow(_MLA_DIMS[name], off, n))
        self._n += n

    def buffer(self, name: str) -> torch.Tensor:
        """The whole preallocated buffer behind attribute ``name`` (used rows first, then spare capacity)."""
        return self._buf[name]

    def buffer_np(self, name: str) -> np.ndarray:
        """:meth:`buffer` as a numpy view (CPU buffers; made once per buffer)."""
        b = self._buf[name]
        hit = self._np_views.get(name)
        if hit is None or hit[0] is not b:
            hit = self._np_views[name] = (b, b.numpy())
        return hit[1]

    def add_pools(self, pk_new: torch.Tensor) -> None:
        """Append compressed pool keys ``pk_new [1, P, di]``."""
        self._put("pk", self._np, pk_new)
        self._np += pk_new.shape[1]

    def n_pools(self) -> int:
        return self._np

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (and the ``n // kp`` pools they complete)."""
        assert 0 <= n <= len(self), (n, len(self))
        self._n = n
        self._np = min(self._np, n // self.kp)

    def clone(self) -> "MLACache":
        c = MLACache(self.kp)
        for name in _MLA_DIMS:
            t = getattr(self, name)
            c._buf[name] = None if t is None else t.clone()
        c._n, c._np = self._n, self._np
        return c

    def nbytes(self) -> int:
        """Bytes of the used rows (the buffers' spare capacity not counted)."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in _MLA_DIMS) if t is not None)


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
        self.pending: dict[int, KDARows] | None = None
        self.pending_rows = 0

    def commit(self, n_rows: int) -> None:
        """Keep the first ``n_rows`` rows of the last verify pass; drop the rest."""
        if self.pending is None:
            raise ValueError("commit without a verify pass")
        if not 1 <= n_rows <= self.pending_rows:
            raise ValueError(f"commit n_rows={n_rows} outside [1, {self.pending_rows}]")
        for i, rows in self.pending.items():
            self.layers[i] = rows.after(n_rows)
        self.pos += n_rows
        for layer in self.layers:
            if isinstance(layer, MLACache):
                layer.truncate(self.pos)
        self.pending, self.pending_rows = None, 0

    def clone(self) -> "TrunkCache":
        c = TrunkCache(self.layer_types, 1, self.max_ctx)
        c.pos = self.pos
        c.layers = [None if layer is None else layer.clone() for layer in self.layers]
        return c

    def nbytes(self) -> int:
        """Bytes held by the committed state."""
        n = 0
        for layer in self.layers:
            if isinstance(layer, MLACache):
                n += layer.nbytes()
            elif isinstance(layer, KDAState):
                n += layer.tail.numel() * layer.tail.element_size() + layer.S.numel() * layer.S.element_size()
        return n
