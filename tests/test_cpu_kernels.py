"""The numba serving kernels against their pure-torch references, with odd shapes (3 streams,
5 experts, heads of 12, pools of 4), and the preallocated MLA cache against concatenation."""

import copy

import numpy as np
import pytest
import torch

from tandem.ops import dispatch
from tandem.ops.cpu import attention as cpu_attention, kda as cpu_kda, kernels as cpu_kernels
from tandem.ops.settings import REFERENCE
from tandem.model.cache import MLACache
from tandem.model.checkpoint import cast_trunk, init_weights
from tandem.model.config import TrunkConfig
from tandem.model.layers import hc_merge
from tandem.model.trunk import Trunk


@pytest.fixture(scope="module")
def odd():
    cfg = TrunkConfig(
        vocab_size=97,
        hidden_size=40,
        intermediate_size=56,
        moe_intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=20,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_head_dim=8,
        index_n_heads=3,
        index_topk=8,
        linear_head_dim=12,
        linear_num_heads=3,
        n_routed_experts=5,
        num_experts_per_tok=2,
        hc_mult=3,
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        mlp_layer_types=["sparse", "sparse"],
        indexer_types=["full", "full"],
        max_position_embeddings=128,
    )
    return cast_trunk(init_weights(Trunk(cfg, with_mtp=False).eval().requires_grad_(False), seed=3), torch.float32)


@pytest.fixture(scope="module")
def ref(odd):
    """``odd`` (the same weights) on the pure-torch reference path."""
    return dispatch.install(copy.deepcopy(odd), REFERENCE)


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("T", [1, 3, 9])
def test_hc_weights_and_merge_match_reference(odd, ref, T):
    layer, rlayer = odd.layers[0], ref.layers[0]
    s = _randn(1, T, 3, 40, seed=T)
    with torch.no_grad():
        post, comb, x = layer.attn_hc.normed(s, layer.input_layernorm)
        rp, rc, rx = rlayer.attn_hc(s)
        rx = rlayer.input_layernorm(rx)
        ref_merge = hc_merge(rp, rc, rx, s, REFERENCE)
        assert post.shape == (1, T, 3) and comb.shape == (1, T, 3, 3) and x.shape == (1, T, 40)
        torch.testing.assert_close(post, rp, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(comb, rc, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(x, rx, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(comb.sum(-2), torch.ones(1, T, 3), atol=1e-4, rtol=0)  # doubly stochastic
        torch.testing.assert_close(hc_merge(rp, rc, rx, s), ref_merge, atol=1e-5, rtol=1e-5)
        one = layer.attn_hc.normed(s[:, -1:], layer.input_layernorm)  # a row alone == inside the block, bit for bit
        assert all(torch.equal(a, b[:, -1:]) for a, b in zip(one, (post, comb, x)))
        merged = hc_merge(rp, rc, rx, s)
        assert torch.equal(hc_merge(rp[:, -1:], rc[:, -1:], rx[:, -1:], s[:, -1:]), merged[:, -1:])


@pytest.mark.parametrize("T", [1, 2, 9])
def test_kda_rows_match_reference(odd, ref, T):
    kda = odd.layers[0].self_attn
    x = _randn(1, T, 40, seed=10 + T)
    tail, S = _randn(1, 3 * 36, 3, seed=1), _randn(1, 3, 12, 12, seed=2, scale=0.3)
    with torch.no_grad():
        y, full, states = kda.forward_rows(x, (tail, S))
        ry, rfull, rstates = ref.layers[0].self_attn.forward_rows(x, (tail, S))
    assert y.shape == (1, T, 40) and full.shape == (1, 108, 3 + T) and states.shape == (1, T, 3, 12, 12)
    torch.testing.assert_close(full, rfull, atol=1e-6, rtol=1e-5)  # one fused GEMM vs three
    torch.testing.assert_close(states, rstates, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-4)
    assert torch.equal(S, _randn(1, 3, 12, 12, seed=2, scale=0.3))  # the input state is not modified


def test_kda_rows_many_reads_a_previous_pass_in_place(odd):
    """A decode round's sequences start from views of the previous pass's buffers (``KDARows.after``):
    the kernel reads those buffers in place (no joined copy) and gives bit-identical rows, states and
    tails to starting from separate copies of the same states, whose inputs it leaves unchanged."""
    kda = odd.layers[0].self_attn
    lengths = [2, 1, 3]
    with torch.no_grad():
        first = [(_randn(1, 108, 3, seed=20 + j), _randn(1, 3, 12, 12, seed=30 + j, scale=0.3)) for j in range(3)]
        _, per = kda.forward_rows_many(_randn(1, 6, 40, seed=40), first, lengths)
        after = [p.after(n) for p, n in zip(per, (1, 1, 2))]  # each sequence keeps some of its rows
        shared = [(a.tail, a.S) for a in after]
        copies = [(t.clone(), S.clone()) for t, S in shared]
        S0, s_idx = cpu_kda._shared_states([S for _, S in shared])
        tails, t_col = cpu_kda._shared_tails([t for t, _ in shared])
        assert np.shares_memory(S0, per[0].states.numpy()) and np.shares_memory(tails, per[0].full.numpy())
        assert all(np.array_equal(S0[i], S[0].numpy()) for i, (_, S) in zip(s_idx, shared))
        assert all(np.array_equal(tails[:, c : c + 3], t[0].numpy()) for c, (t, _) in zip(t_col, shared))
        joined, idx = cpu_kda._shared_states([S for _, S in copies])
        assert not np.shares_memory(joined, per[0].states.numpy()) and idx.tolist() == [0, 1, 2]
        tl, cols, S0b, idx = cpu_kda._starts(after)  # the states themselves: the buffers, no views made
        assert (
            tl.base is not None
            and np.shares_memory(tl, per[0].full.numpy())
            and np.shares_memory(S0b, per[0].states.numpy())
        )
        assert cols.tolist() == t_col.tolist() and idx.tolist() == s_idx.tolist()
        x = _randn(1, 5, 40, seed=41)
        y1, p1 = kda.forward_rows_many(x, shared, [1, 3, 1])
        y2, p2 = kda.forward_rows_many(x, copies, [1, 3, 1])
        y3, p3 = kda.forward_rows_many(x, [p.after(n) for p, n in zip(per, (1, 1, 2))], [1, 3, 1])
    assert torch.equal(y1, y2) and torch.equal(y1, y3)
    for a, b, n in zip(p3, p2, [1, 3, 1]):
        for k in range(1, n + 1):
            assert torch.equal(a.after(k).S, b.after(k).S) and torch.equal(a.after(k).tail, b.after(k).tail)
    assert all(torch.equal(S, c[1]) and torch.equal(t, c[0]) for (t, S), c in zip(shared, copies))


@pytest.mark.parametrize("N", [1, 5, 16])
def test_moe_rows_match_reference(odd, ref, N):
    moe = odd.layers[1].mlp
    x = _randn(1, N, 40, seed=N)
    with torch.no_grad():
        y = moe(x)
        ry = ref.layers[1].mlp(x)
    assert y.shape == (1, N, 40)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("T,pos0", [(1, 3), (1, 37), (5, 30), (9, 60)])
def test_dsa_mask_equals_reference_selection(odd, T, pos0):
    idx = odd.layers[1].self_attn.indexer
    L = pos0 + T
    P = L // idx.kp
    x = _randn(1, T, 40, seed=pos0)
    q_resid = _randn(1, T, 20, seed=pos0 + 1)
    pk = _randn(1, P, 8, seed=pos0 + 2)
    q_pos = pos0 + torch.arange(T)
    with torch.no_grad():
        rows = {"q_resid": q_resid, "iq": idx.wq_b(q_resid), "iw": idx.weights_proj(x)}
        mask = idx.mask(x, rows, pk, q_pos, L)
        ref = idx.select(idx.scores(x, q_resid, pk), q_pos, L)
    assert mask.dtype == torch.bool and mask.shape == (1, T, L)
    assert torch.equal(mask, ref)
    assert int(mask[0, -1].sum()) <= idx.k_pools * idx.kp + idx.kp  # sparse: k pools + the tail


@pytest.mark.parametrize("T,pos0", [(1, 3), (1, 37), (5, 30), (9, 61)])
def test_mla_rows_match_reference(odd, ref, T, pos0):
    """The MLA / DSA rows kernel (indexer, k-pool selection, attention over the selected tokens)
    against the torch path, on a cache long enough for the selection to drop pools; a row alone
    equals the same row inside the block, bit for bit."""
    attn = odd.layers[1].self_attn
    prompt, x = _randn(1, pos0, 40, seed=pos0), _randn(1, T, 40, seed=pos0 + 1)
    outs = []
    with torch.no_grad():
        for a in (attn, ref.layers[1].self_attn):
            cache = MLACache(a.indexer.kp)
            a.prime(prompt, cache)
            outs.append(a.rows(x, cache))
            assert len(cache) == pos0 + T
        arrays, ix = cpu_attention.query_arrays(attn.project(x)), attn.indexer  # the block vs each row alone
        block, one = np.empty((T, 32), np.float32), np.empty((T, 32), np.float32)
        cpu_attention.mla_rows_into(
            arrays, 0, T, cache, pos0, ix.kp, ix.k_pools, attn.scaling, ix.d**-0.5, ix.h**-0.5, block
        )
        for i in range(T):  # row i alone sees the cache as far as its position (the kernel is causal)
            cpu_attention.mla_rows_into(
                arrays, i, 1, cache, pos0 + i, ix.kp, ix.k_pools, attn.scaling, ix.d**-0.5, ix.h**-0.5, one
            )
    assert outs[0].shape == (1, T, 40)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    assert np.array_equal(one, block)


def test_mla_cache_grows_truncates_and_clones_like_concatenation():
    c, ref = MLACache(4), {n: [] for n in ("latent", "k", "v", "ik", "ig")}
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 3, 20, 1, 40):
        rows = {
            "latent": torch.randn(1, n, 5, generator=g),
            "k": torch.randn(1, 2, n, 3, generator=g),
            "v": torch.randn(1, 2, n, 3, generator=g),
            "ik": torch.randn(1, n, 4, generator=g),
            "ig": torch.randn(1, n, 4, generator=g),
        }
        c.append(rows)
        for name, t in rows.items():
            ref[name].append(t)
    assert len(c) == 72
    for name, parts in ref.items():
        assert torch.equal(getattr(c, name), torch.cat(parts, 2 if name in ("k", "v") else 1))
    c.add_pools(torch.ones(1, 18, 4))
    c.truncate(30)
    assert len(c) == 30 and c.n_pools() == 7 and c.k.shape == (1, 2, 30, 3)
    d = c.clone()
    c.append(
        {
            n: torch.zeros_like(getattr(d, n)[..., :1, :]) if n not in ("k", "v") else torch.zeros(1, 2, 1, 3)
            for n in ("latent", "k", "v", "ik", "ig")
        }
    )
    assert len(d) == 30 and torch.equal(d.latent, torch.cat(ref["latent"], 1)[:, :30])  # the clone is independent
    assert torch.equal(c.latent[:, 30], torch.zeros(1, 5)) and c.nbytes() > d.nbytes()


@pytest.mark.parametrize("R,V", [(1, 2), (3, 97), (9, 8192)])
def test_top2_matches_topk(R, V):
    """Greedy targets and top-2 gaps in one pass against ``topk(2)``; at a tie the first maximum and gap 0."""
    x = _randn(R, V, seed=R + V)
    idx, gap = cpu_kernels.top2(x)
    top = x.topk(2, dim=-1)
    assert torch.equal(idx, top.indices[:, 0]) and torch.equal(gap, top.values[:, 0] - top.values[:, 1])
    x[:, V - 1] = x[:, 0] = x.max() + 1  # a tie for the maximum, at both ends of each row
    idx, gap = cpu_kernels.top2(x)
    assert idx.tolist() == [0] * R and gap.tolist() == [0.0] * R


@pytest.mark.parametrize("n", [3, 4, 13, 40])
def test_pool_keys_match_reference(odd, ref, n):
    """The DSA pool compression kernel against the torch softmax-weighted sum (complete pools only)."""
    ix = odd.layers[1].self_attn.indexer
    keys, gates = _randn(1, n, 8, seed=n), _randn(1, n, 8, seed=n + 1, scale=3.0)
    with torch.no_grad():
        got = ix.pool_keys(keys, gates)
        want = ref.layers[1].self_attn.indexer.pool_keys(keys, gates)
    assert got.shape == want.shape == (1, n // ix.kp, 8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_mla_many_equals_one_sequence_at_a_time_and_appends_like_torch(odd):
    """Several sequences' MLA rows in one :func:`cpu_attention.mla_many` call (rows appended in place
    by the kernel, across buffer doublings, pools completed, a buffer replaced as a prefix restore
    does) give each sequence's outputs bit for bit as a call of its own, and caches equal to the
    torch append's."""
    attn, ix = odd.layers[1].self_attn, odd.layers[1].self_attn.indexer

    def call(rows, caches, lengths):
        return cpu_attention.mla_many(
            rows, caches, lengths, ix.index_kpool_compress_ape, ix.kp, ix.k_pools, attn.scaling, ix.d**-0.5, ix.h**-0.5
        )

    with torch.no_grad():
        prompts = [_randn(1, n, 40, seed=60 + n) for n in (3, 14, 30)]
        together, alone, ref = ([MLACache(ix.kp) for _ in prompts] for _ in range(3))
        for cs in (together, alone, ref):
            for c, p in zip(cs, prompts):
                attn.prime(p, c)
        for step, lengths in enumerate([(1, 1, 1), (5, 2, 9), (1, 16, 1), (13, 3, 2), (1, 1, 1)]):
            x = _randn(1, sum(lengths), 40, seed=70 + step)
            rows = attn.project(x)
            got = call(rows, together, list(lengths))
            off = 0
            for j, n in enumerate(lengths):
                part = {
                    k: (v[:, :, off : off + n] if k in ("q", "k", "v") else v[:, off : off + n]).contiguous()
                    for k, v in rows.items()
                }
                one = call(part, [alone[j]], [n])
                assert np.array_equal(got[off : off + n], one), (step, j)
                ref[j].append(rows, off, n)
                ref[j].add_pools(
                    ix.pool_keys(ref[j].ik[:, ref[j].n_pools() * ix.kp :], ref[j].ig[:, ref[j].n_pools() * ix.kp :])
                )
                off += n
            if step == 1:  # a prefix restore assigns a buffer: the kernel must write to the new one
                together[0].k, alone[0].k = together[0].k.clone(), alone[0].k.clone()
            for a, b in zip(together, ref):
                assert len(a) == len(b) and a.n_pools() == b.n_pools() == len(b) // ix.kp
                for name in ("latent", "k", "v", "ik", "ig", "pk"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)


@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (3, 2, 33)])
def test_norms_and_swiglu_match_torch_row_by_row(shape):
    """RMSNorm, LayerNorm and the clamped SwiGLU kernels against torch (odd widths, column-slice inputs),
    and each row bit-identical computed alone."""
    from tandem.model.layers import clamped_swiglu

    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape[:-1], shape[-1] + 3, generator=g)[..., 3:] * 4  # a strided view, as a split gives
    w, b = torch.randn(shape[-1], generator=g), torch.randn(shape[-1], generator=g)
    u = torch.randn(*shape, generator=g) * 12
    got = {
        "rms": cpu_kernels.rms_norm(x, w, 1e-5),
        "ln": cpu_kernels.layer_norm(x, w, b, 1e-6),
        "swiglu": cpu_kernels.swiglu(x * 3, u, 10.0),
    }
    ref = {
        "rms": torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-5),
        "ln": torch.nn.functional.layer_norm(x, (shape[-1],), w, b, 1e-6),
        "swiglu": clamped_swiglu(x * 3, u, 10.0),
    }
    for k in got:
        assert got[k].shape == x.shape and got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=1e-5)
    rows, urows = x.reshape(-1, shape[-1]), u.reshape(-1, shape[-1])
    for i in range(rows.shape[0]):
        assert torch.equal(cpu_kernels.rms_norm(rows[i : i + 1], w, 1e-5)[0], got["rms"].reshape(-1, shape[-1])[i])
        assert torch.equal(cpu_kernels.layer_norm(rows[i : i + 1], w, b, 1e-6)[0], got["ln"].reshape(-1, shape[-1])[i])
        assert torch.equal(
            cpu_kernels.swiglu(rows[i : i + 1] * 3, urows[i : i + 1], 10.0)[0], got["swiglu"].reshape(-1, shape[-1])[i]
        )
