"""The trunk against the oracles: transformers' Glm5NextTextModel (dense DSA regime) and tandem's
own full forward (sparse regime)."""

import pytest
import torch

from tandem.model.checkpoint import load_trunk


def _hf_model(checkpoint, index_topk):
    from transformers import Glm5NextTextModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    m, info = Glm5NextTextModel.from_pretrained(checkpoint, output_loading_info=True, dtype=torch.float32,
                                                index_topk=index_topk)
    return m.eval(), info


def test_checkpoint_loads_into_transformers(checkpoint, trunk_fp32):
    _, info = _hf_model(checkpoint, 64)
    n = trunk_fp32.cfg.num_hidden_layers
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["mismatched_keys"]
    extra = {k for k in info["unexpected_keys"] if not (k.startswith(f"layers.{n}.") or k == "lm_head.weight")}
    assert extra == set(), f"unexpected trunk keys: {sorted(extra)[:5]}"
    mtp = [k for k in info["unexpected_keys"] if k.startswith(f"layers.{n}.")]
    assert any(k.endswith("eh_proj.weight") for k in mtp)  # (transformers silently drops shared_head.*)
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight"):
        assert f"layers.{n}.{name}" in keys


def test_logits_match_transformers_dense_regime(checkpoint, tokenizer, sharegpt_prompts):
    """fp32, index_topk >= context: max |logit difference| <= 1e-4 over 20 real prompts."""
    ours = load_trunk(checkpoint, torch.float32, overrides={"index_topk": 1024})
    hf, _ = _hf_model(checkpoint, 1024)
    worst = 0.0
    with torch.no_grad():
        for p in sharegpt_prompts:
            ids = torch.tensor([tokenizer.chat_prompt(p)[:256]])
            a = ours.logits(ours.hidden(ids))
            b = ours.logits(hf(ids).last_hidden_state)
            worst = max(worst, (a - b).abs().max().item())
    print(f"max |logit diff| vs transformers over {len(sharegpt_prompts)} prompts: {worst:.3e}")
    assert worst <= 1e-4


def test_cached_paths_equal_full_forward_sparse_regime(trunk_fp32, tokenizer, sharegpt_prompts):
    """Sparse DSA (contexts up to ~300 tokens >> index_topk): prime + verify/commit in uneven
    pieces reproduces tandem's own full forward."""
    model = trunk_fp32
    text = " ".join(sharegpt_prompts)
    ids = tokenizer.encode(text)[:301]
    assert len(ids) > 4 * model.cfg.index_topk
    x = torch.tensor([ids])
    with torch.no_grad():
        full = model.logits(model.hidden(x))[0]
        cache = model.new_cache()
        parts = [model.logits(model.prime(cache, x[:, :97]))[0]]
        p = 97
        step = 0
        while p < len(ids):
            r = min(3 + step % 4, len(ids) - p)
            h = model.verify(cache, x[:, p: p + r])
            keep = max(1, r - step % 3)
            cache.commit(keep)
            parts.append(model.logits(h)[0, :keep])
            p += keep
            step += 1
        got = torch.cat(parts)
    assert cache.pos == len(ids)
    assert (got - full).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("n", [1, 3, 16])
def test_dense_expert_rows_equal_per_expert_dispatch(trunk_fp32, n):
    """The dense path for a few rows (every expert, unselected ones weighted 0) equals dispatch per expert."""
    from tandem.model.layers import MoE

    moe = next(l.mlp for l in trunk_fp32.layers if isinstance(l.mlp, MoE))
    x = torch.randn(n, trunk_fp32.cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    _, w, idx = moe.gate(x)
    dense = moe.experts(x, idx, w)
    old, moe.experts.dense_rows = moe.experts.dense_rows, 0
    try:
        loop = moe.experts(x, idx, w)
    finally:
        moe.experts.dense_rows = old
    assert (dense - loop).abs().max() < 1e-5
    assert loop.abs().max() > 1e-3  # the experts contribute
