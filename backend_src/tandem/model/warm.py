"""Compile the numba serving kernels (:mod:`tandem.ops.cpu.kernels`) ahead of the first request:
``python -m tandem.model.warm`` (``make setup`` runs it), and the ``trunk`` and ``drafter_mtp``
models at load (disk-cache hits then, ~5-7 s here)."""

from __future__ import annotations

import time

import torch

from ..ops.cpu import amx as cpu_amx, kernels as cpu_kernels
from .checkpoint import cast_trunk, init_weights, is_fp32_param
from .config import TrunkConfig
from .layers import input_major_linears
from .trunk import Trunk


def compile_kernels() -> float:
    """Compile every kernel for the argument types serving passes (numba caches them on disk beside
    cpu_kernels.py, cpu_kda.py, cpu_moe.py, cpu_gemm.py, cpu_block.py, cpu_mla_block.py and cpu_decode.py, so only the first call on a
    machine pays: ~100 s on 2 cores) by running tiny random trunks through primes and two-sequence
    verifies (and, row-invariant, decode steps in one call): the plain layout, and the serving layout in the row-invariant mode with fp32 weights,
    with bf16-exact weights but the fp32-kept ones (as shipped) and with all of them bf16-exact (each
    a set of argument types of the fused blocks), on a CPU with AMX for both GEMM tiles (:mod:`~tandem.ops.cpu.amx`:
    the ``amx`` parameter picks one). Returns the seconds it took."""
    t0 = time.perf_counter()
    cfg = TrunkConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_head_dim=8,
        index_n_heads=2,
        index_topk=8,
        linear_head_dim=16,
        linear_num_heads=2,
        num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        indexer_types=["full"] * 3,
        max_position_embeddings=64,
    )

    def trunk(weights: str) -> Trunk:  # random fp32 weights; "shipped": bf16-exact but the fp32-kept ones; "bf16": all
        m = cast_trunk(init_weights(Trunk(cfg).eval().requires_grad_(False), seed=0), torch.float32)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if weights == "bf16" or (weights == "shipped" and not is_fp32_param(name)):
                    p.copy_(p.to(torch.bfloat16).float())
                elif is_fp32_param(name):
                    p.add_(1e-3 / 3)  # not bf16-exact (the router's init, zeros, was)
        return m

    def run(model: Trunk) -> None:  # two primes, then two two-sequence verifies (one row, three rows)
        caches = [model.new_cache(64), model.new_cache(64)]
        for c in caches:
            model.prime(c, torch.arange(1, 21)[None])
        for _ in range(2):
            cpu_kernels.top2(
                model.logits(model.verify_many(caches, [torch.tensor([[3]]), torch.tensor([[4, 5, 6]])])[1][0])
            )
            for c in caches:
                c.commit(1)
        if model.batch_invariant:  # plain decode steps in one call (cpu_decode.py): two sequences, then one
            for cs in (caches, caches[:1]):
                model.decode_many(cs, [3] * len(cs), 3, [()] * len(cs), (1,))
                for c in cs:
                    c.commit(1)

    before = cpu_amx.ON[0]
    try:
        with torch.no_grad():
            run(trunk("fp32"))  # the plain layout, BLAS GEMMs
            for amx in (True, False) if cpu_amx.HW_AMX else (before,):  # both tiles where the `amx` parameter picks one
                cpu_amx.set_amx(amx)  # (fp32 weights take neither: once)
                for weights in ("fp32", "shipped", "bf16") if amx == before else ("shipped", "bf16"):
                    model = input_major_linears(
                        trunk(weights)
                    )  # the serving layout (fused linears and experts: cpu_block.py)
                    model.batch_invariant = True  # the row-invariant GEMM and MoE (cpu_gemm.py), the fused blocks
                    run(model)
    finally:
        cpu_amx.set_amx(before)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"tandem: serving kernels compiled and cached in {compile_kernels():.1f} s")
