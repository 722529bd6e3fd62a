"""Triton adapter for the `drafter_mtp` model: forwards to tandem.serving.drafter_models.DrafterMTPModel."""

import triton_python_backend_utils as pb_utils

from tandem.serving.drafter_models import DrafterMTPModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = DrafterMTPModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)
