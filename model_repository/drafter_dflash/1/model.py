"""Triton adapter for the `drafter_dflash` model: pb_utils tensors <-> tandem.engine.dflash_stage.DFlashStage.handle.

A checkpoint without DFlash drafters still loads; its draft requests are answered with an error."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema
from tandem.engine.dflash_stage import DFlashStage
from tandem.model.checkpoint import dflash_arms, load_dflash, load_trunk
from tandem.model.device import kernel_settings, placement
from tandem.serving import backend


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        backend.require_one_instance(config)
        backend.set_torch_threads(1)
        self.gauges = backend.Gauges(pb_utils, config["name"], backend.STAGE_GAUGES)
        cfg = backend.serving_config(config)
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"])
        dirs = backend.drafter_dirs(cfg, args["model_repository"], ckpt)
        (dev, dt), arms = placement(cfg), dflash_arms(ckpt, dirs)
        self.stage = None
        if arms:
            trunk = load_trunk(
                ckpt, dt, with_mtp=False, device=dev, kernels=kernel_settings(cfg)
            )  # for its embedding and LM head
            self.stage = DFlashStage(
                {a: load_dflash(ckpt, a, dt, dirs[a], dev, kernel_settings(cfg)) for a in arms},
                trunk.embed_tokens,
                trunk.lm_head,
                cfg.max_num_draft_tokens,
            )
        pb_utils.Logger.log_info(
            f"drafter_dflash: {ckpt} ({dt} on {dev}), drafters {({a: str(d) for a, d in dirs.items()}) or 'none'}"
        )

    def execute(self, requests):
        return backend.stage_execute(
            pb_utils,
            schema.DRAFTER_DFLASH,
            self.stage,
            requests,
            self.gauges,
            None if self.stage else "SPEC: this checkpoint has no DFlash drafter (`make model` trains one)",
        )
