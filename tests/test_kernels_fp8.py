"""The block-scaled FP8 GEMM (tandem.ops.triton.fp8_gemm) against its reference (dequantize, then x @ W^T) with
odd shapes: partial row and column tiles, a K that ends inside a scale block, one row, scale blocks other than
128 x 128; and its refusals. On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest)."""

import pytest
import torch

pytest.importorskip("triton")

from tandem.ops.fp8 import quantize  # noqa: E402
from tandem.ops import dispatch  # noqa: E402
from tandem.ops.triton import fp8_gemm  # noqa: E402

DEV = "cpu" if dispatch.interpreted() else "cuda"


@pytest.mark.parametrize(
    "M,N,K,block",
    [(1, 130, 200, (128, 128)), (3, 257, 300, (128, 128)), (17, 33, 16, (128, 128)), (5, 100, 144, (64, 48))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_dequantize_then_matmul(M, N, K, block, dtype):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, generator=g) * torch.logspace(-2, 1, N)[:, None]  # blocks of different scales
    q, s = quantize(w, block)
    x = torch.randn(2, M, K, generator=g).to(dtype)
    y = fp8_gemm.fp8_linear(x.to(DEV), q.to(DEV), s.to(DEV), block).cpu()
    ref = fp8_gemm.reference(x, q, s, block)
    assert y.shape == (2, M, N) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 and DEV == "cpu" else 1e-2
    assert (y.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    assert (ref.float() - x.float() @ w.t()).abs().max() <= 0.1 * ref.float().abs().max()  # FP8's own error, bounded


def test_fp8_gemm_refuses_what_does_not_fit():
    q, s = quantize(torch.randn(40, 64), (128, 128))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x has 63 columns"):
        fp8_gemm.fp8_linear(x[:, :63], q, s, (128, 128))
    with pytest.raises(ValueError, match="scale_inv must be float32 \\[1, 1\\]"):
        fp8_gemm.fp8_linear(x, q, s[:, :0], (128, 128))
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        fp8_gemm.fp8_linear(x, q.float(), s, (128, 128))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_gemm.fp8_linear(x, q, quantize(torch.randn(40, 64), (8, 8))[1], (8, 8))


def test_bench_cases_run():
    from tandem.tools.kernel_cases import CASES

    for label, ref, tri in CASES["fp8_gemm"](DEV):
        a, b = ref(), tri()
        assert a.shape == b.shape and (a.float() - b.float()).abs().max() <= 1e-2 * a.float().abs().max(), label
