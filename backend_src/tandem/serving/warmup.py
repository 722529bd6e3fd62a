"""Warm-up turns run in the engine core's process at load, before the ``tandem`` model reports ready.

The serving layout builds parts of itself on first use (each weight's packed kernel layout and each
block's plan, :mod:`tandem.ops.cpu.gemm`, :mod:`tandem.ops.cpu.block`): without a warm-up the
first client turn paid it, ~50 ms of a prime and ~60 ms of the first MTP turn on 2 cores (a turn
that takes ~8 ms warm). Triton's own ``model_warmup`` cannot drive a sequence through the engine's
rounds, so the engine core runs short turns of every spec its stages serve, in a scheduler of its own.
"""

from __future__ import annotations

import dataclasses
import time

from .. import schema
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Scheduler
from ..engine.session import Turn

#: the warm-up turns' prompt (tokens) and length (tokens generated)
PROMPT_TOKENS, MAX_TOKENS = 24, 8
#: warm-up sequence ids: the top of the int64 range (closed before any client can send one)
FIRST_SID = (1 << 62) + 1


def warm_stages(trunk, drafters: dict, config: schema.ServingConfig = schema.DEFAULTS) -> dict[str, float]:
    """Run a greedy and a sampled turn of each spec, in this process.

    ``trunk``: the :class:`~tandem.engine.trunk_stage.TrunkStage`; ``drafters``: spec -> drafter stage or proxy
    (the engine core's); ``config``: the serving config (the prefix cache is left off, so nothing is published; the
    context bound is the trunk stage's ``max_ctx``). Each turn is ``PROMPT_TOKENS`` prompt tokens and ``MAX_TOKENS``
    generated (fewer when the context is shorter), in a sequence that is closed at its end.

    Returns ``{"<spec>" or "<spec>+sampled": seconds}``. Raises ``RuntimeError`` when a turn fails
    (the stages could not serve one; the model should not load) and ``AssertionError`` when a
    sequence stays open afterwards.
    """
    vocab_size = trunk.vocab_size
    cfg = dataclasses.replace(config, prefix_cache_mb=0, max_ctx=min(config.max_ctx, trunk.max_ctx))
    sched = Scheduler(trunk, drafters, cfg)
    n_prompt = max(1, min(PROMPT_TOKENS, cfg.max_ctx // 2))  # a short context (a test trunk) takes shorter turns
    n_new = max(1, min(MAX_TOKENS, cfg.max_ctx - n_prompt - 1))
    prompt = [(37 * i + 11) % (vocab_size - 1) + 1 for i in range(n_prompt)]
    took: dict[str, float] = {}
    sid = FIRST_SID
    for spec in (schema.OFF, *sorted(drafters)):
        for sampled in (False, True):
            errors: list[str] = []
            params = SamplingParams.create(0.8, 0, 0.95, seed=7) if sampled else None
            t0 = time.perf_counter()
            try:  # a failed stage call raises out of the scheduler (the front ends turns with it)
                sched.admit(
                    [
                        Turn(
                            sid,
                            prompt,
                            n_new,
                            lambda r, err, final: err and errors.append(err),
                            spec=spec,
                            sampling=params,
                        )
                    ]
                )
                while sid in sched.turns:
                    sched.burst()
            except Exception as e:  # noqa: BLE001 - any failure means the stage cannot serve
                errors.append(str(e))
            took[spec + ("+sampled" if sampled else "")] = time.perf_counter() - t0
            if errors:
                raise RuntimeError(f"warm-up turn ({spec}{', sampled' if sampled else ''}) failed: {errors[0]}")
            sid += 1
    sched.expire_idle(now=float("inf"))  # sends the batched close of the ended sequences
    assert not sched.sessions and not trunk.states, (list(sched.sessions), list(trunk.states))
    return took
