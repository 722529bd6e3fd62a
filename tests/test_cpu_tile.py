"""The register-tiled micro-kernels (``tandem.model.cpu_tile``): the GEMM tiles give the same bits as
the blocked kernels they replace for two or more rows (float32 and bfloat16-bit weights, odd shapes,
column ranges), and the KDA state passes keep the recurrence's results (against the torch
reference) and the identity of a prime's in-place states with a verify's kept states, for head
sizes with a pass (16, 48, 64) and without one (20)."""

import numpy as np
import pytest
import torch

from tandem.model import cpu_gemm, cpu_kernels
from tandem.model.checkpoint import cast_trunk, init_weights
from tandem.model.config import TrunkConfig
from tandem.model.trunk import Trunk


def _weights(D, O, bf16, seed):
    w = np.random.default_rng(seed).standard_normal((D, O)).astype(np.float32)
    return (w.view(np.uint32) >> 16).astype(np.uint16) if bf16 else w


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("D,O", [(1, 64), (7, 65), (37, 130), (256, 517)])
def test_tiles_equal_the_blocked_kernel(bf16, D, O):
    wt = _weights(D, O, bf16, seed=D + O)
    x = np.random.default_rng(D).standard_normal((9, D)).astype(np.float32)
    for M in range(1, 10):
        for c0, c1 in ((0, O), (O // 5, O - 3)):
            tiled, blocked = np.full((M, c1 - c0), np.nan, np.float32), np.full((M, c1 - c0), np.nan, np.float32)
            cpu_gemm._mm(x[:M], wt, c0, c1, tiled)
            cpu_gemm._mm_blocked(x[:M], wt, c0, c1, blocked, 0)
            assert np.array_equal(tiled, blocked), (M, c0, c1)
    ref = x.astype(np.float64) @ (wt.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if bf16 else x @ wt
    np.testing.assert_allclose(cpu_gemm.mm_rows(x, wt), ref, atol=1e-4 * D, rtol=1e-4)


def _kda(dk):
    cfg = TrunkConfig(vocab_size=61, hidden_size=40, intermediate_size=56, moe_intermediate_size=24,
                      num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=20,
                      qk_nope_head_dim=16, v_head_dim=16, index_head_dim=8, index_n_heads=2, index_topk=8,
                      linear_head_dim=dk, linear_num_heads=2, n_routed_experts=3, num_experts_per_tok=2,
                      hc_mult=2, num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["sparse"],
                      indexer_types=["full"], max_position_embeddings=64)
    trunk = cast_trunk(init_weights(Trunk(cfg, with_mtp=False).eval().requires_grad_(False), seed=dk), torch.float32)
    return trunk.layers[0].self_attn


@pytest.mark.parametrize("dk", [16, 48, 64, 20])
def test_kda_state_passes_match_reference_and_prime_equals_verify(dk):
    kda = _kda(dk)
    T, C = 5, 2 * dk
    g = torch.Generator().manual_seed(dk)
    x = torch.randn(1, T, 40, generator=g)
    start = (torch.randn(1, 3 * C, 3, generator=g), torch.randn(1, 2, dk, dk, generator=g) * 0.3)
    with torch.no_grad():
        y, full, states = kda.forward_rows(x, start)
        with cpu_kernels.reference():
            ry, _, rstates = kda.forward_rows(x, start)
        _, per = kda.forward_rows_many(x, [start], [T], keep_states=False)  # a prime: one state, in place
    assert states.shape == (1, T, 2, dk, dk)
    torch.testing.assert_close(states, rstates, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-4)
    tail, S = per[0]
    assert torch.equal(S[0], states[0, -1]) and torch.equal(tail, full[..., -3:])
