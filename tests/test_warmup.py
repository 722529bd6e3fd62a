"""The ``trunk`` model's warm-up turns (tandem.serving.warmup): every hosted arm, greedy and sampled,
through the stage's wire form; nothing left behind; a stage that cannot serve fails the load."""

from __future__ import annotations

import pytest

from tandem import schema
from tandem.engine.colocated import StageHost
from tandem.engine.inprocess import Engine
from tandem.engine.trunk_stage import TrunkStage
from tandem.engine.scheduler import Scheduler
from tandem.engine.session import Turn
from tandem.serving import front as fr
from tandem.serving.warmup import MAX_TOKENS, PROMPT_TOKENS, warm_stage


class _Spy:
    """A stage whose ``handle`` records each call's op (and ``fail_op``: answers that op with a wire error)."""

    def __init__(self, stage, fail_op: str | None = None) -> None:
        self.stage, self.fail_op, self.ops = stage, fail_op, []

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def handle(self, arrays):
        op = arrays["OP"].reshape(-1)[0].decode()
        self.ops.append((op, arrays.get(schema.SPEC)))
        if op == self.fail_op:
            raise schema.WireError(f"{op} refused for the test")
        return self.stage.handle(arrays)


@pytest.fixture(scope="module")
def shipped(checkpoint):
    return Engine(checkpoint)


def _host(eng: Engine) -> StageHost:
    dflash = {a: st.drafters[a] for a, st in eng.drafters.items() if a in schema.DFLASH_ARMS}
    return StageHost.build(
        TrunkStage(eng.model, eng.config.max_ctx, eng.trunk.feature_layers, eng.config.batch_invariant),
        dflash,
        eng.config.max_num_draft_tokens,
    )


def test_hosted_stage_runs_every_arm_and_leaves_nothing(shipped, tokenizer, sharegpt_prompts):
    """A colocated trunk (the served default, pipelined): a greedy and a sampled turn per arm, each a prime,
    draft_verify calls and a close; afterwards no sequence, cache or drafter state is left and a client's
    turn on the same stage equals the in-process engine's."""
    spy = _Spy(host := _host(shipped))
    took = warm_stage(spy, shipped.config)
    arms = (schema.OFF, schema.DFLASH, schema.DFLASH2, schema.MTP)
    assert list(took) == [a + s for a in arms for s in ("", "+sampled")] and all(t > 0 for t in took.values())
    primes = [spec.tolist() for op, spec in spy.ops if op == "prime"]
    assert primes == [[a.encode()] for a in arms for _ in range(2)]
    assert {op for op, _ in spy.ops} >= {"prime", "draft_verify", "close"}
    assert not host.states and not host.trunk.caches and not host.ingest and not host.pending
    assert all(not st.states for st in host.by_model.values()) and not host.trunk.blocks  # nothing published
    # the warmed stage serves a client's turn as the engine does
    tr = fr.HostedTransport(local := fr.LocalTransport({"trunk": host}))
    dfl = fr.DFlashProxy(tr)
    sched = Scheduler(
        fr.TrunkProxy(local, shipped.model.cfg.vocab_size, hosted=True),
        {schema.MTP: fr.DrafterProxy(tr), schema.DFLASH: dfl, schema.DFLASH2: dfl},
        shipped.config,
    )
    ids = tokenizer.chat_prompt(sharegpt_prompts[0])
    out = []
    sched.admit([Turn(5, ids, 24, lambda r, e, f: out.extend(r.tokens) if r else None, spec=schema.MTP)])
    while 5 in sched.turns:
        sched.burst()
    assert out == shipped.generate(ids, 24, spec="off")["token_ids"]


def test_plain_trunk_stage_warms_plain_turns(shipped):
    """colocate off: the trunk process hosts no drafter, so only plain turns (greedy, sampled) run."""
    stage = TrunkStage(shipped.model, shipped.config.max_ctx, shipped.trunk.feature_layers, True)
    spy = _Spy(stage)
    took = warm_stage(spy, shipped.config)
    assert list(took) == ["off", "off+sampled"] and not stage.states
    prime = next(a for op, a in spy.ops if op == "prime")
    assert prime is None or prime.tolist() == [b"off"]
    assert sum(op == "prime" for op, _ in spy.ops) == 2 and spy.ops[-1][0] == "close"
    assert PROMPT_TOKENS > 0 and MAX_TOKENS > 1


@pytest.mark.parametrize("max_ctx", [12, 40])
def test_warm_up_keeps_within_the_stages_context(shipped, max_ctx):
    """The turns fit the trunk stage's own context bound, not the config's ``max_ctx`` (4,096 by default;
    a checkpoint's ``max_position_embeddings`` may be 256: such a server failed to load)."""
    stage = _host(shipped)
    stage.trunk.max_ctx = max_ctx
    spy = _Spy(stage)
    assert len(warm_stage(spy, shipped.config)) == 8 and not stage.states
    assert sum(op == "prime" for op, _ in spy.ops) == 8


def test_stage_that_cannot_serve_fails_the_warm_up(shipped):
    """A stage whose prime, or whose draft_verify, is refused: the warm-up raises, naming the arm and the
    stage's error (the model then fails to load with that message instead of failing clients' turns).
    (A lone turn's calls after its prime are pipelined: the first plain ``draft_verify`` comes with the
    first turn whose first burst cannot be, a sampled DFlash one.)"""
    with pytest.raises(RuntimeError, match=r"warm-up turn \(off\) failed: .*prime refused for the test"):
        warm_stage(_Spy(_host(shipped), fail_op="prime"), shipped.config)
    with pytest.raises(
        RuntimeError, match=r"warm-up turn \(\w+(, sampled)?\) failed: trunk.draft_verify: draft_verify refused"
    ):
        warm_stage(_Spy(_host(shipped), fail_op="draft_verify"), shipped.config)
