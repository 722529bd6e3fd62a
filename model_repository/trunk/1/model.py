"""Triton adapter for the `trunk` model: pb_utils tensors <-> tandem.engine.trunk_stage.TrunkStage.handle."""

import json

import triton_python_backend_utils as pb_utils

from tandem import schema
from tandem.model.warm import compile_kernels
from tandem.engine.trunk_stage import TrunkStage
from tandem.model.checkpoint import dflash_feature_layers, load_trunk, parse_dtype
from tandem.serving import backend


class TritonPythonModel:
    def initialize(self, args):
        backend.set_torch_threads(1)
        compile_kernels()  # from numba's disk cache (make setup fills it); else compiled now
        cfg = backend.serving_config(json.loads(args["model_config"]))
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"])
        features = dflash_feature_layers(ckpt)
        self.stage = TrunkStage(load_trunk(ckpt, parse_dtype(cfg.dtype)), feature_layers=features,
                                batch_invariant=cfg.batch_invariant)
        pb_utils.Logger.log_info(f"trunk: loaded {ckpt} ({cfg.dtype}, batch_invariant={cfg.batch_invariant}), "
                                 f"DFlash features from layers {list(features)}")

    def execute(self, requests):
        responses = []
        for r in requests:
            try:
                arrays = {n: t.as_numpy() for n in schema.TRUNK.input_names
                          if (t := pb_utils.get_input_tensor_by_name(r, n)) is not None}
                out = self.stage.handle(arrays)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
            except Exception as e:  # noqa: BLE001 - a wire error names its field; anything else is reported
                msg = str(e) if isinstance(e, schema.WireError) else f"internal error: {type(e).__name__}: {e}"
                responses.append(pb_utils.InferenceResponse([], error=pb_utils.TritonError(msg)))
        return responses
