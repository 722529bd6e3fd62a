"""KDA: chunked form vs row-by-row recurrence vs transformers' reference recurrence."""

import pytest
import torch

from tandem.model.kda import kda_chunked, kda_recurrent, l2norm


def _inputs(B, T, H, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(B, T, H, dk, generator=g))
    v = torch.randn(B, T, H, dv, generator=g)
    gate = -5.0 * torch.rand(B, T, H, dk, generator=g)  # log decay in (-5, 0): the safe-gate range
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, dk, dv, generator=g) * 0.1
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize(
    "B,T,H,dk,dv,chunk", [(1, 1, 1, 8, 8, 16), (2, 37, 3, 16, 24, 16), (1, 64, 2, 32, 32, 8), (3, 17, 1, 8, 5, 4)]
)
def test_chunked_matches_recurrent(B, T, H, dk, dv, chunk):
    q, k, v, g, beta, s0 = _inputs(B, T, H, dk, dv, seed=T)
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2 = kda_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert (o1 - o2).abs().max() < 1e-5
    assert (s1 - s2).abs().max() < 1e-5


def test_recurrent_keeps_every_row_state():
    q, k, v, g, beta, s0 = _inputs(1, 9, 2, 8, 8, seed=3)
    _, states = kda_recurrent(q, k, v, g, beta, s0, keep_states=True)
    for t in (0, 4, 8):
        _, st = kda_recurrent(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], s0)
        assert torch.equal(states[:, t], st)


def test_matches_transformers_reference():
    from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

    q, k, v, g, beta, s0 = _inputs(2, 23, 2, 16, 16, seed=7)
    raw_q = torch.randn_like(q)
    raw_k = torch.randn_like(k)
    ref_o, ref_s = recurrent_kimi_delta_attention(
        raw_q, raw_k, v, g, beta, s0.clone(), True, use_qk_l2norm_in_kernel=True
    )
    o, s = kda_chunked(l2norm(raw_q) * 16**-0.5, l2norm(raw_k), v, g, beta, s0, chunk=16)
    assert (o - ref_o).abs().max() < 1e-5
    assert (s - ref_s).abs().max() < 1e-5


@pytest.mark.parametrize("B,T,H,dk,dv", [(1, 1, 1, 8, 8), (1, 8, 4, 64, 64), (2, 5, 3, 16, 24), (1, 16, 2, 7, 5)])
def test_rows_closed_form_matches_recurrent_states(B, T, H, dk, dv):
    from tandem.model.kda import kda_rows

    q, k, v, g, beta, s0 = _inputs(B, T, H, dk, dv, seed=11 + T)
    o1, st1 = kda_recurrent(q, k, v, g, beta, s0, keep_states=True)
    o2, st2 = kda_rows(q, k, v, g, beta, s0)
    assert st2.shape == (B, T, H, dk, dv)
    assert (o1 - o2).abs().max() < 1e-5
    assert (st1 - st2).abs().max() < 1e-5
