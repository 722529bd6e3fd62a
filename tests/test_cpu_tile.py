"""The register-tiled micro-kernels (``tandem.ops.cpu.tile``): the GEMM tiles give the same bits as
the blocked kernels they replace for two or more rows (float32 and bfloat16-bit weights, odd shapes,
column ranges), and the KDA state passes keep the recurrence's results (against the torch
reference) and the identity of a prime's in-place states with a verify's kept states, for head
sizes with a pass (16, 48, 64) and without one (20). The bfloat16 dot-product tiles (the default for
bfloat16 weights) give the float32 chain over bfloat16-rounded inputs bit for bit, on the hardware
(``vdpbf16ps``) and emulated. The mHC mixing logits in registers (``hc_mix8``) and the MLA kernels' contracted dot product
(``cpu_attention.dot_fma``) give the loops' bits."""

import copy

import numpy as np
import pytest
import torch
from numba import njit

from tandem.ops import dispatch
from tandem.ops.cpu import attention as cpu_attention, gemm as cpu_gemm, kernels as cpu_kernels
from tandem.ops.cpu import pairs as cpu_pairs, tile as cpu_tile
from tandem.ops.settings import DEFAULT, REFERENCE, KernelSettings
from tandem.model.checkpoint import cast_trunk, init_weights
from tandem.model.config import TrunkConfig
from tandem.model.trunk import Trunk


def _weights(D, n_out, bf16, seed):
    w = np.random.default_rng(seed).standard_normal((D, n_out)).astype(np.float32)
    return (w.view(np.uint32) >> 16).astype(np.uint16) if bf16 else w


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("D,n_out", [(1, 64), (7, 65), (37, 130), (256, 517)])
def test_tiles_equal_the_blocked_kernel(bf16, D, n_out):
    wt = _weights(D, n_out, bf16, seed=D + n_out)
    x = np.random.default_rng(D).standard_normal((9, D)).astype(np.float32)
    for M in range(1, 10):
        for c0, c1 in ((0, n_out), (n_out // 5, n_out - 3)):
            tiled, blocked = np.full((M, c1 - c0), np.nan, np.float32), np.full((M, c1 - c0), np.nan, np.float32)
            cpu_gemm._mm(x[:M], wt, c0, c1, tiled)
            cpu_gemm._mm_blocked(x[:M], wt, c0, c1, blocked, 0)
            assert np.array_equal(tiled, blocked), (M, c0, c1)
    ref = x.astype(np.float64) @ (wt.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if bf16 else x @ wt
    np.testing.assert_allclose(cpu_gemm.mm_rows(x, wt), ref, atol=1e-4 * D, rtol=1e-4)


def _kda(dk):
    cfg = TrunkConfig(
        vocab_size=61,
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
        index_n_heads=2,
        index_topk=8,
        linear_head_dim=dk,
        linear_num_heads=2,
        n_routed_experts=3,
        num_experts_per_tok=2,
        hc_mult=2,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["sparse"],
        indexer_types=["full"],
        max_position_embeddings=64,
    )
    trunk = cast_trunk(init_weights(Trunk(cfg, with_mtp=False).eval().requires_grad_(False), seed=dk), torch.float32)
    return trunk.layers[0].self_attn, dispatch.install(copy.deepcopy(trunk), REFERENCE).layers[0].self_attn


@pytest.mark.parametrize("dk", [16, 48, 64, 20])
def test_kda_state_passes_match_reference_and_prime_equals_verify(dk):
    kda, ref = _kda(dk)  # the same weights, the kernels and the torch reference
    T, C = 5, 2 * dk
    g = torch.Generator().manual_seed(dk)
    x = torch.randn(1, T, 40, generator=g)
    start = (torch.randn(1, 3 * C, 3, generator=g), torch.randn(1, 2, dk, dk, generator=g) * 0.3)
    with torch.no_grad():
        y, full, states = kda.forward_rows(x, start)
        ry, _, rstates = ref.forward_rows(x, start)
        _, per = kda.forward_rows_many(x, [start], [T], keep_states=False)  # a prime: one state, in place
    assert states.shape == (1, T, 2, dk, dk)
    torch.testing.assert_close(states, rstates, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-4)
    tail, S = per[0]
    assert torch.equal(S[0], states[0, -1]) and torch.equal(tail, full[..., -3:])


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even) as float32: torch's conversion."""
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _pair_chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The reference of the pair GEMM: ``acc = acc + x[2k+1] w[2k+1]; acc = acc + x[2k] w[2k]`` in
    float32 over bfloat16-rounded ``x`` (a bfloat16 product is exact, so each step rounds once)."""
    xb = _bf16(x)
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for k in range(0, x.shape[1], 2):
        acc = acc + xb[:, k + 1 : k + 2] * w[k + 1]
        acc = acc + xb[:, k : k + 1] * w[k]
    return acc


@njit
def _emulated(xp, w, out):
    # out [M, 64] by the emulated tiles: rows in fours, then the last three, two or one
    M = xp.shape[0]
    r = 0
    while r + 4 <= M:
        cpu_tile.epair4(xp, w, r, out, 0)
        r += 4
    if M - r == 3:
        cpu_tile.epair3(xp, w, r, out, 0)
    elif M - r == 2:
        cpu_tile.epair2(xp, w, r, out, 0)
    elif M - r == 1:
        cpu_tile.epair1(xp, w, r, out, 0)


#: the AVX512-BF16 tiles (on a CPU with AMX the bfloat16 pairs take AMX's, tests/test_cpu_amx.py)
NO_AMX = KernelSettings(amx=False)


@pytest.mark.parametrize("D,n_out", [(2, 64), (38, 130), (256, 517), (40, 5)])
def test_pair_gemm_is_the_bf16_chain_for_any_rows(D, n_out):
    """bfloat16 weights by default take the pair layout; mm_rows on it (AMX off) equals the float32 chain
    over bfloat16-rounded inputs bit for bit, for 1-9 rows and strip-aligned column ranges (each row
    equal alone and in the batch), and the emulated tiles equal the hardware's (where it has vdpbf16ps)."""
    g = np.random.default_rng(D * n_out)
    w = torch.from_numpy(g.standard_normal((n_out, D)).astype(np.float32)).to(torch.bfloat16).float()  # input-major
    wf = w.t().contiguous().numpy()
    x = g.standard_normal((9, D)).astype(np.float32)
    pw = cpu_gemm.kernel_weight(w, NO_AMX)
    assert pw[0].dtype == np.uint32 and pw[0].shape == (n_out // 64, D // 2, 64) and pw[1].shape == (D, n_out % 64)
    ref = _pair_chain(x, wf)
    full = cpu_gemm.mm_rows(x, pw)
    assert np.array_equal(full, ref)
    for M in range(1, 10):
        assert np.array_equal(cpu_gemm.mm_rows(x[:M], pw), ref[:M]), M
        assert np.array_equal(cpu_gemm.mm_rows(x[M - 1 : M], pw)[0], ref[M - 1]), M
    if n_out > 64:
        assert np.array_equal(cpu_gemm.mm_rows(x, pw, 64, n_out), ref[:, 64:])
    np.testing.assert_allclose(full, x @ wf, atol=2e-2 * np.sqrt(D), rtol=1e-2)  # bfloat16 inputs: ~3 digits
    if n_out >= 64:
        xp = cpu_pairs.bf16_pairs(x)
        for M in range(1, 10):
            emu, hw = np.full((M, 64), np.nan, np.float32), np.full((M, 64), np.nan, np.float32)
            _emulated(xp[:M], pw[0][0], emu)
            cpu_gemm._pair_tiles(xp[:M], pw[0][0], hw, 0)
            assert np.array_equal(emu, ref[:M, :64]) and np.array_equal(hw, emu), (M, cpu_tile.HW_BF16)


def test_bf16_pairs_round_to_nearest_even_and_keep_nan():
    """The GEMM input rounding equals torch's float32 -> bfloat16 conversion (ties to even, overflow to
    infinity), NaN stays NaN; an odd input dimension keeps the float32-input strips."""
    v = np.array(
        [1.0, 1.00390625, 1.01171875, -1.00390625, 3.3e38, np.inf, -np.inf, 1e-40, 0.1, -0.0, 7.0, 2.5e-3], np.float32
    )
    x = np.concatenate([v, np.random.default_rng(1).standard_normal(20).astype(np.float32) * 100])[None]
    got = cpu_pairs.bf16_pairs(x).view(np.uint16)
    assert np.array_equal(got, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    nan = cpu_pairs.bf16_pairs(np.array([[np.nan, -np.nan]], np.float32)).view(np.uint16)
    assert np.isnan((nan.astype(np.uint32) << 16).view(np.float32)).all()
    odd = torch.from_numpy(np.ones((8, 7), np.float32))
    assert cpu_gemm.kernel_weight(odd, DEFAULT)[0].dtype == np.uint16
    assert cpu_gemm.kernel_weight(torch.ones(8, 6), KernelSettings(gemm_inputs="fp32"))[0].dtype == np.uint16


@pytest.mark.parametrize("D", [4, 37, 256])
def test_hc_mixing_in_registers_equals_the_loop(D):
    # hc_mult 2: eight mixing outputs take hc_mix8 when fn_t is C-contiguous; the same weights in a
    # Fortran-ordered copy take the loop: post, comb and the normed block input must agree bit for bit
    n, rng = 2, np.random.default_rng(D)
    fn_t = rng.standard_normal((n * D, (2 + n) * n)).astype(np.float32)
    base, scale = rng.standard_normal((2 + n) * n).astype(np.float32), np.float32([0.7, 1.3, 0.9])
    nw = rng.standard_normal(D).astype(np.float32)
    got = {}
    for name, w in (("registers", fn_t), ("loop", np.asfortranarray(fn_t))):
        for M in (1, 3, 5):
            s = rng.standard_normal((M, n * D)).astype(np.float32) if name == "registers" else got[("s", M)]
            got[("s", M)] = s
            out = (np.empty((M, n), np.float32), np.empty((M, n, n), np.float32), np.empty((M, D), np.float32))
            cpu_kernels._hc_weights(
                s, w, base, scale, n, 20, np.float32(1e-6), np.float32(1e-6), nw, np.float32(1e-5), *out
            )
            got[(name, M)] = out
    for M in (1, 3, 5):
        for a, b in zip(got[("registers", M)], got[("loop", M)]):
            assert np.array_equal(a, b) and np.isfinite(a).all(), M


@njit(fastmath={"contract"})
def _dots(a, b):
    return cpu_kernels._dot(a, b), cpu_attention._dotc(a, b), cpu_attention._dotc(a[::1], b[::-1][::-1])


def test_contracted_dot_in_a_register_equals_the_loop():
    # _dotc takes dot_fma for contiguous vectors (the third call passes a strided view: the loop), against
    # _dot in the same fastmath "contract" kernel; lengths around the steps of 8, magnitudes over 6 decades
    rng = np.random.default_rng(3)
    for n in [*range(0, 20), 31, 32, 33, 64, 65, 200, 515]:
        for _ in range(20):
            a = (rng.standard_normal(n) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
            b = rng.standard_normal(n).astype(np.float32)
            ref, fast, loop = _dots(a, b)
            assert ref == fast == loop, (n, ref, fast, loop)
    assert _dots(np.ones(9, np.float32), np.full(9, 2.0, np.float32))[1] == 18.0
