"""Triton adapter for the `drafter_dflash` model: pb_utils tensors <-> tandem.engine.dflash_stage.DFlashStage.handle.

A checkpoint without DFlash drafters still loads; its draft requests are answered with an error."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema
from tandem.engine.dflash_stage import DFlashStage
from tandem.model.checkpoint import dflash_arms, load_dflash, load_trunk, parse_dtype
from tandem.serving import backend


class TritonPythonModel:
    def initialize(self, args):
        backend.set_torch_threads(1)
        cfg = backend.serving_config(json.loads(args["model_config"]))
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"])
        dt, arms = parse_dtype(cfg.dtype), dflash_arms(ckpt)
        self.stage = None
        if arms:
            trunk = load_trunk(ckpt, dt, with_mtp=False)  # for its embedding and LM head
            self.stage = DFlashStage({a: load_dflash(ckpt, a, dt) for a in arms}, trunk.embed_tokens, trunk.lm_head,
                                     cfg.max_num_draft_tokens)
        pb_utils.Logger.log_info(f"drafter_dflash: {ckpt} ({cfg.dtype}), arms {arms or 'none'}")

    def execute(self, requests):
        responses = []
        for r in requests:
            try:
                if self.stage is None:
                    raise schema.WireError("SPEC: this checkpoint has no DFlash drafter (`make model` trains one)")
                arrays = {n: t.as_numpy() for n in schema.DRAFTER_DFLASH.input_names
                          if (t := pb_utils.get_input_tensor_by_name(r, n)) is not None}
                out = self.stage.handle(arrays)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
            except Exception as e:  # noqa: BLE001 - a wire error names its field; anything else is reported
                msg = str(e) if isinstance(e, schema.WireError) else f"internal error: {type(e).__name__}: {e}"
                responses.append(pb_utils.InferenceResponse([], error=pb_utils.TritonError(msg)))
        return responses
