"""Triton adapter for the `postprocessing` model: forwards to tandem.serving.text_models.PostprocessingModel."""

import triton_python_backend_utils as pb_utils

from tandem.serving.text_models import PostprocessingModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = PostprocessingModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)
