"""The composition roots of the separate drafter models (``colocate`` off): ``drafter_mtp`` and
``drafter_dflash``, each a stage (:class:`~tandem.engine.mtp_stage.MTPStage`,
:class:`~tandem.engine.dflash_stage.DFlashStage`) keyed by sequence id, called by the engine core over
BLS. ``model_repository/drafter_{mtp,dflash}/1/model.py`` forward ``initialize`` / ``execute`` here with
``pb_utils`` passed in."""

from __future__ import annotations

import json

from .. import schema
from ..engine.dflash_stage import DFlashStage
from ..engine.mtp_stage import MTPStage
from ..model.checkpoint import dflash_specs, load_dflash, load_trunk
from ..model.device import kernel_settings, placement
from ..model.warm import compile_kernels
from .metrics import STAGE_GAUGES, Gauges
from .parameters import drafter_dirs, resolve_checkpoint, serving_config
from .process import dump_stacks_on_signal, require_one_instance, set_torch_threads
from .stage_io import stage_execute


class _DrafterModel:
    """What both drafter models do at load: stack dumps, one instance, one torch thread, the
    ``stage_sequences`` gauge, and the configuration. Raises what :func:`serving_config` and
    :func:`resolve_checkpoint` raise."""

    def __init__(self, pb_utils, args: dict) -> None:
        config = json.loads(args["model_config"])
        dump_stacks_on_signal()
        require_one_instance(config)
        set_torch_threads(1)
        self.pb_utils = pb_utils
        self.gauges = Gauges(pb_utils, config["name"], STAGE_GAUGES)
        self.config = serving_config(config)
        self.repository = args["model_repository"]
        self.checkpoint = resolve_checkpoint(self.config, self.repository)


class DrafterMTPModel(_DrafterModel):
    """``drafter_mtp``: the trunk's own MTP layer as a drafter (:class:`MTPStage`)."""

    def __init__(self, pb_utils, args: dict) -> None:
        super().__init__(pb_utils, args)
        compile_kernels()  # from numba's disk cache (make setup fills it); else compiled now
        dev, dt = placement(self.config)
        trunk = load_trunk(
            self.checkpoint, dt, device=dev, kernels=kernel_settings(self.config), fp8=self.config.fp8_weights
        )
        self.stage = MTPStage(trunk, self.config.max_num_draft_tokens)
        pb_utils.Logger.log_info(f"drafter_mtp: loaded {self.checkpoint} ({dt} on {dev})")

    def execute(self, requests) -> list:
        return stage_execute(self.pb_utils, schema.DRAFTER_MTP, self.stage, requests, self.gauges)


class DrafterDFlashModel(_DrafterModel):
    """``drafter_dflash``: the checkpoint's DFlash block drafters (:class:`DFlashStage`). A checkpoint
    without one still loads; its draft requests are answered with an error naming ``SPEC``."""

    def __init__(self, pb_utils, args: dict) -> None:
        super().__init__(pb_utils, args)
        ckpt = self.checkpoint
        dirs = drafter_dirs(self.config, self.repository, ckpt)
        (dev, dt), specs = placement(self.config), dflash_specs(ckpt, dirs)
        self.stage = None
        if specs:
            kernels = kernel_settings(self.config)
            trunk = load_trunk(
                ckpt, dt, with_mtp=False, device=dev, kernels=kernels, fp8=self.config.fp8_weights
            )  # its embedding and LM head
            self.stage = DFlashStage(
                {a: load_dflash(ckpt, a, dt, dirs[a], dev, kernels) for a in specs},
                trunk.embed_tokens,
                trunk.lm_head,
                self.config.max_num_draft_tokens,
                self.config.split_threads,
            )
        pb_utils.Logger.log_info(
            f"drafter_dflash: {ckpt} ({dt} on {dev}), drafters {({a: str(d) for a, d in dirs.items()}) or 'none'}"
        )

    def execute(self, requests) -> list:
        unavailable = None if self.stage else "SPEC: this checkpoint has no DFlash drafter (`make model` trains one)"
        return stage_execute(self.pb_utils, schema.DRAFTER_DFLASH, self.stage, requests, self.gauges, unavailable)
