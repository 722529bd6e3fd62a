"""Triton adapter for the decoupled `tandem` model: forwards to tandem.serving.tandem_model.TandemModel
(the engine core, its stages and the response sender, in this process)."""

import triton_python_backend_utils as pb_utils

from tandem.serving.tandem_model import TandemModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = TandemModel(pb_utils, args)

    def execute(self, requests):
        self.model.execute(requests)
        return None

    def finalize(self):
        self.model.finalize()
