"""Triton adapter for the `postprocessing` model (a step of `ensemble`): pb_utils tensors <->
tandem.serving.text.Postprocessor.handle. No torch in this process."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema, schema_text
from tandem.model.tokenizer import ChatTokenizer
from tandem.serving import backend, text


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        backend.require_one_instance(config, backend.IN_ORDER)
        ckpt = backend.resolve_checkpoint(
            backend.serving_config(config), args["model_repository"], require_weights=False
        )
        self.step = text.Postprocessor(ChatTokenizer(ckpt / "tokenizer.json"), cancel=self._cancel)

    def _cancel(self, sid, turn):
        """BLS: a CANCEL request to tandem for turn ``turn`` of session ``sid`` (a client left the ensemble)."""
        import numpy as np

        req = pb_utils.InferenceRequest(
            model_name=schema.TANDEM.name,
            requested_output_names=[],
            correlation_id=sid,
            inputs=[
                pb_utils.Tensor(schema.CANCEL, np.array([True])),
                pb_utils.Tensor(schema.CANCEL_TURN, np.array([turn], np.int64)),
                pb_utils.Tensor(schema.MAX_TOKENS, np.array([1], np.int32)),
            ],
        )
        try:
            for _ in req.exec(decoupled=True):
                pass
        except Exception as e:  # noqa: BLE001 - the turn then runs to its max_tokens
            pb_utils.Logger.log_error(f"postprocessing: could not cancel turn {turn} of session {sid}: {e}")

    def execute(self, requests):
        return backend.stage_execute(
            pb_utils, schema_text.POSTPROCESSING, self.step, requests, on_cancelled=self.step.cancelled
        )
