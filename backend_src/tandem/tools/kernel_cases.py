"""Benchmark and compile cases of the Triton kernels (:mod:`tandem.ops.triton`): for each kernel module, thunks
of its launcher and of the pure-torch reference it replaces on the same inputs (GLM-5.3-Flash shapes on ``"cuda"``,
tiny ones for Triton's interpreter otherwise). :mod:`tandem.tools.kernel_bench` times and compares them,
:mod:`tandem.tools.kernel_compile` compiles their launches; ``tests/test_kernels_*.py`` run them."""

from __future__ import annotations

from typing import Callable

import torch

from .. import schema

#: (label, torch reference thunk, Triton thunk)
Case = tuple[str, Callable[[], object], Callable[[], object]]


def sampler_cases(device: str) -> list[Case]:
    """(label, torch reference, Triton kernel) thunks: 8 walks of 8 verify rows over the real
    vocabulary (154,880) on ``"cuda"``, 3 walks over 2,000 tokens on the CPU."""
    from ..engine import accept, sampling
    from ..ops.triton import sampler as kern

    B, n, V = (8, 8, 154_880) if device == "cuda" else (3, 4, 2000)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B * n, V, generator=g) * 3).to(device)
    lengths = [n] * B
    tokens = [[int(t) for t in torch.randint(0, V, (n,), generator=g)] for _ in range(B)]
    cases = [
        (
            "sampler greedy",
            lambda: sampling.targets_and_gaps(logits, lengths, None),
            lambda: kern.targets_and_gaps(logits, lengths, None),
        )
    ]
    for label, p in (
        ("sampler rejection T=0.8 top_p=0.9", sampling.SamplingParams.create(0.8, 0, 0.9, seed=1)),
        ("sampler coupled T=1", sampling.SamplingParams.create(1.0, 0, 1.0, seed=1, mode=schema.COUPLED)),
    ):
        smp = [(p, tk, 100, False) for tk in tokens]
        cases.append(
            (
                label,
                lambda smp=smp: sampling.targets_and_gaps(logits, lengths, smp),
                lambda smp=smp: kern.targets_and_gaps(logits, lengths, smp),
            )
        )
    target = logits.argmax(-1)
    flat = target.tolist()
    drafts = [flat[b * n : b * n + n - 1] for b in range(B)]
    stops = [(1, 2)] * B

    def walks_reference():
        ws = [accept.accept_walk(d, flat[b * n : (b + 1) * n], (1, 2), 64) for b, d in enumerate(drafts)]
        return (
            torch.tensor([w.accepted for w in ws]),
            torch.tensor([len(w.emitted) for w in ws]),
            torch.tensor([kern.FINISH_CODES.index(w.finish) for w in ws], dtype=torch.int32),
        )

    cases.append(("accept walk", walks_reference, lambda: kern.accept_walk(target, lengths, drafts, stops, [64] * B)))
    return cases


def kda_verify_cases(device: str) -> list[Case]:
    """(label, torch-reference thunk, triton thunk): GLM-5.3-Flash KDA shapes on CUDA (32 heads,
    dk = dv = 128, k+1 = 8 verify rows, 1 and 8 sessions), tiny ones for the CPU interpreter."""
    from ..model.kda import kda_rows as reference
    from ..ops.triton import kda_verify as kern

    shapes = [(1, 8, 32, 128, 128), (8, 8, 32, 128, 128)] if device == "cuda" else [(2, 3, 3, 12, 20)]
    cases = []
    for B, T, H, dk, dv in shapes:
        args = kern._case(B, T, H, dk, dv, device)
        cases.append(
            (
                f"kda_verify B={B} T={T} H={H} dk={dk} dv={dv}",
                lambda a=args: reference(*a),
                lambda a=args: kern.kda_rows(*a),
            )
        )
    return cases


def dsa_indexer_cases(device: str) -> list[Case]:
    """(label, torch reference, triton) thunks: GLM-5.3-Flash indexer shapes (8 sessions x 8 verify
    rows, Hi=32, di=128, kp=16, index_topk=2048, context 4096) on ``"cuda"``, tiny ones otherwise."""
    from ..model.mla import pool_scores, select_pools
    from ..ops.triton import dsa_indexer as kern

    B, T, HI, DI, kp, topk, L = (8, 8, 32, 128, 16, 2048, 4096) if device == "cuda" else (2, 3, 3, 12, 4, 8, 40)
    g = torch.Generator(device=device).manual_seed(0)
    iq = torch.randn(B, T, HI, DI, device=device, generator=g)
    iw = torch.randn(B, T, HI, device=device, generator=g)
    pk = torch.randn(B, L // kp, DI, device=device, generator=g)
    q_pos = torch.arange(L - T, L, device=device)
    return [
        (
            f"dsa_indexer B={B} T={T} Hi={HI} di={DI} L={L} topk={topk}",
            lambda: select_pools(pool_scores(iq, iw, pk), q_pos, L, kp, topk // kp),
            lambda: kern.mask(iq, iw, pk, q_pos, L, kp, topk // kp),
        )
    ]


def mla_attention_cases(device: str) -> list[Case]:
    """(label, torch reference, triton) thunks: GLM-5.3-Flash MLA shapes (8 sessions x 8 verify rows,
    64 heads, dqk = dv = 256, context 4096, a DSA mask of 128 pools of 16 plus the tail) on
    ``"cuda"`` (bf16), tiny fp32 and bf16 ones otherwise."""
    from ..model.mla import masked_attention, pool_scores, select_pools
    from ..ops.triton import mla_attention as kern

    cuda = device == "cuda"
    B, T, H, D, L, kp, k_pools = (8, 8, 64, 256, 4096, 16, 128) if cuda else (2, 3, 3, 24, 40, 4, 2)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device=device, generator=g) for n in (T, L, L))
    P = L // kp
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    sc = pool_scores(rnd(B, T, 4, 16), rnd(B, T, 4), rnd(B, P, 16))
    mask = select_pools(sc, torch.arange(L - T, L, device=device), L, kp, k_pools)
    out = []
    for dt in (torch.bfloat16,) if cuda else (torch.float32, torch.bfloat16):
        qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
        out.append(
            (
                f"mla_attention B={B} T={T} H={H} d={D} L={L} {dt}",
                lambda qc=qc, kc=kc, vc=vc: masked_attention(qc, kc, vc, mask, D**-0.5),
                lambda qc=qc, kc=kc, vc=vc: kern.attention(qc, kc, vc, mask, D**-0.5),
            )
        )
    return out


def block_attention_cases(device: str) -> list[Case]:
    """(label, torch reference thunk, triton thunk): on ``"cuda"`` a DFlash drafter layer on a
    GLM-5.3-Flash-sized trunk (32 heads x 128, blocks of 8, 8 sequences with ragged contexts of
    ~4096 rows, and one at 1024), bf16; on ``"cpu"`` a tiny fp32 case for the interpreter."""
    from ..model.dflash import block_attention as reference
    from ..ops.triton import block_attention as kern

    def case(label, H, d, S, lens, dtype):
        g = torch.Generator(device="cpu").manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
        q, k, v = (mk(1, H, len(lens) * S, d) for _ in range(3))
        ck, cv = [mk(1, H, c, d) for c in lens], [mk(1, H, c, d) for c in lens]
        return (label, lambda: reference(q, k, v, ck, cv), lambda: kern.block_attention(q, k, v, ck, cv))

    if device == "cuda":
        return [
            case(
                "dflash block attn H=32 d=128 S=8 N=8 C~4096 bf16",
                32,
                128,
                8,
                [4096, 3900, 4200, 3500, 4096, 4500, 3000, 4096],
                torch.bfloat16,
            ),
            case("dflash block attn H=32 d=128 S=8 N=1 C=1024 bf16", 32, 128, 8, [1024], torch.bfloat16),
        ]
    return [case("dflash block attn H=3 d=12 S=8 N=3 C=0/5/37 fp32", 3, 12, 8, [0, 5, 37], torch.float32)]


#: a kernel module's name -> its cases
def fp8_gemm_cases(device: str) -> list[Case]:
    """(label, torch reference thunk, triton thunk): on ``"cuda"`` GLM-5.3-Flash's MLA ``q_b_proj`` (1536 -> 64 heads x
    256) and a routed expert's gate (4096 -> 2048) in 128 x 128 FP8 blocks, 1 and 8 rows of bf16 (a decode step and
    a verify block); on ``"cpu"`` tiny fp32 and bf16 cases for the interpreter."""
    from ..ops.fp8 import quantize
    from ..ops.triton import fp8_gemm as kern

    cuda = device == "cuda"
    shapes = (
        [(1, 16384, 1536, torch.bfloat16), (8, 16384, 1536, torch.bfloat16), (8, 2048, 4096, torch.bfloat16)]
        if cuda
        else [(3, 130, 200, torch.float32), (2, 70, 144, torch.bfloat16)]
    )
    cases = []
    for M, N, K, dtype in shapes:
        g = torch.Generator().manual_seed(M + N + K)
        q, s = quantize(torch.randn(N, K, generator=g) * 0.02, (128, 128))
        x, q, s = torch.randn(M, K, generator=g).to(device, dtype), q.to(device), s.to(device)
        cases.append(
            (
                f"fp8 gemm [{M}, {K}] x [{K}, {N}] {str(dtype).removeprefix('torch.')}",
                lambda x=x, q=q, s=s: kern.reference(x, q, s, (128, 128)),
                lambda x=x, q=q, s=s: kern.fp8_linear(x, q, s, (128, 128)),
            )
        )
    return cases


CASES: dict[str, Callable[[str], list[Case]]] = {
    "sampler": sampler_cases,
    "kda_verify": kda_verify_cases,
    "dsa_indexer": dsa_indexer_cases,
    "mla_attention": mla_attention_cases,
    "block_attention": block_attention_cases,
    "fp8_gemm": fp8_gemm_cases,
}
