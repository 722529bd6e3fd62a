"""Triton adapter for the `preprocessing` model (a step of `ensemble`): pb_utils tensors <->
tandem.serving.text.Preprocessor.handle. No torch in this process."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema_text
from tandem.model.tokenizer import ChatTokenizer
from tandem.serving import backend, text


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        ckpt = backend.resolve_checkpoint(backend.serving_config(config), args["model_repository"], require_weights=False)
        self.step = text.Preprocessor(ChatTokenizer(ckpt / "tokenizer.json"))

    def execute(self, requests):
        return backend.stage_execute(pb_utils, schema_text.PREPROCESSING, self.step, requests, with_sequence=True)
