"""kernels/kda_verify.py (Triton, interpreter on CPU) against the torch KDA references in tandem.model.kda."""

import pytest
import torch

pytest.importorskip("triton")

from tandem.model.kda import kda_recurrent, kda_rows  # noqa: E402
from tandem.ops import dispatch  # noqa: E402
from tandem.tools.kernel_cases import CASES  # noqa: E402
from tandem.ops.triton import kda_verify  # noqa: E402

DEV = "cpu" if dispatch.interpreted() else "cuda"


def _packed(lengths, H, dk, dv, seed):
    """Ragged verify rows packed ``[R, H, d]`` (the bench's input ranges: q scaled + normalised,
    k normalised, g in (-5, 0)) and unit-scale random initial states ``[B, H, dk, dv]``."""
    rows = kda_verify._case(1, sum(lengths), H, dk, dv, DEV, seed)[:5]
    s0 = torch.randn(len(lengths), H, dk, dv, generator=torch.Generator().manual_seed(seed + 100))
    return (*(x[0] for x in rows), s0.to(DEV))


def _check_ragged(lengths, H, dk, dv, seed, block_v=None):
    q, k, v, g, beta, s0 = _packed(lengths, H, dk, dv, seed)
    o, st = kda_verify.kda_rows_ragged(q, k, v, g, beta, s0, lengths, block_v=block_v)
    assert o.shape == (sum(lengths), H, dv) and st.shape == (sum(lengths), H, dk, dv)
    a = 0
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        one = [x[a : a + n].unsqueeze(0) for x in (q, k, v, g, beta)]
        ro, rst = kda_recurrent(*one, s0[b : b + 1], keep_states=True)
        torch.testing.assert_close(o[a : a + n], ro[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(st[a : a + n], rst[0], atol=1e-5, rtol=1e-4)
        a += n


def test_ragged_rows_match_recurrent_states():
    """Ragged (1, 5, 8) rows, 3 heads, non-power-of-two dk=12 / dv=20, random state."""
    _check_ragged((1, 5, 8), H=3, dk=12, dv=20, seed=0)


def test_ragged_dv_blocks_and_empty_sequence():
    """dv split into 8-wide blocks (the last one partial: 20 = 8 + 8 + 4); a sequence with no rows."""
    _check_ragged((3, 0, 6), H=1, dk=7, dv=20, seed=1, block_v=8)


def test_state_decays_and_rolls_back():
    """The per-row states are the ones rollback needs: restarting from row r's state on rows r+1..
    reproduces the rest, and strong decay with beta = 0 shrinks the state by exp(sum g)."""
    q, k, v, g, beta, s0 = _packed((6,), 2, 12, 20, seed=2)
    o, st = kda_verify.kda_rows_ragged(q, k, v, g, beta, s0, [6])
    o2, st2 = kda_verify.kda_rows_ragged(q[3:], k[3:], v[3:], g[3:], beta[3:], st[2:3], [3])
    torch.testing.assert_close(o2, o[3:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(st2, st[3:], atol=1e-5, rtol=1e-4)
    _, st0 = kda_verify.kda_rows_ragged(q, k, v, g, torch.zeros_like(beta), s0, [6])
    expect = s0[0] * g.cumsum(0).exp()[-1].unsqueeze(-1)
    torch.testing.assert_close(st0[-1], expect, atol=1e-6, rtol=1e-4)
    assert st0[-1].abs().max() < s0.abs().max()


def test_equal_rows_launcher_matches_kda_rows():
    """The engine hook's launcher has kda_rows' signature and results (B=2, T=5, H=3, dk=12, dv=20)."""
    B, T, H, dk, dv = 2, 5, 3, 12, 20
    q, k, v, g, beta, s0 = _packed((T,) * B, H, dk, dv, seed=3)
    args = [x.view(B, T, *x.shape[1:]) for x in (q, k, v, g, beta)] + [s0]
    ro, rst = kda_rows(*args)
    o, st = kda_verify.kda_rows(*args)
    assert o.shape == ro.shape == (B, T, H, dv) and st.shape == rst.shape == (B, T, H, dk, dv)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(st, rst, atol=1e-5, rtol=1e-4)


def test_bad_inputs_raise():
    q, k, v, g, beta, s0 = _packed((2, 1), 1, 4, 4, seed=4)
    with pytest.raises(ValueError, match="sum"):
        kda_verify.kda_rows_ragged(q, k, v, g, beta, s0, [2, 2])
    with pytest.raises(ValueError, match="float32"):
        kda_verify.kda_rows_ragged(q.double(), k, v, g, beta, s0, [2, 1])
    with pytest.raises(ValueError, match="state"):
        kda_verify.kda_rows_ragged(q, k, v, g, beta, s0[:, :, :3], [2, 1])


def test_bench_cases_run():
    for label, ref, tri in CASES["kda_verify"](DEV):
        (ro, rst), (o, st) = ref(), tri()
        torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-4, msg=label)
        torch.testing.assert_close(st, rst, atol=1e-5, rtol=1e-4, msg=label)
