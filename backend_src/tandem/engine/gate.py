"""The tparallel gate: compare a session's trunk cache with a fresh prime of its committed tokens.

README ("The session contract"): at every burst boundary every committed row's trunk state must equal what a plain
prime of ``committed`` would hold; the accept walk relies on it.
"""

from __future__ import annotations

import torch

from ..model.cache import KDAState, MLACache, TrunkCache
from ..model.trunk import Trunk


def cache_diff(a: TrunkCache, b: TrunkCache) -> dict[str, float]:
    """Max abs difference per state component over all layers (``kda.S``, ``kda.tail``,
    ``mla.latent``, ``mla.k``, ``mla.v``, ``mla.ik``, ``mla.ig``, ``mla.pk``).

    Raises ``AssertionError`` when positions, layer kinds or shapes differ.
    """
    assert a.pos == b.pos, (a.pos, b.pos)
    out: dict[str, float] = {}
    for la, lb in zip(a.layers, b.layers):
        assert type(la) is type(lb)
        if isinstance(la, KDAState):
            pairs = {"kda.S": (la.S, lb.S), "kda.tail": (la.tail, lb.tail)}
        elif isinstance(la, MLACache):
            pairs = {f"mla.{n}": (getattr(la, n), getattr(lb, n)) for n in ("latent", "k", "v", "ik", "ig", "pk")}
        else:
            continue
        for name, (x, y) in pairs.items():
            assert x.shape == y.shape, (name, x.shape, y.shape)
            d = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
            out[name] = max(out.get(name, 0.0), d)
    return out


@torch.no_grad()
def tparallel_gate(model: Trunk, cache: TrunkCache, committed: list[int]) -> dict[str, float]:
    """Prime ``committed`` into a fresh cache and return :func:`cache_diff` against ``cache``.

    Raises ``AssertionError`` when ``cache.pos != len(committed)`` or a verify is pending.
    """
    assert cache.pending is None, "verify pending at a burst boundary"
    assert cache.pos == len(committed), (cache.pos, len(committed))
    fresh = model.new_cache(cache.max_ctx)
    model.prime(fresh, torch.tensor([committed], dtype=torch.long))
    return cache_diff(cache, fresh)
