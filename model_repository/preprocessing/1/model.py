"""Triton adapter for the `preprocessing` model: forwards to tandem.serving.text_models.PreprocessingModel."""

import triton_python_backend_utils as pb_utils

from tandem.serving.text_models import PreprocessingModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = PreprocessingModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)
