"""The row-invariant GEMM (``tandem.ops.cpu.gemm``) against ``x @ w.T`` with odd shapes, and its
defining property: a row's output is bit-identical whatever the number of rows, its position among
them and its neighbours; the same for the MoE's invariant path against the torch reference."""

import numpy as np
import pytest
import torch

from tandem.ops import dispatch
from tandem.ops.cpu import gemm as cpu_gemm, moe as cpu_moe
from tandem.ops.cpu.groups import kernel_threads
from tandem.ops.settings import DEFAULT, REFERENCE, KernelSettings
from tandem.model.checkpoint import cast_trunk, init_weights
from tandem.model.config import TrunkConfig
from tandem.model.layers import input_major_linears
from tandem.model.trunk import Trunk


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("D,n_out", [(1, 1), (7, 13), (40, 517), (33, 1031), (256, 64)])
def test_mm_rows_matches_matmul_and_is_row_invariant(D, n_out):
    x, w = _randn(19, D, seed=D), _randn(n_out, D, seed=n_out)
    wt = w.t().contiguous().numpy()
    full = cpu_gemm.mm_rows(x.numpy(), wt)
    torch.testing.assert_close(torch.from_numpy(full), x @ w.t(), atol=1e-5 * D, rtol=1e-4)
    for M in (1, 2, 3, 4, 5, 8, 11, 19):
        for start in {0, 1, 19 - M}:  # first in a pair, second in a pair, the odd last row
            part = cpu_gemm.mm_rows(x[start : start + M].numpy(), wt)
            assert np.array_equal(part, full[start : start + M]), (M, start)
    perm = torch.randperm(19, generator=torch.Generator().manual_seed(1))
    assert np.array_equal(cpu_gemm.mm_rows(x[perm].numpy(), wt), full[perm.numpy()])
    c0, c1 = n_out // 3, n_out - n_out // 4
    assert np.array_equal(cpu_gemm.mm_rows(x.numpy(), wt, c0, c1), full[:, c0:c1])


def test_linear_takes_the_kernel_only_in_rows_mode():
    x, w = _randn(2, 5, 24, seed=1), _randn(30, 24, seed=2)
    w_im = w.t().contiguous().t()  # the serving layout
    rows = KernelSettings(rows=True)
    with torch.no_grad():
        plain = cpu_gemm.linear(x, w_im)
        inv, inv_rowmajor = cpu_gemm.linear(x, w_im, None, rows), cpu_gemm.linear(x, w, None, rows)
        biased = cpu_gemm.linear(x, w_im, torch.ones(30), rows)
        one = cpu_gemm.linear(x.reshape(10, 24)[3:4], w_im, None, rows)
        assert torch.equal(plain, torch.nn.functional.linear(x, w_im))  # off: the BLAS
    assert inv.shape == (2, 5, 30) and torch.equal(inv, inv_rowmajor) and torch.equal(biased, inv + 1)
    torch.testing.assert_close(inv, plain, atol=1e-5, rtol=1e-4)
    assert torch.equal(inv.reshape(10, 30)[3:4], one)


def test_serving_layout_swaps_linear_class_keeping_the_checkpoint():
    cfg = TrunkConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["sparse"],
        indexer_types=["full"],
        linear_head_dim=8,
        linear_num_heads=2,
        max_position_embeddings=32,
    )
    model = init_weights(Trunk(cfg, with_mtp=False).eval().requires_grad_(False), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    input_major_linears(model)
    assert isinstance(model.lm_head, cpu_gemm.ServingLinear) and isinstance(model.lm_head, torch.nn.Linear)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("N", [1, 2, 5, 13])
@pytest.mark.parametrize("D,n_inter,bf16", [(40, 24, False), (136, 72, True)])
def test_moe_invariant_path_matches_reference_and_is_row_invariant(N, D, n_inter, bf16):
    """fp32 weights, and bf16-exact ones wide enough for whole strips (the bfloat16 pairs: inputs
    rounded to bf16, so within bf16's tolerance of the reference)."""
    cfg = TrunkConfig(
        vocab_size=97,
        hidden_size=D,
        moe_intermediate_size=n_inter,
        n_routed_experts=5,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        layer_types=["linear_attention"] * 2,
        mlp_layer_types=["sparse", "sparse"],
        indexer_types=["full", "full"],
        linear_head_dim=12,
        linear_num_heads=3,
        max_position_embeddings=64,
    )
    model = cast_trunk(init_weights(Trunk(cfg, with_mtp=False).eval().requires_grad_(False), seed=3), torch.float32)
    moe = model.layers[1].mlp
    g = moe.gate
    if bf16:
        with torch.no_grad():
            for w in (moe._w_up, moe._w_down):
                w.copy_(w.to(torch.bfloat16).float())
        assert cpu_gemm.kernel_weight(moe._w_down, DEFAULT, transpose=False)[0].dtype in (
            np.uint32,
            np.int32,
        )  # pairs (int32: AMX)
    x = _randn(N, D, seed=N)

    def run(rows):
        return cpu_moe.moe_rows(
            rows,
            g.weight,
            g.e_score_correction_bias,
            g.top_k,
            g.norm_topk_prob,
            g.scale,
            moe._w_up,
            moe._w_down,
            moe.experts.limit,
            invariant=True,
        )

    with torch.no_grad():
        y = run(x)
        ref = dispatch.install(moe, REFERENCE)(x[None])[0]  # (this test's own model)
        dense = cpu_moe.moe_rows(
            x,
            g.weight,
            g.e_score_correction_bias,
            g.top_k,
            g.norm_topk_prob,
            g.scale,
            moe._w_up,
            moe._w_down,
            moe.experts.limit,
        )
    tol = {"atol": 1e-2 * ref.abs().max().item(), "rtol": 1e-2} if bf16 else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(y, dense, **tol)
    for i in range(N):
        assert torch.equal(run(x[i : i + 1])[0], y[i]), i
    for threads in (1, 2):  # the experts across threads: the same bits (one thread: one after the other)
        with kernel_threads(threads):
            assert torch.equal(run(x), y), threads


def test_kernel_weight_streams_bf16_bits_with_the_same_products():
    """Weights that are exactly bfloat16 (the shipped checkpoint, upcast) are read as their uint16
    bits: half the bytes, the products bit-identical to the fp32 weights; others stay fp32; an
    in-place change of the weight is seen; the arrays are strip-packed (64 columns a run). (The float32-input
    layout, ``gemm_inputs="fp32"``; the default bfloat16 pairs: tests/test_cpu_tile.py.)"""
    fp32 = KernelSettings(gemm_inputs="fp32")
    w = _randn(517, 40, seed=5).to(torch.bfloat16).float().t().contiguous().t()  # input-major, bf16 values
    x = _randn(9, 40, seed=6).numpy()
    wt = cpu_gemm.kernel_weight(w, fp32)
    strips, tail = wt
    assert strips.dtype == tail.dtype == np.uint16 and strips.shape == (8, 40, 64) and tail.shape == (40, 5)
    assert strips.nbytes + tail.nbytes == w.numel() * 2 and cpu_gemm.cols(wt) == 517
    assert cpu_gemm.kernel_weight(w, fp32) is wt  # made once
    w32 = w.t().numpy().copy()
    assert np.array_equal(cpu_gemm.mm_rows(x, wt), cpu_gemm.mm_rows(x, w32))
    assert np.array_equal(cpu_gemm.mm_rows(x, wt, 128, 320), cpu_gemm.mm_rows(x, w32)[:, 128:320])
    assert np.array_equal(cpu_gemm.mm_rows(x, wt, 448, 517), cpu_gemm.mm_rows(x, w32)[:, 448:517])
    with pytest.raises(ValueError, match="strips of 64: got 100..333 of 517"):
        cpu_gemm.mm_rows(x, wt, 100, 333)
    odd = _randn(30, 40, seed=7)  # not bfloat16 values
    assert (
        not cpu_gemm.is_bf16(cpu_gemm.kernel_weight(odd, fp32))
        and cpu_gemm.kernel_weight(odd, fp32)[1].dtype == np.float32
    )
    with torch.no_grad():
        w.mul_(2.0)  # still bfloat16 values
    again = cpu_gemm.kernel_weight(w, fp32)
    assert again is not wt and np.array_equal(cpu_gemm.mm_rows(x, again), 2 * cpu_gemm.mm_rows(x, w32))
    down = _randn(3, 24, 130, seed=8).to(torch.bfloat16).float()  # [E, I, D], not transposed
    ds, dt = cpu_gemm.kernel_weight(down, fp32, transpose=False)
    bits = down.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (
        ds.shape == (3, 2, 24, 64)
        and np.array_equal(ds[1, 1], bits[1, :, 64:128])
        and np.array_equal(dt, bits[:, :, 128:])
    )
    up = _randn(3 * 48, 40, seed=9).to(torch.bfloat16).float()  # [E * 2I, D]: each expert's rows in turn
    us, ut = cpu_gemm.kernel_weight(up, fp32, experts=3)
    assert us.shape == (3, 0, 40, 64) and ut.shape == (3, 40, 48)
    assert np.array_equal(cpu_gemm.mm_rows(x, (us[2], ut[2])), cpu_gemm.mm_rows(x, up[96:].t().contiguous().numpy()))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("D,n_out", [(1, 64), (7, 65), (37, 130), (256, 517), (5, 3)])
def test_packed_weights_give_the_unpacked_bits(bf16, D, n_out):
    """A strip-packed weight's products equal the unpacked kernel's bit for bit for any number of rows
    (one row takes the tiles here, the blocked kernel there) and any strip-aligned column range."""
    w = np.random.default_rng(D + n_out).standard_normal((D, n_out)).astype(np.float32)
    wt = (w.view(np.uint32) >> 16).astype(np.uint16) if bf16 else w
    pw = cpu_gemm.pack_strips(wt)
    x = np.random.default_rng(D).standard_normal((9, D)).astype(np.float32)
    for M in range(1, 10):
        for c0, c1 in {(0, n_out), (0, n_out - n_out % 64), (64 * (n_out // 128), n_out)}:
            assert np.array_equal(cpu_gemm.mm_rows(x[:M], pw, c0, c1), cpu_gemm.mm_rows(x[:M], wt, c0, c1)), (M, c0, c1)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("M,D,n_out", [(1, 256, 1536), (3, 40, 517), (8, 256, 200), (17, 130, 1031), (2, 64, 64)])
def test_split_gemm_gives_the_same_bits(bf16, M, D, n_out):
    """Above SPLIT_WORK a packed GEMM's columns split across the calling thread's numba threads: every
    output element is the chain it is on one thread, for any strip-aligned column range (odd tails,
    ranges shorter than one strip a thread)."""
    w = np.random.default_rng(n_out).standard_normal((D, n_out)).astype(np.float32)
    pw = cpu_gemm.pack_strips((w.view(np.uint32) >> 16).astype(np.uint16) if bf16 else w)
    x = np.random.default_rng(M).standard_normal((M, D)).astype(np.float32)
    ranges = {(0, n_out), (0, n_out - n_out % 64), (64 * (n_out // 128), n_out)}
    with kernel_threads(1):
        one = {r: cpu_gemm.mm_rows(x, pw, *r) for r in ranges}
    with kernel_threads(2):
        for r in ranges:
            assert np.array_equal(cpu_gemm.mm_rows(x, pw, *r), one[r]), r
