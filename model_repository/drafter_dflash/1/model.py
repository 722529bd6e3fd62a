"""Triton adapter for the `drafter_dflash` model: forwards to tandem.serving.drafter_models.DrafterDFlashModel."""

import triton_python_backend_utils as pb_utils

from tandem.serving.drafter_models import DrafterDFlashModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = DrafterDFlashModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)
