"""The engine core's warm-up turns (tandem.serving.warmup): every spec, greedy and sampled, on the stages the
``tandem`` model serves with; nothing left behind; stages that cannot serve fail the load."""

from __future__ import annotations

import pytest

from tandem import schema
from tandem.engine.stages import drafter_stages
from tandem.engine.trunk_stage import TrunkStage
from tandem.serving.warmup import MAX_TOKENS, PROMPT_TOKENS, warm_stages


class _Spy:
    """A stage that records each call (method name, sequences) and (``fail``) raises on that method."""

    def __init__(self, stage, fail: str | None = None) -> None:
        self.stage, self.fail, self.calls = stage, fail, []

    def __getattr__(self, name):
        attr = getattr(self.stage, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*a, **kw):
            self.calls.append(name)
            if name == self.fail:
                raise RuntimeError(f"{name} refused for the test")
            return attr(*a, **kw)

        return call


def _stages(eng, max_ctx: int | None = None):
    dflash = {a: st.drafters[a] for a, st in eng.drafters.items() if a in schema.DFLASH_SPECS}
    trunk = TrunkStage(eng.model, max_ctx or eng.config.max_ctx, eng.trunk.feature_layers, eng.config.batch_invariant)
    return trunk, drafter_stages(eng.model, dflash, eng.config.max_num_draft_tokens)


def test_every_spec_warms_and_leaves_nothing(shipped, tokenizer, sharegpt_prompts):
    """A greedy and a sampled turn per spec, each a prime, rounds and a close; afterwards no sequence, cache
    or drafter state is left, nothing is published, and a client's turn on the same stages equals the
    in-process engine's."""
    from tandem.engine.scheduler import Scheduler
    from tandem.engine.session import Turn

    trunk, drafters = _stages(shipped)
    spy = _Spy(trunk)
    took = warm_stages(spy, drafters, shipped.config)
    specs = (schema.OFF, schema.DFLASH, schema.DFLASH2, schema.MTP)
    assert list(took) == [a + s for a in specs for s in ("", "+sampled")] and all(t > 0 for t in took.values())
    assert spy.calls.count("prime") == 8 and {"verify", "close"} <= set(spy.calls)
    assert not trunk.states and not trunk.blocks
    assert all(not st.states for st in {id(d): d for d in drafters.values()}.values())
    sched = Scheduler(trunk, drafters, shipped.config)
    ids = tokenizer.chat_prompt(sharegpt_prompts[0])
    out = []
    sched.admit([Turn(5, ids, 24, lambda r, e, f: out.extend(r.tokens) if r else None, spec=schema.MTP)])
    while 5 in sched.turns:
        sched.burst()
    assert out == shipped.generate(ids, 24, spec="off")["token_ids"]


def test_a_trunk_without_drafters_warms_plain_turns(shipped):
    """No drafter (a checkpoint without an MTP layer or DFlash drafters): only plain turns, greedy and sampled."""
    trunk, _ = _stages(shipped)
    spy = _Spy(trunk)
    took = warm_stages(spy, {}, shipped.config)
    assert list(took) == ["off", "off+sampled"] and not trunk.states
    assert spy.calls.count("prime") == 2 and spy.calls[-1] == "close"
    assert PROMPT_TOKENS > 0 and MAX_TOKENS > 1


@pytest.mark.parametrize("max_ctx", [12, 40])
def test_warm_up_keeps_within_the_stages_context(shipped, max_ctx):
    """The turns fit the trunk stage's own context bound, not the config's ``max_ctx`` (4,096 by default;
    a checkpoint's ``max_position_embeddings`` may be 256: such a server failed to load)."""
    trunk, drafters = _stages(shipped, max_ctx)
    spy = _Spy(trunk)
    assert len(warm_stages(spy, drafters, shipped.config)) == 8 and not trunk.states
    assert spy.calls.count("prime") == 8


def test_stages_that_cannot_serve_fail_the_warm_up(shipped):
    """A trunk whose prime, or whose verify, fails: the warm-up raises, naming the spec and the error (the
    model then fails to load with that message instead of failing clients' turns)."""
    trunk, drafters = _stages(shipped)
    with pytest.raises(RuntimeError, match=r"warm-up turn \(off\) failed: .*prime refused for the test"):
        warm_stages(_Spy(trunk, fail="prime"), drafters, shipped.config)
    trunk, drafters = _stages(shipped)
    with pytest.raises(RuntimeError, match=r"warm-up turn \(\w+(, sampled)?\) failed: .*verify refused for the test"):
        warm_stages(_Spy(trunk, fail="verify"), drafters, shipped.config)
