"""The DFlash drafter's block attention kernel against its torch reference (the list branch of
``DFlashAttention.forward``): ragged contexts (including empty ones), non-power-of-two heads, head
dims and block sizes, the packed-offset entry, and the engine hook under the forced switch."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")

from tandem.ops import dispatch  # noqa: E402
from tandem.ops.settings import REFERENCE, KernelSettings  # noqa: E402
from tandem.tools.kernel_cases import CASES  # noqa: E402

from tandem.model.dflash import DFlashAttention, DFlashConfig, block_attention as reference  # noqa: E402

DEV = "cpu" if dispatch.interpreted() else "cuda"


def _inputs(H, d, S, lens, seed=0, noncontig=False):
    g = torch.Generator().manual_seed(seed)
    R = len(lens) * S

    def blk():
        if noncontig:  # the model's layout: a [1, R, H, d] buffer seen as [1, H, R, d]
            return torch.randn(1, R, H, d, generator=g).to(DEV).transpose(1, 2)
        return torch.randn(1, H, R, d, generator=g).to(DEV)

    q, k, v = blk(), blk(), blk()
    ck = [(torch.randn(1, H, c, d, generator=g) * 2).to(DEV) for c in lens]
    cv = [torch.randn(1, H, c, d, generator=g).to(DEV) for c in lens]
    return q, k, v, ck, cv


@pytest.mark.parametrize("d", [12, 24])
@pytest.mark.parametrize("S", [7, 8])
def test_ragged_contexts_equal_reference(d, S):
    from tandem.ops.triton.block_attention import block_attention

    q, k, v, ck, cv = _inputs(3, d, S, [0, 5, 37], seed=d * 10 + S, noncontig=S == 7)
    want = reference(q, k, v, ck, cv)
    got = block_attention(q, k, v, ck, cv)
    assert got.shape == want.shape == (1, 3, 3 * S, d) and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the context mattered: without it the last sequence's output differs
    alone = reference(q[:, :, 2 * S :], k[:, :, 2 * S :], v[:, :, 2 * S :], [ck[2][:, :, :0]], [cv[2][:, :, :0]])
    assert (got[:, :, 2 * S :] - alone).abs().max() > 1e-2


def test_context_spans_several_tiles_and_all_empty():
    from tandem.ops.triton.block_attention import block_attention

    q, k, v, ck, cv = _inputs(5, 20, 3, [130, 1, 64, 0], seed=3)  # tiles of 64: 3, 1, 1 and 0 of them
    torch.testing.assert_close(block_attention(q, k, v, ck, cv), reference(q, k, v, ck, cv), atol=1e-5, rtol=1e-4)
    q, k, v, ck, cv = _inputs(3, 12, 8, [0, 0], seed=4)  # no context rows at all
    torch.testing.assert_close(block_attention(q, k, v, ck, cv), reference(q, k, v, ck, cv), atol=1e-5, rtol=1e-4)


def test_packed_entry_reads_offsets():
    from tandem.ops.triton.block_attention import block_attention_packed

    q, k, v, ck, cv = _inputs(3, 12, 7, [9, 0, 21], seed=5)
    off = torch.tensor([0, 9, 9, 30], dtype=torch.int32, device=DEV)
    got = block_attention_packed(
        q[0], k[0], v[0], torch.cat([c[0] for c in ck], 1), torch.cat([c[0] for c in cv], 1), off
    )
    torch.testing.assert_close(got.unsqueeze(0), reference(q, k, v, ck, cv), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="do not split into 4 equal blocks"):
        block_attention_packed(
            q[0], k[0], v[0], ck[0][0], cv[0][0], torch.tensor([0, 9, 9, 9, 9], dtype=torch.int32, device=DEV)
        )


def test_single_sequence_equals_the_unmasked_tensor_branch():
    """One sequence: the kernel equals the tensor branch of ``forward`` with ``mask=None``."""
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=40, num_attention_heads=3, head_dim=12, rms_norm_eps=1e-6)
    attn = DFlashAttention(cfg).to(DEV).eval().requires_grad_(False)
    x, ctx = torch.randn(1, 7, 40, device=DEV), torch.randn(1, 19, 40, device=DEV)
    pos = torch.arange(19, 26, device=DEV)
    ck, cv = attn.kv(ctx, torch.arange(19, device=DEV))
    ref = dispatch.install(copy.deepcopy(attn), REFERENCE)
    want = ref(x, pos, ck, cv, mask=None)
    ref_list = ref(x, pos, [ck], [cv])
    # the hook: the list branch takes the kernel
    got = dispatch.install(copy.deepcopy(attn), KernelSettings(backend="triton"))(x, pos, [ck], [cv])
    torch.testing.assert_close(ref_list, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_bad_inputs_are_refused():
    from tandem.ops.triton.block_attention import block_attention

    q, k, v, ck, cv = _inputs(3, 12, 7, [4, 5], seed=6)
    with pytest.raises(ValueError, match="lists of one length"):
        block_attention(q, k, v, ck, cv[:1])
    with pytest.raises(ValueError, match=r"context 1: ctx_k, ctx_v must be \[1, H=3, C, d=12\]"):
        block_attention(q, k, v, [ck[0], ck[1][:, :2]], [cv[0], cv[1][:, :2]])
    with pytest.raises(ValueError, match="one float dtype"):
        block_attention(q, k, v, [c.double() for c in ck], [c.double() for c in cv])


def test_bench_cases_run():

    tol = dict(atol=1e-5, rtol=1e-4) if DEV == "cpu" else dict(atol=3e-2, rtol=3e-2)  # cuda cases are bf16
    for label, ref, tri in CASES["block_attention"](DEV):
        torch.testing.assert_close(tri(), ref(), **tol, msg=label)


def test_bf16_stays_within_bf16_rounding_of_fp32():
    from tandem.ops.triton.block_attention import block_attention

    q, k, v, ck, cv = _inputs(3, 24, 8, [0, 5, 37], seed=7)
    bf = lambda ts: [t.bfloat16() for t in ts]  # noqa: E731
    got = block_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bf(ck), bf(cv))
    assert got.dtype == torch.bfloat16
    want = reference(q, k, v, ck, cv)
    ref16 = reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), bf(ck), bf(cv)).float()
    err, ref_err = (got.float() - want).abs().max().item(), (ref16 - want).abs().max().item()
    assert err < max(3 * ref_err, 2e-2), (err, ref_err)
