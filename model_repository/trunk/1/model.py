"""Triton adapter for the `trunk` model: tandem.stages.TrunkStage behind tandem.bls.TrunkService."""

import json

import triton_python_backend_utils as pb_utils

from tandem import bls
from tandem.engine import parse_dtype
from tandem.stages import TrunkStage
from tandem.trunk import load_trunk

INPUTS = ("OP", "SIDS", "TOKENS", "LENGTHS", "N_ROWS")


class TritonPythonModel:
    def initialize(self, args):
        bls.set_torch_threads(1)
        params = bls.model_parameters(json.loads(args["model_config"]))
        ckpt = bls.resolve_checkpoint(params, args["model_repository"])
        dtype = bls.resolve_dtype(params)
        self.service = bls.TrunkService(TrunkStage(load_trunk(ckpt, parse_dtype(dtype))))
        pb_utils.Logger.log_info(f"trunk: loaded {ckpt} ({dtype})")

    def execute(self, requests):
        return bls.execute_service(pb_utils, self.service, requests, INPUTS, log=pb_utils.Logger.log_error)

    def finalize(self):
        self.service = None
