"""Triton adapter for the `drafter_mtp` model: tandem.stages.MTPStage behind tandem.bls.DrafterService."""

import json

import triton_python_backend_utils as pb_utils

from tandem import bls
from tandem.engine import parse_dtype
from tandem.stages import MTPStage
from tandem.trunk import load_trunk

INPUTS = ("OP", "SIDS", "HIDDEN", "NEXT_TOKENS", "LENGTHS", "K")


class TritonPythonModel:
    def initialize(self, args):
        bls.set_torch_threads(1)
        params = bls.model_parameters(json.loads(args["model_config"]))
        ckpt = bls.resolve_checkpoint(params, args["model_repository"])
        dtype = bls.resolve_dtype(params)
        stage = MTPStage(load_trunk(ckpt, parse_dtype(dtype)))
        self.service = bls.DrafterService(stage, max_k=int(params.get("max_k", "16")))
        pb_utils.Logger.log_info(f"drafter_mtp: loaded {ckpt} ({dtype})")

    def execute(self, requests):
        return bls.execute_service(pb_utils, self.service, requests, INPUTS, log=pb_utils.Logger.log_error)

    def finalize(self):
        self.service = None
