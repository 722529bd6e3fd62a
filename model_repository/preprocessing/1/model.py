"""Triton adapter for the `preprocessing` model (a step of `ensemble`): pb_utils tensors <->
tandem.serving.text.Preprocessor.handle. No torch in this process."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema_text
from tandem.model.config import TrunkConfig
from tandem.model.tokenizer import ChatTokenizer
from tandem.serving import backend, text


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        cfg = backend.serving_config(config)
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"], require_weights=False)
        max_ctx = min(cfg.max_ctx, TrunkConfig.load(ckpt).max_position_embeddings)  # as the tandem model's
        self.step = text.Preprocessor(ChatTokenizer(ckpt / "tokenizer.json"), max_ctx)

    def execute(self, requests):
        return backend.stage_execute(pb_utils, schema_text.PREPROCESSING, self.step, requests, with_sequence=True)
