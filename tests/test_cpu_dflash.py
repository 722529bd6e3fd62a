"""The DFlash / DFlash2 drafter's round compiled (``tandem.ops.cpu.dflash``) against the torch modules, its
reference: on odd shapes (two layers, 2 heads of 12, a vocabulary of 97, three convolution taps, 3 selector
candidates, random weights) and on the shipped drafters, the context keys and values it appends, the block's
hidden rows and the drafts of rounds after a prompt; the drafter stage takes the compiled round and keeps its
context in place."""

import pytest
import torch
from torch import nn

from tandem.engine.dflash_stage import DFlashStage
from tandem.engine.protocols import DraftRequest
from tandem.model.dflash import DFlashConfig, DFlashDrafter
from tandem.ops import dispatch
from tandem.ops.cpu import dflash as cpu_dflash
from tandem.ops.settings import DEFAULT
from tandem.ops.state import ContextKV


def _odd(dflash2: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = DFlashConfig(
        hidden_size=40,
        vocab_size=97,
        block_size=6,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=12,
        target_layer_ids=[0, 2],
        intermediate_size=56,
        selector_rank=5,
        selector_top_k=3,
        conv_taps=3,
    )
    d = DFlashDrafter(cfg, dflash2=dflash2)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    d.use_kernels(DEFAULT)
    embed = nn.Embedding(97, 40)
    head = dispatch.install(dispatch.ServingLinear(40, 97, bias=False), DEFAULT)
    return d, embed, head


def _torch_round(model, embed, head, kv, feats, anchor, k):
    """The torch modules' round: ingest ``feats`` into ``kv`` (a ContextKV), then the block forward and drafts."""
    stage = DFlashStage({"dflash2": model}, embed, head)
    st = stage.new_state()
    st.kv, st.rows = kv, kv.rows
    stage._ingest(model, st, feats)
    x = model.block_input(torch.tensor([anchor]), embed, k + 1)
    pos = torch.arange(st.rows, st.rows + k + 1)
    h = model(x, pos, [([a], [b]) for a, b in kv.views()], block=k + 1)[0]
    logits = stage._head(h[1:]).float()
    drafts = model.selector.walk(h[1:], logits, anchor) if model.selector is not None else logits.argmax(-1).tolist()
    return drafts, h


@pytest.mark.parametrize("dflash2", [False, True])
def test_a_compiled_round_equals_the_torch_round(dflash2):
    model, embed, head = _odd(dflash2)
    a = model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(30, model.cfg.feature_size, generator=g)
    with torch.no_grad():
        ca, cb = (ContextKV(2, a.h, a.d, model.fc.weight, capacity=8) for _ in range(2))  # grown on the way
        at, anchor = 0, 7
        for n, k in [(11, 5), (3, 5), (1, 2), (6, 5), (9, 1)]:
            da, ha = cpu_dflash.draft_round(
                model, embed.weight, head.weight, head.kernels.replace(rows=True), ca, feats[at : at + n], anchor, k
            )
            db, hb = _torch_round(model, embed, head, cb, feats[at : at + n], anchor, k)
            at, anchor = at + n, (anchor * 31 + 5) % 97
            assert ca.rows == cb.rows == at
            for (ka, va), (kb, vb) in zip(ca.views(), cb.views()):
                assert torch.allclose(ka, kb, rtol=1e-5, atol=1e-6) and torch.allclose(va, vb, rtol=1e-5, atol=1e-6)
            assert torch.allclose(ha, hb, rtol=1e-4, atol=1e-5), (ha - hb).abs().max()
            assert da == db and len(da) == k


@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_the_shipped_drafters_draft_compiled_as_the_torch_modules(shipped, spec, monkeypatch):
    """The drafter stage over the shipped trunk and drafters: rounds of one sequence drafted by the compiled
    round and by the torch modules (the compiled round switched off) give the same drafts."""
    trunk, drafters = shipped.model, {a: shipped.drafters[a].drafters[a] for a in ("dflash", "dflash2")}
    feats = torch.randn(40, drafters[spec].cfg.feature_size, generator=torch.Generator().manual_seed(2))
    rounds = [(list(range(100, 120)), 7), ([5, 6, 7], 7), ([9], 3), (list(range(200, 216)), 7)]

    def run():
        stage = DFlashStage(drafters, trunk.embed_tokens, trunk.lm_head)
        stage.open([1])
        out, at = [], 0
        for toks, k in rounds:
            out.append(stage.draft([DraftRequest(1, torch.zeros(0), toks, k, feats[at : at + len(toks)], spec)])[0])
            at += len(toks)
        assert stage.covered_rows(1) == at == stage.states[1].kv.rows
        return out

    calls = []
    real = dispatch.dflash_round
    monkeypatch.setattr(dispatch, "dflash_round", lambda *a: calls.append(real(*a)) or calls[-1])
    compiled = run()
    assert len(calls) == len(rounds) and None not in calls  # every round compiled
    monkeypatch.setattr(dispatch, "dflash_round", lambda *a: None)
    reference = run()
    assert compiled == reference and [len(d) for d in compiled] == [k for _, k in rounds]
