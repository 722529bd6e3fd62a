"""Compile the numba serving kernels (:mod:`tandem.model.cpu_kernels`) ahead of the first request:
``python -m tandem.model.warm`` (``make setup`` runs it), and the ``trunk`` and ``drafter_mtp``
models at load (a disk-cache hit then, ~0.4 s)."""

from __future__ import annotations

import time

import torch

from .checkpoint import cast_trunk, init_weights
from .config import TrunkConfig
from .trunk import Trunk


def compile_kernels() -> float:
    """Compile every kernel for the argument types serving passes (numba caches them on disk beside
    cpu_kernels.py, cpu_kda.py, cpu_moe.py and cpu_gemm.py, so only the first call on a machine pays,
    ~10 s on 2 cores) by running a tiny random trunk through prime and a two-sequence verify. Returns the seconds it took."""
    t0 = time.perf_counter()
    cfg = TrunkConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_attention_heads=2,
                      num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
                      index_head_dim=8, index_n_heads=2, index_topk=8, linear_head_dim=16, linear_num_heads=2,
                      num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                      mlp_layer_types=["sparse", "sparse"], indexer_types=["full", "full"], max_position_embeddings=64)
    model = cast_trunk(init_weights(Trunk(cfg).eval().requires_grad_(False), seed=0), torch.float32)
    with torch.no_grad():
        caches = [model.new_cache(64), model.new_cache(64)]
        for c in caches:
            model.prime(c, torch.arange(1, 21)[None])
        model.verify_many(caches, [torch.tensor([[3]]), torch.tensor([[4, 5, 6]])])
        for c in caches:
            c.commit(1)
        model.batch_invariant = True  # the row-invariant GEMM and MoE (cpu_gemm.py)
        model.logits(model.verify_many(caches, [torch.tensor([[3]]), torch.tensor([[4, 5, 6]])])[1])
        for c in caches:
            c.commit(1)
        for p in model.parameters():  # bf16-exact weights, as shipped: the kernels' bf16-bits variants
            p.copy_(p.to(torch.bfloat16).float())
        model.logits(model.verify_many(caches, [torch.tensor([[3]]), torch.tensor([[4, 5, 6]])])[1])
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"tandem: serving kernels compiled and cached in {compile_kernels():.1f} s")
