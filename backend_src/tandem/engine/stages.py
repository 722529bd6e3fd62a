"""The drafter stages an engine core runs beside its trunk (``colocate``): the trunk's MTP layer and the
checkpoint's DFlash drafters, on the trunk's embedding and LM head."""

from __future__ import annotations

from .. import schema
from .dflash_stage import DFlashStage
from .drafter_stage import DrafterStage
from .mtp_stage import MTPStage


def drafter_stages(
    model,
    dflash: dict | None = None,
    max_num_draft_tokens: int = schema.DEFAULTS.max_num_draft_tokens,
    threads: int = schema.DEFAULTS.split_threads,
) -> dict[str, DrafterStage]:
    """Spec -> drafter stage over the trunk ``model``: its MTP layer (when the checkpoint has one) and one
    :class:`~tandem.engine.dflash_stage.DFlashStage` for ``dflash`` (spec ->
    :class:`~tandem.model.dflash.DFlashDrafter`) on the trunk's embedding and LM head, its compiled rounds split across
    ``threads`` (``split_threads``). The in-process
    :class:`~tandem.engine.inprocess.Engine` and the served engine core (:mod:`tandem.serving.tandem_model`)
    build their drafters with it."""
    drafters: dict[str, DrafterStage] = {}
    if model.mtp is not None:
        drafters[schema.MTP] = MTPStage(model, max_num_draft_tokens)
    if dflash:
        stage = DFlashStage(dict(dflash), model.embed_tokens, model.lm_head, max_num_draft_tokens, threads)
        drafters.update({spec: stage for spec in dflash})
    return drafters
