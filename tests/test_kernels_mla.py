"""The DSA indexer and DSA-selected MLA attention Triton kernels against their torch references
(:func:`tandem.model.mla.pool_scores` / :func:`~tandem.model.mla.select_pools` /
:func:`~tandem.model.mla.masked_attention`), on CPU in Triton's interpreter: ragged rows (1, 4, 7
per sequence) at positions that cross k-pool boundaries, non-power-of-two heads and head dims
(H=3, Hi=5, dqk=24, dv=20, di=12), sequences with fewer candidate pools than ``k_pools``, tied pool
scores (duplicate and zero pool keys), caches read in place from over-allocated buffers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.model.mla import masked_attention, pool_scores, select_pools  # noqa: E402
from tandem.ops import dispatch  # noqa: E402
from tandem.tools.kernel_cases import CASES as KERNEL_CASES  # noqa: E402
from tandem.ops.triton import dsa_indexer, mla_attention  # noqa: E402

DEV = "cpu" if dispatch.interpreted() else "cuda"
H, HI, DQK, DV, DI = 3, 5, 24, 20, 12


def _seq(pos0: int, t: int, kp: int, seed: int, pools: str = "random") -> dict[str, torch.Tensor]:
    """One sequence's rows at ``pos0 .. pos0 + t - 1`` over a cache of ``pos0 + t`` tokens; the K / V
    caches are views of buffers with spare capacity (as :class:`~tandem.model.cache.MLACache` keeps)."""
    g = torch.Generator().manual_seed(seed)
    L = pos0 + t
    P = L // kp
    pk = torch.randn(P, DI, generator=g)
    iw = torch.randn(t, HI, generator=g)
    if pools == "ties":  # three distinct keys repeated: many equal scores, also at the k-th place
        pk = pk[:3][torch.arange(P) % 3]
    elif pools == "zeros":  # most keys zero: exact zero scores (and -0.0 ones, iw < 0) tie at the k-th place
        pk[torch.arange(P) % 4 != 1] = 0.0
        iw = -iw.abs()
    cap = L + 5
    return {
        "pos0": pos0,
        "t": t,
        "L": L,
        "pk": pk,
        "iw": iw,
        "iq": torch.randn(t, HI, DI, generator=g),
        "q": torch.randn(t, H, DQK, generator=g),
        "k": torch.randn(H, cap, DQK, generator=g)[:, :L],
        "v": torch.randn(H, cap, DV, generator=g)[:, :L],
    }


def _ragged(seqs: list[dict]) -> dict:
    cat = lambda n: torch.cat([s[n] for s in seqs]).to(DEV)  # noqa: E731
    return {
        "iq": cat("iq"),
        "iw": cat("iw"),
        "q": cat("q"),
        "lengths": [s["t"] for s in seqs],
        "pos": torch.cat([torch.arange(s["pos0"], s["L"]) for s in seqs]).to(DEV),
        "pks": [s["pk"].to(DEV) for s in seqs],
        "ks": [s["k"].to(DEV) for s in seqs],
        "vs": [s["v"].to(DEV) for s in seqs],
        "kv_lens": [s["L"] for s in seqs],
    }


def _ref_mask(s: dict, kp: int, k_pools: int) -> torch.Tensor:
    """Reference visibility ``[t, L]`` of one sequence's rows."""
    q_pos = torch.arange(s["pos0"], s["L"])
    return select_pools(pool_scores(s["iq"][None], s["iw"][None], s["pk"][None]), q_pos, s["L"], kp, k_pools)[0]


def _ref_pools(mask: torch.Tensor, q_pos: torch.Tensor, n_pools: int, kp: int, k_pools: int) -> torch.Tensor:
    """Selected pool ids ``[t, k_pools]`` (ascending, -1 padded) read off a reference mask."""
    out = torch.full((mask.shape[0], k_pools), -1, dtype=torch.int64)
    for i, p in enumerate(q_pos.tolist()):
        sel = [j for j in range(min((p + 1) // kp, n_pools)) if mask[i, j * kp]]
        out[i, : len(sel)] = torch.tensor(sel, dtype=torch.int64)
    return out


# (pos0, T, pools) per sequence: kp = 4 rows at 3 = kp - 1 and 4 = kp, a row with no complete pool
# (pos 2), sequences with fewer candidates than k_pools; kp = 16 rows at 15 and 16
CASES = {
    "kp4": (4, 2, [(3, 1, "random"), (2, 4, "random"), (30, 7, "random"), (19, 4, "ties"), (33, 4, "zeros")]),
    "kp16": (16, 3, [(14, 4, "random"), (47, 1, "random"), (60, 7, "ties")]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_indexer_selection_equals_reference(name):
    kp, k_pools, spec = CASES[name]
    seqs = [_seq(p, t, kp, seed=i, pools=kind) for i, (p, t, kind) in enumerate(spec)]
    rg = _ragged(seqs)
    pools, mask = dsa_indexer.select_rows(
        rg["iq"], rg["iw"], rg["pks"], rg["lengths"], rg["pos"], rg["kv_lens"], kp, k_pools
    )
    assert pools.dtype == torch.int64 and pools.shape == (len(rg["pos"]), k_pools)
    assert mask.dtype == torch.bool and mask.shape == (len(rg["pos"]), max(rg["kv_lens"]))
    off, n_short, n_tied = 0, 0, 0
    for s in seqs:
        ref = _ref_mask(s, kp, k_pools)
        q_pos = torch.arange(s["pos0"], s["L"])
        got = mask[off : off + s["t"]].cpu()
        assert torch.equal(got[:, : s["L"]], ref), (name, s["pos0"], s["t"])
        assert not got[:, s["L"] :].any()
        ref_pools = _ref_pools(ref, q_pos, s["pk"].shape[0], kp, k_pools)
        assert torch.equal(pools[off : off + s["t"]].cpu(), ref_pools)
        n_short += int((ref_pools == -1).any(1).sum())
        sc = pool_scores(s["iq"][None], s["iw"][None], s["pk"][None])[0]
        for i, p in enumerate(q_pos.tolist()):  # a tie at the k-th place: the earlier pool wins
            n_c = (p + 1) // kp
            if n_c > k_pools:
                kth = sc[i, :n_c].sort(descending=True).values[k_pools - 1]
                n_tied += int((sc[i, :n_c] == kth).sum() > 1)
        off += s["t"]
    assert n_short > 0 and n_tied > 0  # the cases do exercise the padding and the tie rule


def test_indexer_mask_matches_reference_batched():
    """:func:`dsa_indexer.mask` has the reference's arguments and result (the engine's hook)."""
    g = torch.Generator().manual_seed(7)
    B, T, kp, L = 2, 4, 4, 23
    iq, iw = torch.randn(B, T, HI, DI, generator=g), torch.randn(B, T, HI, generator=g)
    pk = torch.randn(B, L // kp, DI, generator=g)
    q_pos = torch.arange(L - T - 2, L - 2)  # positions 17..20 (pool 4 completes at 19), kv_len beyond them
    ref = select_pools(pool_scores(iq, iw, pk), q_pos, L, kp, 2)
    got = dsa_indexer.mask(iq.to(DEV), iw.to(DEV), pk.to(DEV), q_pos.to(DEV), L, kp, 2)
    assert torch.equal(got.cpu(), ref)
    assert int(ref[0, 0].sum()) < int(ref[0, 0, : q_pos[0] + 1].numel())  # sparse: pools were dropped


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_equals_reference(name):
    kp, k_pools, spec = CASES[name]
    seqs = [_seq(p, t, kp, seed=10 + i, pools=kind) for i, (p, t, kind) in enumerate(spec)]
    rg = _ragged(seqs)
    masks = [_ref_mask(s, kp, k_pools) for s in seqs]
    full = torch.zeros(len(rg["pos"]), max(rg["kv_lens"]), dtype=torch.bool)
    off = 0
    for s, m in zip(seqs, masks):
        full[off : off + s["t"], : s["L"]] = m
        off += s["t"]
    o = mla_attention.attend_rows(rg["q"], rg["ks"], rg["vs"], full.to(DEV), rg["lengths"], DQK**-0.5)
    assert o.shape == (len(rg["pos"]), H, DV) and o.dtype == torch.float32
    off = 0
    for s, m in zip(seqs, masks):
        ref = masked_attention(s["q"].transpose(0, 1)[None], s["k"][None], s["v"][None], m[None], DQK**-0.5)[0]
        torch.testing.assert_close(o[off : off + s["t"]].cpu(), ref.transpose(0, 1), atol=1e-5, rtol=1e-4)
        off += s["t"]


def test_kernels_pipeline_dense_is_causal_attention():
    """index_topk >= L: the kernels' selection is the causal mask and the attention plain causal
    attention, also for a 20-row block (two row tiles) from position 0."""
    kp, seqs = 4, [_seq(0, 20, 4, seed=21), _seq(9, 7, 4, seed=22)]
    rg = _ragged(seqs)
    _, mask = dsa_indexer.select_rows(rg["iq"], rg["iw"], rg["pks"], rg["lengths"], rg["pos"], rg["kv_lens"], kp, 8)
    o = mla_attention.attend_rows(rg["q"], rg["ks"], rg["vs"], mask, rg["lengths"], DQK**-0.5)
    off = 0
    for s in seqs:
        q_pos = torch.arange(s["pos0"], s["L"])
        causal = torch.arange(s["L"])[None, :] <= q_pos[:, None]
        assert torch.equal(mask[off : off + s["t"], : s["L"]].cpu(), causal)
        att = torch.einsum("thd,hld->htl", s["q"], s["k"]) * DQK**-0.5
        ref = att.masked_fill(~causal, float("-inf")).softmax(-1) @ s["v"]  # [H, t, dv]
        torch.testing.assert_close(o[off : off + s["t"]].cpu(), ref.transpose(0, 1), atol=1e-5, rtol=1e-4)
        off += s["t"]


def test_mla_layer_rows_under_forced_kernels():
    """An MLA layer's ragged verify rows (two sequences, one cache with no complete pool yet) under
    the ``triton`` backend equal the torch reference path."""
    import copy

    from conftest import make_tiny_trunk
    from tandem.model.cache import MLACache
    from tandem.ops.settings import REFERENCE, KernelSettings

    trunk = make_tiny_trunk()
    attn = next(layer.self_attn for layer in trunk.layers if layer.layer_type != "linear_attention")
    kp = attn.indexer.kp
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randn(1, n, trunk.cfg.hidden_size, generator=g) for n in (2, 6 * kp + 1)]
    x = torch.randn(1, 7, trunk.cfg.hidden_size, generator=g)
    outs = []
    with torch.no_grad():
        for settings in (REFERENCE, KernelSettings(backend="triton", numba=False)):
            layer = dispatch.install(copy.deepcopy(attn), settings)
            caches = [MLACache(kp) for _ in prompts]
            for c, pr in zip(caches, prompts):
                layer.prime(pr, c)
            outs.append(layer.rows_many(x, caches, [3, 4]))
            assert [len(c) for c in caches] == [5, 6 * kp + 5]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)


def test_bad_shapes_raise():
    s = _seq(5, 2, 4, seed=0)
    rg = _ragged([s])
    with pytest.raises(ValueError, match="disagree"):  # rows of lengths vs iq
        dsa_indexer.select_rows(rg["iq"], rg["iw"], rg["pks"], [3], rg["pos"], rg["kv_lens"], 4, 2)
    with pytest.raises(ValueError, match="disagree"):  # two pool-key tensors for one sequence
        dsa_indexer.select_rows(rg["iq"], rg["iw"], rg["pks"] * 2, [2], rg["pos"], rg["kv_lens"], 4, 2)
    with pytest.raises(ValueError, match="more pools"):  # pools past the cache's end
        dsa_indexer.select_rows(rg["iq"], rg["iw"], rg["pks"], [2], rg["pos"], [3], 4, 2)
    with pytest.raises(ValueError, match="contiguous"):
        mla_attention.attend_rows(
            rg["q"],
            [s["k"].transpose(1, 2).to(DEV)],
            rg["vs"],
            torch.ones(2, s["L"], dtype=torch.bool, device=DEV),
            [2],
            1.0,
        )


@pytest.mark.parametrize("mod", [dsa_indexer, mla_attention])
def test_bench_cases_agree(mod):
    """The bench cases (fp32, and bf16 for the attention) give the reference's result."""
    for label, ref, fast in KERNEL_CASES[mod.__name__.rsplit(".", 1)[1]](DEV):
        a, b = ref(), fast()
        assert label and a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        elif a.dtype == torch.bfloat16:
            torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)
        else:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
