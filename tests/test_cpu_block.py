"""A decoder block in one numba call (``tandem.ops.cpu.block``, ``cpu_mla_block``) against the same block
run kernel by kernel (``DecoderLayer.run``): bit-identical hidden rows, features, KDA rows / states and
MLA caches (rows and pools), for
a verify of several sequences, a prime and the plain decode that follows, on odd shapes (3 streams,
5 experts, heads of 12), and the weight arguments made again after an in-place change."""

import copy
import gc
import weakref

import pytest
import torch

from tandem.ops.cpu import block as cpu_block, mla_block as cpu_mla_block
from tandem.ops.settings import KernelSettings
from tandem.model.cache import KDAState, MLACache
from tandem.model.checkpoint import cast_trunk, init_weights
from tandem.model.config import TrunkConfig
from tandem.model.layers import input_major_linears
from tandem.model.trunk import Trunk


def _odd_model():
    cfg = TrunkConfig(
        vocab_size=97,
        hidden_size=40,
        intermediate_size=56,
        moe_intermediate_size=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=20,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_head_dim=8,
        index_n_heads=3,
        index_topk=8,
        linear_head_dim=12,
        linear_num_heads=3,
        n_routed_experts=5,
        num_experts_per_tok=2,
        hc_mult=3,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "indexed_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full"] * 4,
        max_position_embeddings=128,
    )
    model = cast_trunk(init_weights(Trunk(cfg, with_mtp=False).eval().requires_grad_(False), seed=5), torch.float32)
    model = input_major_linears(model)
    model.batch_invariant = True
    return model


@pytest.fixture()
def odd():
    return _odd_model()


def _unfused(model):
    """A copy of ``model`` (its weights as they are now) whose blocks run kernel by kernel."""
    return copy.deepcopy(model).use_kernels(KernelSettings(fused=False))


def _ids(n, seed):
    return torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _counting(monkeypatch):
    calls = {"block": 0, "attn": 0, "ffn": 0, "mla_block": 0, "mla_attn": 0}
    monkeypatch.setattr(cpu_block, "CALLS", calls)
    return calls


def _session(model, fused: bool, prompts, blocks):
    """Prime each prompt (one prime_many), verify ``blocks`` (one verify_many, features of layers 1
    and 3), commit 2 rows each, then one plain row each; every output and the caches."""
    model = model if fused else _unfused(model)
    caches = [model.new_cache() for _ in prompts]
    with torch.no_grad():
        primed = model.prime_many(caches, prompts)
        verified = model.verify_many(caches, blocks, features=(1, 3))
        pend = [{i: (r.full.clone(), r.states.clone(), r.col, r.row) for i, r in c.pending.items()} for c in caches]
        for c in caches:
            c.commit(2)
        decoded = model.verify_many(caches, [b[:, 2:3] for b in blocks])
        for c in caches:
            c.commit(1)
    return primed, verified, pend, decoded, caches


def test_fused_blocks_are_bit_identical_to_the_kernel_by_kernel_path(odd, monkeypatch):
    assert [cpu_block.kda_fits(layer) for layer in odd.layers] == [True, True, False, True]
    assert [cpu_block.ffn_fits(layer) for layer in odd.layers] == [True, True, True, True]  # layer 0's dense MLP too
    assert [cpu_mla_block.fits(layer) for layer in odd.layers] == [False, False, True, False]
    prompts, blocks = [_ids(7, 1), _ids(1, 2), _ids(20, 3)], [_ids(4, 4), _ids(3, 5), _ids(6, 6)]
    ref = _session(odd, False, prompts, blocks)
    calls = _counting(monkeypatch)
    got = _session(odd, True, prompts, blocks)
    # per pass: every block whole (the KDA ones, layer 0's with its dense MLP; the MLA one); three passes
    assert calls == {"block": 9, "attn": 0, "ffn": 0, "mla_block": 3, "mla_attn": 0}
    for a, b in zip(got[0], ref[0]):
        assert torch.equal(a, b)
    for (h, f), (rh, rf) in zip(got[1], ref[1]):
        assert h.shape[-1] == 40 and f.shape[-1] == 80 and torch.equal(h, rh) and torch.equal(f, rf)
    for p, rp in zip(got[2], ref[2]):
        assert p.keys() == rp.keys() == {0, 1, 3}
        for i in p:
            assert torch.equal(p[i][0], rp[i][0]) and torch.equal(p[i][1], rp[i][1]) and p[i][2:] == rp[i][2:]
    for a, b in zip(got[3], ref[3]):
        assert torch.equal(a, b)
    for c, rc in zip(got[4], ref[4]):
        assert c.pos == rc.pos
        for a, b in zip(c.layers, rc.layers):
            if isinstance(a, KDAState):
                assert torch.equal(a.S, b.S) and torch.equal(a.tail, b.tail)
            else:
                assert isinstance(a, MLACache) and len(a) == len(b) and a.n_pools() == b.n_pools() > 0
                for name in ("latent", "k", "v", "ik", "ig", "pk"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_fused_block_sees_an_in_place_weight_change(odd):
    prompt, block = _ids(5, 7), _ids(3, 8)

    def run(fused):
        model = odd if fused else _unfused(odd)
        c = model.new_cache()
        model.prime(c, prompt)
        return model.verify(c, block)

    before = run(True)
    with torch.no_grad():
        odd.layers[1].mlp._w_up.mul_(1.5)  # the experts' gate | up (the parameters are views of it)
        odd.layers[3].self_attn.o_proj.weight.mul_(-1.0)
    after, ref = run(True), run(False)
    assert not torch.equal(after, before) and torch.equal(after, ref)


def test_outside_the_row_invariant_mode_blocks_run_unfused(odd, monkeypatch):
    odd.batch_invariant = False
    calls = _counting(monkeypatch)
    with torch.no_grad():
        odd.verify(odd.new_cache(), _ids(3, 9))
    assert not any(calls.values())


def test_a_layers_plans_go_with_it():
    model = _odd_model()
    with torch.no_grad():
        model.verify(model.new_cache(), _ids(2, 10))
    layer = model.layers[1]
    k = layer.kernels  # a plan a kernel settings: the weights are packed for them
    assert set(cpu_block._PLANS[layer]) == {("kda", k), ("ffn", k)} and cpu_block._PLANS[layer][("kda", k)].fits
    n, ref = len(cpu_block._PLANS), weakref.ref(layer)
    del layer, model
    gc.collect()
    assert ref() is None and len(cpu_block._PLANS) <= n - 4  # the model's four layers, freed
