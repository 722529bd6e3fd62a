"""Triton adapter for the `drafter_mtp` model: pb_utils tensors <-> tandem.engine.mtp_stage.MTPStage.handle."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema
from tandem.model.warm import compile_kernels
from tandem.engine.mtp_stage import MTPStage
from tandem.model.checkpoint import load_trunk
from tandem.model.device import kernel_settings, placement
from tandem.serving import backend


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        backend.require_one_instance(config)
        backend.set_torch_threads(1)
        self.gauges = backend.Gauges(pb_utils, config["name"], backend.STAGE_GAUGES)
        compile_kernels()  # from numba's disk cache (make setup fills it); else compiled now
        cfg = backend.serving_config(config)
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"])
        dev, dt = placement(cfg)
        self.stage = MTPStage(load_trunk(ckpt, dt, device=dev, kernels=kernel_settings(cfg)), cfg.max_num_draft_tokens)
        pb_utils.Logger.log_info(f"drafter_mtp: loaded {ckpt} ({dt} on {dev})")

    def execute(self, requests):
        return backend.stage_execute(pb_utils, schema.DRAFTER_MTP, self.stage, requests, self.gauges)
