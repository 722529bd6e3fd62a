"""The round costs measured at load (:class:`~tandem.engine.round_costs.RoundCosts`): short turns through the
engine core's own stages, so the draft-length policy (:mod:`tandem.engine.draft_length`) knows this machine's
costs before the first client turn. The serving engine core runs it after its warm-up turns; an in-process
:class:`~tandem.engine.inprocess.Engine` at construction (once per trunk and settings: :func:`shared_costs`).
"""

from __future__ import annotations

import dataclasses
import time
import weakref

from .. import schema
from .round_costs import RoundCosts
from .scheduler import Scheduler
from .session import Turn

#: the calibration turns' prompt (tokens) and the tokens they generate: plain, then per spec at its default
#: drafts (a DFlash block's, MTP's ``num_draft_tokens``) and at one draft (the verify pass at two row counts), a
#: DFlash spec's both one call a round and in compiled rounds (:mod:`tandem.engine.compiled_rounds`)
PROMPT_TOKENS, PLAIN_TOKENS, SPEC_TOKENS = 32, 48, 24
#: calibration sequence ids: high in the int64 range, apart from the warm-up turns' (closed before any client)
FIRST_SID = (1 << 62) + (1 << 20)

_SHARED: "weakref.WeakKeyDictionary[object, dict[tuple, RoundCosts]]" = weakref.WeakKeyDictionary()


def shared_costs(model, config: schema.ServingConfig) -> RoundCosts:
    """The costs measured for ``model`` (a trunk) under ``config``'s settings that change them (the row-invariant
    mode, the decode threads, the DFlash block): one object for every engine on that trunk in this process."""
    key = (
        config.batch_invariant,
        config.decode_threads,
        config.split_threads,
        config.block_size,
        config.num_draft_tokens,
    )
    return _SHARED.setdefault(model, {}).setdefault(key, RoundCosts())


def calibrate(trunk, drafters: dict, config: schema.ServingConfig, costs: RoundCosts) -> float:
    """Measure ``costs`` with turns in a scheduler of its own over ``trunk`` (a trunk stage) and ``drafters``
    (spec -> stage; those callable here): a plain turn (the compiled plain rounds), and per spec one turn at its
    most drafts and one at a single draft (a DFlash spec's both as rounds one call at a time and as compiled rounds),
    each twice (the first warms what a process builds on first use, then
    the measures start anew). The draft length is fixed (``adaptive_draft`` off), the prefix cache off.

    Returns the seconds it took. Raises ``RuntimeError`` when a turn fails (the stages cannot serve one)."""
    t0 = time.perf_counter()
    cfg = dataclasses.replace(
        config, prefix_cache_mb=0, adaptive_draft=False, burst_ms=0, max_ctx=min(config.max_ctx, trunk.max_ctx)
    )
    n_prompt = max(1, min(PROMPT_TOKENS, cfg.max_ctx // 4))
    vocab = trunk.vocab_size
    prompt = [(53 * i + 7) % (vocab - 1) + 1 for i in range(n_prompt)]
    turns = [(schema.OFF, None, PLAIN_TOKENS, False)]
    for spec in sorted(drafters):
        most = cfg.block_size - 1 if spec in schema.DFLASH_SPECS else cfg.num_draft_tokens
        kinds = (False, True) if spec in schema.DFLASH_SPECS and cfg.compiled_spec_rounds else (False,)
        turns += [(spec, k, SPEC_TOKENS, compiled) for compiled in kinds for k in (most, 1)]
    sid = FIRST_SID
    for measuring in (False, True):
        if measuring:
            costs.reset()
        costs.calibrating = measuring
        scheds = {
            c: Scheduler(trunk, drafters, dataclasses.replace(cfg, compiled_spec_rounds=c), costs=costs)
            for c in (False, True)
        }
        for spec, k, n, compiled in turns:
            sched = scheds[compiled]
            errors: list[str] = []
            n = max(1, min(n, cfg.max_ctx - n_prompt - 1))
            sched.admit([Turn(sid, prompt, n, lambda r, e, f: e and errors.append(e), spec=spec, num_draft_tokens=k)])
            while sid in sched.turns:
                sched.burst()
            if errors:
                raise RuntimeError(f"calibration turn ({spec}, {k} drafts) failed: {errors[0]}")
            sid += 1
        for sched in scheds.values():
            sched.expire_idle(now=float("inf"))
    costs.calibrating = False
    costs.calibrated = True
    return time.perf_counter() - t0
