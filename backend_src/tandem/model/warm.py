"""Compile the numba serving kernels (:mod:`tandem.ops.cpu`) ahead of the first request:
``python -m tandem.model.warm`` (``make setup`` runs it), and the ``drafter_mtp`` model at load
(disk-cache hits then, ~5 s here). The ``tandem`` model does not call it: its warm-up turns
(:mod:`tandem.serving.warmup`) load from the disk cache exactly the kernels its settings take."""

from __future__ import annotations

import time

import torch

from ..ops import dispatch
from ..ops.settings import KernelSettings
from ..ops.state import ContextKV
from .checkpoint import cast_trunk, init_weights, is_fp32_param
from .config import TrunkConfig
from .dflash import DFlashConfig, DFlashDrafter
from .layers import input_major_linears
from .trunk import Trunk


def is_bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of ``w`` is a bfloat16 (the GEMM then takes it as bfloat16 pairs)."""
    return torch.equal(w.to(torch.bfloat16).float(), w)


def compile_kernels() -> float:
    """Compile every kernel for the argument types serving passes (numba caches them on disk beside the
    files of ``tandem/ops/cpu``, so only the first call on a machine pays: ~140 s on 2 cores) by running tiny
    random trunks through primes and two-sequence verifies (and, row-invariant, decode steps in one call):
    the plain layout; the serving layout in the row-invariant mode with fp32 weights, with bf16-exact
    weights but the fp32-kept ones (as shipped) and with all of them bf16-exact (each a set of argument
    types of the fused blocks; with DFlash drafters' rounds alone and in speculative rounds in one call), on a CPU with AMX for both GEMM tiles (the ``amx`` parameter picks one);
    and the shipped weights with float32 GEMM inputs (``dtype=fp32``). A model each,
    :class:`~tandem.ops.settings.KernelSettings`. Returns the seconds it took."""
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

    dcfg = DFlashConfig(
        hidden_size=32,
        vocab_size=64,
        block_size=3,
        num_attention_heads=2,
        head_dim=16,
        target_layer_ids=[0, 1],
        intermediate_size=32,
        selector_rank=4,
        selector_top_k=2,
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
            dispatch.top2(
                model.kernels,
                model.logits(model.verify_many(caches, [torch.tensor([[3]]), torch.tensor([[4, 5, 6]])])[1][0]),
            )
            for c in caches:
                c.commit(1)
        if model.batch_invariant:  # plain decode steps in one call (ops/cpu/decode.py): two sequences, then one
            for cs in (caches, caches[:1]):
                model.decode_many(cs, [3] * len(cs), 3, [()] * len(cs), (1,))
                for c in cs:
                    c.commit(1)
            model.verify_targets(caches, [[3], [4, 5, 6]], (1,))  # a verify round's pass (ops/cpu/trunk_pass.py)
            for c in caches:
                c.commit(1)
            for dflash2 in (False, True):  # a DFlash / DFlash2 drafter round (ops/cpu/dflash.py)
                d = DFlashDrafter(dcfg, dflash2).use_kernels(model.kernels)
                if model.lm_head.weight.dtype == torch.float32 and is_bf16_exact(model.lm_head.weight):
                    with torch.no_grad():
                        for p in d.parameters():
                            p.copy_(p.to(torch.bfloat16).float())
                a = d.layers[0].self_attn
                ctx = ContextKV(1, a.h, a.d, d.fc.weight)
                dispatch.dflash_round(d, model.embed_tokens.weight, model.lm_head, ctx, torch.zeros(3, 64), 3, 2)
                # speculative rounds in one call (ops/cpu/spec_burst.py): two sequences, one drafting 1, one 2
                ctxs = [ContextKV(1, a.h, a.d, d.fc.weight) for _ in caches]
                feats = [torch.zeros(2, 64), torch.zeros(1, 64)]
                args = (caches, ctxs, [3, 4], [1, 2], feats, [(), ()], [6, 6], 2, (0, 1), [range(2)])
                dispatch.spec_burst(model, d, model.lm_head, *args)
                for c in caches:
                    c.commit(1)

    with torch.no_grad():
        run(trunk("fp32"))  # the plain layout, BLAS GEMMs
        for amx in (True, False) if dispatch.HW_AMX else (True,):  # both tiles where the `amx` parameter picks one
            for weights in ("fp32", "shipped", "bf16") if amx else ("shipped", "bf16"):  # (fp32 weights: once)
                # the serving layout (fused linears and experts: ops/cpu/block.py) with its kernel settings
                model = input_major_linears(trunk(weights)).use_kernels(KernelSettings(amx=amx))
                model.batch_invariant = True  # the row-invariant GEMM and MoE (ops/cpu/gemm.py), the fused blocks
                run(model)
        # ``dtype=fp32``: float32 GEMM inputs on the shipped weights (the tiles play no part)
        model = input_major_linears(trunk("shipped")).use_kernels(KernelSettings(gemm_inputs="fp32"))
        model.batch_invariant = True
        run(model)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"tandem: serving kernels compiled and cached in {compile_kernels():.1f} s")
