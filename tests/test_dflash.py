"""The DFlash specs on a tiny random trunk and drafter: exactness of greedy speculation, deferred
ingest of the prompt, the wire form, and the drafter's building blocks."""

from __future__ import annotations

import pytest
import torch

from tandem import schema
from tandem.engine.dflash_stage import DFlashStage
from tandem.engine.inprocess import Engine
from tandem.engine.protocols import DraftRequest
from tandem.engine.scheduler import Turn
from tandem.model.dflash import DFlashConfig, DFlashDrafter, TwoTapConv, rope
from tandem.serving import proxies

from conftest import make_tiny_trunk


class _Tok:
    stop_ids = ()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    trunk = make_tiny_trunk(max_position_embeddings=256)
    dcfg = DFlashConfig(
        hidden_size=64,
        vocab_size=512,
        num_attention_heads=2,
        head_dim=32,
        intermediate_size=128,
        block_size=5,
        target_layer_ids=[1, 3],
        selector_rank=8,
        selector_top_k=3,
    )
    drafters = {}
    for spec in schema.DFLASH_SPECS:
        d = DFlashDrafter(dcfg, dflash2=spec == schema.DFLASH2)
        with torch.no_grad():
            d.mask_embedding.normal_(0, 1)
            if d.selector is not None:
                for conv in (m for m in d.modules() if isinstance(m, TwoTapConv)):
                    conv.weight[1].normal_(0, 0.1)
        drafters[spec] = d.eval().requires_grad_(False)
    return trunk, drafters


def _engine(tiny, **kw):
    """An engine over the tiny random drafters (demotion off: they accept too little to be kept)."""
    trunk, drafters = tiny
    return Engine(model=trunk, tokenizer=_Tok(), dflash=drafters, max_ctx=256, adaptive_draft=False, **kw)


@pytest.mark.parametrize("spec", schema.DFLASH_SPECS)
def test_greedy_dflash_equals_plain_fp32(tiny, spec):
    eng = _engine(tiny, burst_rounds=2)
    for seed in range(3):
        ids = torch.randint(4, 512, (20 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        a = eng.generate(ids, 40, spec=spec)
        b = eng.generate(ids, 40, spec="off")
        assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 40
        assert a["drafted"] == 4 * a["rounds"] and b["drafted"] == 0  # block 5: 4 drafts a round


def test_dflash_ingest_is_deferred_to_round_one(tiny):
    eng = _engine(tiny, burst_rounds=1)
    stage = eng.drafters[schema.DFLASH]
    ids = list(range(10, 40))
    got = []
    eng.sched.admit([Turn(1, ids, 20, lambda r, e, f: got.append((r, e)), spec="dflash2", end=False)])
    assert stage.covered_rows(1) == 0  # primed, but the prompt's features are not ingested yet
    eng.sched.burst()
    s = eng.sched.sessions[1]
    first_round = got[1][0]
    assert stage.covered_rows(1) == len(ids) and first_round.rounds == 1
    eng.sched.burst()
    assert stage.covered_rows(1) == len(ids) + len(first_round.tokens) == len(s.committed) - len(got[2][0].tokens)
    while 1 in eng.sched.turns:
        eng.sched.burst()
    assert stage.states[1].spec == "dflash2"
    eng.sched.close(1)
    eng.sched.burst()
    assert 1 not in stage.states


def test_dflash_proxy_equals_stage(tiny):
    trunk, drafters = tiny
    ref = DFlashStage(drafters, trunk.embed_tokens, trunk.lm_head)
    tr = proxies.LocalTransport({"drafter_dflash": DFlashStage(drafters, trunk.embed_tokens, trunk.lm_head)})
    proxy = proxies.DFlashProxy(tr)
    feats = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    items = [
        DraftRequest(1, torch.zeros(0), [5, 6, 7, 9], 4, feats[:4], "dflash"),
        DraftRequest(2**64 - 1, torch.zeros(0), [8, 11], 2, feats[4:], "dflash2"),
    ]
    for st in (ref, proxy):
        st.open([1, 2**64 - 1])
    got, want = proxy.draft(items), ref.draft(items)
    assert got == want and [len(d) for d in got] == [4, 2]
    with pytest.raises(proxies.StageError, match=r"SPEC: sequence 1 drafts with dflash, not dflash2"):
        proxy.draft([DraftRequest(1, torch.zeros(0), [5], 4, feats[:1], "dflash2")])
    with pytest.raises(proxies.StageError, match=r"FEATURES must be \[N, 128\]"):
        proxy.draft([DraftRequest(1, torch.zeros(0), [5], 4, feats[:1, :64], "dflash")])
    with pytest.raises(proxies.StageError, match=r"NUM_DRAFT_TOKENS must be in \[0, 8\], got 9"):
        proxy.draft([DraftRequest(1, torch.zeros(0), [5], 9, feats[:1], "dflash")])


def test_specs_without_a_drafter_are_refused(tiny):
    trunk, _ = tiny
    eng = Engine(model=trunk, tokenizer=_Tok(), dflash={}, max_ctx=256)
    errs = []
    eng.sched.admit([Turn(1, [5, 6], 4, lambda r, e, f: errs.append(e), spec="dflash")])
    assert errs == [
        "SPEC 'dflash' needs the drafter_dflash model with a dflash drafter, which is not loaded "
        "(the checkpoint has none: `make drafter` trains it)"
    ]
    eng = _engine(tiny)
    eng.sched.admit([Turn(2, [5, 6], 4, lambda r, e, f: errs.append(e), spec="mtp", end=False)])
    while 2 in eng.sched.turns:
        eng.sched.burst()
    eng.sched.admit([Turn(2, [7], 4, lambda r, e, f: errs.append(e), spec="dflash", start=False)])
    assert errs[-1] == "SPEC: sequence 2 runs 'mtp'; a later turn cannot switch to 'dflash'"


def test_rope_depends_on_relative_position_only():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g)
    dots = [(rope(q, torch.tensor([p + 7]), 1e4) * rope(k, torch.tensor([p]), 1e4)).sum().item() for p in (0, 5, 300)]
    assert dots[0] == pytest.approx(dots[1], rel=1e-4) and dots[0] == pytest.approx(dots[2], rel=1e-4)


def test_two_tap_conv_is_causal_within_each_block():
    conv = TwoTapConv(3)
    x = torch.randn(1, 8, 3)
    assert torch.equal(conv(x, 4), x)  # identity at initialisation
    with torch.no_grad():
        conv.weight[1].fill_(1.0)
    y = conv(x, 4)
    assert torch.allclose(y[0, 1:4], x[0, 1:4] + x[0, 0:3]) and torch.allclose(
        y[0, 4], x[0, 4]
    )  # no leak across blocks


def test_training_blocks_equal_inference_blocks(tiny):
    """The masked many-blocks training pass gives each block the hidden the stage's inference pass gives it."""
    from tandem.tools.distill import block_mask

    trunk, drafters = tiny
    d = drafters["dflash2"]
    bs = d.cfg.block_size
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(4, 512, (1, 30), generator=g)
    feats = torch.randn(1, 30, d.cfg.feature_size, generator=g)
    anchors = torch.tensor([[6, 17, 25]])
    with torch.no_grad():
        kv = d.context_kv(d.context(feats), torch.arange(30))
        pos = (anchors[:, :, None] + torch.arange(bs)).reshape(1, -1)
        x = d.block_input(seq[0, anchors[0]], trunk.embed_tokens, bs).reshape(1, -1, 64)
        h = d(x, pos, kv, block=bs, mask=block_mask(anchors, 30, bs)).view(3, bs, -1)
        for j, a in enumerate(anchors[0].tolist()):
            kv_a = d.context_kv(d.context(feats[:, :a]), torch.arange(a))
            ref = d(d.block_input(seq[0, a : a + 1], trunk.embed_tokens, bs), torch.arange(a, a + bs), kv_a, block=bs)
            assert torch.allclose(h[j], ref[0], atol=1e-5), j


def test_batched_generation_equals_plain_decoding(tiny):
    from tandem.tools.distill import generate_batch

    trunk, _ = tiny
    prompts = torch.randint(4, 512, (2, 12), generator=torch.Generator().manual_seed(9))
    out, feats = generate_batch(trunk, prompts, 10, features=(1, 3))
    assert feats.shape == (2, 22, 128) and not feats[:, -1].any()
    ref = trunk.hidden(out, features=(1, 3))[1]
    assert torch.allclose(feats[:, :-1], ref[:, :-1], atol=1e-4)  # cached passes == full pass
    eng = Engine(model=trunk, tokenizer=_Tok(), dflash={}, max_ctx=256)
    for i in range(2):
        assert out[i, 12:].tolist() == eng.generate(prompts[i].tolist(), 10, spec="off")["token_ids"]


def test_default_target_layers_follow_glm():
    from tandem.tools.distill import default_target_layers

    assert default_target_layers(45) == [5, 14, 24, 33, 42]
    assert default_target_layers(9) == [1, 3, 5, 7, 8]
    assert default_target_layers(4) == [0, 1, 2, 3]


def test_second_turn_drafter_sees_every_committed_row(tiny):
    """The rows committed by a turn's last round reach the drafter with the next turn's prime, so the
    drafter's positions stay aligned with the trunk's across turns."""
    eng = _engine(tiny, burst_rounds=1)
    stage = eng.drafters[schema.DFLASH]
    got = []
    emit = lambda r, e, f: got.append((r, e, f))  # noqa: E731
    eng.sched.admit([Turn(3, list(range(10, 30)), 9, emit, spec="dflash", end=False)])
    while 3 in eng.sched.turns:
        eng.sched.burst()
    eng.sched.admit([Turn(3, [40, 41, 42], 9, emit, start=False)])
    eng.sched.burst()
    s = eng.sched.sessions[3]
    assert all(e is None for _, e, _ in got)
    # after a round the drafter holds every committed row but the ones that round committed
    assert stage.covered_rows(3) == len(s.committed) - len(got[-1][0].tokens)
    while 3 in eng.sched.turns:
        eng.sched.burst()


def test_selector_walk_equals_its_reference(tiny):
    """The one-pass DFlash2 walk picks the same path as scoring one position at a time."""
    import copy

    sel = copy.deepcopy(tiny[1]["dflash2"].selector)  # the fixture is shared: perturb a copy
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 1.0, generator=g)
    paths = set()
    for seed in range(6):
        gs = torch.Generator().manual_seed(seed)
        h, logits = torch.randn(7, 64, generator=gs), torch.randn(7, 512, generator=gs)
        got = sel.walk(h, logits, anchor=seed + 3)
        assert got == sel.walk_reference(h, logits, anchor=seed + 3)
        paths.add(tuple(got) != tuple(logits.argmax(-1).tolist()))
    assert True in paths  # the pair scores change the path (not just the per-position argmax)


def test_default_spec_falls_back_without_its_drafter(tiny):
    trunk, _ = tiny
    assert schema.DEFAULTS.spec == schema.OFF  # the fastest measured on the CPU (README, Serving)
    assert _engine(tiny).sched.default_spec() == schema.OFF
    assert _engine(tiny, spec=schema.DFLASH2).sched.default_spec() == schema.DFLASH2
    eng = Engine(model=trunk, tokenizer=_Tok(), dflash={}, max_ctx=256, spec=schema.DFLASH2, adaptive_draft=False)
    assert eng.sched.default_spec() == schema.MTP
    out = eng.generate(list(range(5, 25)), 8)  # no SPEC: the fallback spec, not an error
    assert len(out["token_ids"]) == 8 and out["drafted"] > 0


def test_sessions_draft_together_as_alone(tiny):
    """One block forward over several sequences (same spec and block size; another block size beside
    them) gives each the drafts it gets alone, bit for bit, over two rounds."""
    trunk, drafters = tiny
    g = torch.Generator().manual_seed(5)
    together = DFlashStage(drafters, trunk.embed_tokens, trunk.lm_head)
    together.open([1, 2, 3, 4])
    alone = {s: DFlashStage(drafters, trunk.embed_tokens, trunk.lm_head) for s in (1, 2, 3, 4)}
    for s, st in alone.items():
        st.open([s])
    for rnd in range(2):
        items = [
            DraftRequest(
                s,
                torch.zeros(0),
                [int(t) for t in torch.randint(4, 512, (n,), generator=g)],
                k,
                torch.randn(n, 128, generator=g),
                spec,
            )
            for s, n, k, spec in (
                (1, 9 - rnd, 4, "dflash2"),
                (2, 3, 4, "dflash2"),
                (3, 5, 2, "dflash2"),
                (4, 4, 4, "dflash"),
            )
        ]
        got = together.draft(items)
        want = [alone[it.sid].draft([it])[0] for it in items]
        assert got == want and [len(d) for d in got] == [4, 4, 2, 4]


def test_distilled_turns_are_drawn_once_and_kept(tmp_path, monkeypatch, checkpoint):
    """The ShareGPT turns a checkpoint's drafters were distilled from are what the distillation's prompt
    draw took (by digest); the draw is kept under the cache folder and read back there, and a changed
    report is a new draw."""
    import json
    import shutil

    from tandem.model.tokenizer import ChatTokenizer
    from tandem.tools import distill

    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(checkpoint / "tokenizer.json", ck / "tokenizer.json")
    (ck / "distill_report.json").write_text(
        json.dumps({"prompts_listed": 40, "prompt_len": 24, "seed": 3, "sequences": 30})
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert len(distill.used_sharegpt_turns(tmp_path)) == 0  # no report: nothing was distilled
    pairs = distill.training_prompts(ChatTokenizer(ck / "tokenizer.json"), 40, 24, 3, with_sources=True)
    want = {s for _, s in pairs[:30] if s is not None}
    got = distill.used_sharegpt_turns(ck)
    assert len(got) == len(want) > 0 and all(s in got for s in want)
    assert (
        not any(s in got for _, s in pairs[30:] if s is not None and s not in want) and "a text never seen" not in got
    )
    kept = list(distill.turns_cache_dir().glob("distill-turns-*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())) == len(want)
    monkeypatch.setattr(distill, "training_prompts", lambda *a, **k: pytest.fail("drawn again"))
    assert distill.used_sharegpt_turns(ck).digests == got.digests  # read back from the cache
    (ck / "distill_report.json").write_text(
        json.dumps({"prompts_listed": 40, "prompt_len": 24, "seed": 3, "sequences": 5})
    )
    with pytest.raises(pytest.fail.Exception, match="drawn again"):
        distill.used_sharegpt_turns(ck)
