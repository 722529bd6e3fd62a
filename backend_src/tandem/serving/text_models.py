"""The composition roots of the text front's models, steps of the ``ensemble``: ``preprocessing`` and
``postprocessing`` (:mod:`tandem.serving.text`). No torch in these processes.
``model_repository/{preprocessing,postprocessing}/1/model.py`` forward here with ``pb_utils`` passed in."""

from __future__ import annotations

import json

import numpy as np

from .. import schema, schema_text
from ..model.config import TrunkConfig
from ..model.tokenizer import ChatTokenizer
from .parameters import resolve_checkpoint, serving_config
from .process import IN_ORDER, dump_stacks_on_signal, require_one_instance
from .stage_io import stage_execute
from .text import Postprocessor, Preprocessor


class PreprocessingModel:
    """``preprocessing``: a user message rendered with the chat template and tokenized
    (:class:`Preprocessor`), bounded by the ``tandem`` model's context."""

    def __init__(self, pb_utils, args: dict) -> None:
        config = json.loads(args["model_config"])
        dump_stacks_on_signal()
        cfg = serving_config(config)
        ckpt = resolve_checkpoint(cfg, args["model_repository"], require_weights=False)
        max_ctx = min(cfg.max_ctx, TrunkConfig.load(ckpt).max_position_embeddings)  # as the tandem model's
        self.pb_utils = pb_utils
        self.step = Preprocessor(ChatTokenizer(ckpt / "tokenizer.json"), max_ctx)

    def execute(self, requests) -> list:
        return stage_execute(self.pb_utils, schema_text.PREPROCESSING, self.step, requests, with_sequence=True)


class PostprocessingModel:
    """``postprocessing``: each ``tandem`` response's tokens as text (:class:`Postprocessor`); one
    instance, so that a stream's responses leave in order. A client that leaves the ensemble cancels
    its turn in ``tandem`` (:meth:`cancel`)."""

    def __init__(self, pb_utils, args: dict) -> None:
        config = json.loads(args["model_config"])
        dump_stacks_on_signal()
        require_one_instance(config, IN_ORDER)
        ckpt = resolve_checkpoint(serving_config(config), args["model_repository"], require_weights=False)
        self.pb_utils = pb_utils
        self.step = Postprocessor(ChatTokenizer(ckpt / "tokenizer.json"), cancel=self.cancel)

    def cancel(self, sid: int, turn: int) -> None:
        """BLS: a CANCEL request to ``tandem`` for turn ``turn`` of session ``sid``. A failure is logged
        (the turn then runs to its ``MAX_TOKENS``), never raised."""
        pb = self.pb_utils
        req = pb.InferenceRequest(
            model_name=schema.TANDEM.name,
            requested_output_names=[],
            correlation_id=sid,
            inputs=[
                pb.Tensor(schema.CANCEL, np.array([True])),
                pb.Tensor(schema.CANCEL_TURN, np.array([turn], np.int64)),
                pb.Tensor(schema.MAX_TOKENS, np.array([1], np.int32)),
            ],
        )
        try:
            for _ in req.exec(decoupled=True):
                pass
        except Exception as e:  # noqa: BLE001 - the turn then runs to its max_tokens
            pb.Logger.log_error(f"postprocessing: could not cancel turn {turn} of session {sid}: {e}")

    def execute(self, requests) -> list:
        return stage_execute(
            self.pb_utils, schema_text.POSTPROCESSING, self.step, requests, on_cancelled=self.step.cancelled
        )
