"""The bfloat16-pair GEMM on AMX tiles (``tandem.ops.cpu.amx``): every row bit-identical for any
number of rows and any neighbours (input and output dimensions with and without tails, more rows than
a tile holds, column ranges), sums within float32 accumulation of the exact sum of the bfloat16
products, and the ``amx`` setting choosing the packing (int32 strips for the tiles) only where the CPU
has them. The tile tests run on a CPU with AMX-BF16 and skip elsewhere."""

import numpy as np
import pytest
import torch

from tandem.ops.cpu import amx as cpu_amx, gemm as cpu_gemm, tile as cpu_tile
from tandem.ops.settings import KernelSettings

needs_amx = pytest.mark.skipif(not cpu_amx.HW_AMX, reason="the CPU has no AMX-BF16 (or Linux did not lend the tiles)")


AMX, NO_AMX = KernelSettings(amx=True), KernelSettings(amx=False)


def _bf16_weight(n_out, D, seed):
    g = np.random.default_rng(seed)
    return torch.from_numpy(g.standard_normal((n_out, D)).astype(np.float32)).to(torch.bfloat16).float()


def _inputs(M, D, seed):
    """Rows over six decades (cancellation shows any difference in the summation)."""
    g = np.random.default_rng(seed)
    return (g.standard_normal((M, D)) * 10.0 ** g.integers(-3, 3, (M, D))).astype(np.float32)


@needs_amx
@pytest.mark.parametrize("D,n_out", [(2, 64), (38, 130), (40, 5), (96, 200), (256, 517), (512, 256)])
def test_amx_rows_are_bit_identical_for_any_row_count(D, n_out):
    w = _bf16_weight(n_out, D, seed=D + n_out)
    pw = cpu_gemm.kernel_weight(w, AMX)
    assert pw[0].dtype == np.int32 and pw[0].shape == (n_out // 64, D // 2, 64)
    x = _inputs(40, D, seed=D)
    full = cpu_gemm.mm_rows(x, pw)
    for M in (1, 2, 3, 15, 16, 17, 33):  # one tile, a full tile, a tile and a row, three tiles
        assert np.array_equal(cpu_gemm.mm_rows(x[:M], pw), full[:M]), M
        assert np.array_equal(cpu_gemm.mm_rows(x[M : M + 1], pw)[0], full[M]), M  # alone, any position
    mixed = x.copy()
    mixed[1::2] = _inputs(20, D, seed=D + 1)  # other neighbours: the even rows unchanged
    assert np.array_equal(cpu_gemm.mm_rows(mixed, pw)[::2], full[::2])
    if n_out > 64:
        assert np.array_equal(cpu_gemm.mm_rows(x, pw, 64, n_out), full[:, 64:])
    strided = np.full((40, 2 * n_out), np.nan, np.float32)[:, ::2]  # an output whose rows are not contiguous
    cpu_gemm._mmp(x, pw, 0, n_out, strided)
    assert np.array_equal(strided, full)


@needs_amx
def test_amx_sums_lie_within_float32_accumulation_of_the_exact_sum():
    D, n_out = 256, 1000
    w = _bf16_weight(n_out, D, seed=7)
    x = _inputs(24, D, seed=8)
    got = cpu_gemm.mm_rows(x, cpu_gemm.kernel_weight(w, AMX)).astype(np.float64)
    xb = torch.from_numpy(x).to(torch.bfloat16).double().numpy()  # the inputs the tiles multiply
    wd = w.double().numpy().T
    exact, scale = xb @ wd, np.abs(xb) @ np.abs(wd)
    err = np.abs(got - exact) / scale
    assert err.max() <= D * 2.0**-24  # the bound of D float32 roundings (Higham, Accuracy and Stability, eq. 3.5)
    assert np.median(err) < 1e-7
    # the AVX512-BF16 chain on the same inputs: another summation, so other last bits
    other = cpu_gemm.mm_rows(x, cpu_gemm.kernel_weight(w, NO_AMX))
    assert not np.array_equal(other, got.astype(np.float32))
    assert np.abs(other - exact).max() / scale.max() < 1e-6


def test_amx_setting_chooses_the_packing_only_where_the_cpu_has_tiles():
    w = _bf16_weight(130, 38, seed=1)
    assert cpu_amx.uses_amx(True) == cpu_amx.HW_AMX and (cpu_amx.gemm_tiles(True) == "AMX") == cpu_amx.HW_AMX
    assert cpu_gemm.kernel_weight(w, AMX)[0].dtype == (np.int32 if cpu_amx.HW_AMX else np.uint32)
    assert cpu_gemm.kernel_weight(w, NO_AMX)[0].dtype == np.uint32 and not cpu_amx.uses_amx(False)
    assert cpu_amx.gemm_tiles(False) == ("AVX512-BF16" if cpu_tile.HW_BF16 else "fp32 FMA")
