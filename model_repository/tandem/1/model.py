"""Triton adapter for the decoupled `tandem` model: pb_utils requests -> tandem.serving.front (parse,
worker thread over BLS stage proxies) -> one streamed response per burst, sent by the thread of
tandem.serving.backend.SendQueue."""

import dataclasses
import json

import triton_python_backend_utils as pb_utils

from tandem import schema
from tandem.engine.state_size import StateSize
from tandem.model.checkpoint import dflash_arms
from tandem.model.config import TrunkConfig
from tandem.model.tokenizer import ChatTokenizer
from tandem.serving import backend, front

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _response(arrays, error):
    if error is not None:
        return pb_utils.InferenceResponse([], error=pb_utils.TritonError(error))
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in arrays.items()])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        backend.require_one_instance(config)
        if "sequence_batching" in config:  # Triton would hold each sequence in a slot of its own
            raise ValueError(
                "model 'tandem': remove sequence_batching from config.pbtxt (the worker owns every "
                "session: idle expiry, max_sessions); requests still carry sequence_id and flags"
            )
        backend.set_torch_threads(1)
        cfg = backend.serving_config(config)
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"], require_weights=False)
        tcfg = TrunkConfig.load(ckpt)
        cfg = dataclasses.replace(cfg, max_ctx=min(cfg.max_ctx, tcfg.max_position_embeddings))
        self.max_ctx = cfg.max_ctx
        log = pb_utils.Logger.log_error
        self.bls = front.BLSTransport(pb_utils)
        watch = front.WatchedTransport(self.bls, cfg.stage_timeout_s)
        # pipeline: the next draft_verify waits in Triton's queue while the trunk runs one; any other call waits for it
        transport = self.pipe = front.Pipeline(watch) if cfg.colocate and cfg.pipeline else watch
        to_drafters = front.HostedTransport(transport) if cfg.colocate else transport  # colocate: the trunk runs them
        drafters = {schema.MTP: front.DrafterProxy(to_drafters, on_error=log)}
        dflash = front.DFlashProxy(to_drafters, on_error=log)
        dirs = backend.drafter_dirs(cfg, args["model_repository"], ckpt)
        drafters.update({arm: dflash for arm in dflash_arms(ckpt, dirs)})
        gauges = backend.Gauges(pb_utils, "tandem", front.GAUGES)
        tok = ChatTokenizer(ckpt / "tokenizer.json")
        self.front = front.TandemFront(
            front.TrunkProxy(transport, tcfg.vocab_size, on_error=log, hosted=cfg.colocate),
            drafters,
            tok.stop_ids,
            cfg,
            log=log,
            decode=tok.decode,
            info=pb_utils.Logger.log_info,
            watch=watch,
            restart=self._restart,
            gauges=gauges.set,
            standby=(front.DrafterProxy(transport), front.DFlashProxy(transport)) if cfg.colocate else (),
            state_size=StateSize.from_folders(ckpt, dirs),
        )
        self.metrics = backend.MetricsPublisher(pb_utils, self.front.telemetry)
        self.sends = backend.SendQueue(
            _response, FINAL, log, barrier=self.bls.held
        )  # responses leave off the worker's path
        pb_utils.Logger.log_info(f"tandem: checkpoint {ckpt}, {cfg}")

    def _restart(self, model):
        # pb_utils.load_model holds the GIL until the model is loaded (seconds): the turns' errors first
        self.sends.flush()
        backend.reload_model(pb_utils, model)

    def execute(self, requests):
        for request in requests:
            send, is_cancelled = self.sends.stream(request.get_response_sender(), request.requested_output_names())
            arrays = backend.tensors_by_name(request.inputs(), schema.TANDEM.input_names)
            if schema.CANCEL in arrays and bool(arrays[schema.CANCEL].reshape(-1)[0]):
                number = arrays.get(schema.CANCEL_TURN)
                self.front.cancel_session(
                    int(request.correlation_id()), send, None if number is None else int(number.reshape(-1)[0])
                )
                continue
            try:
                turn = front.parse_turn(arrays, request.correlation_id(), request.flags(), self.max_ctx)
            except schema.WireError as e:
                self.front.reject(send, str(e))
                continue
            self.front.submit(turn, send, is_cancelled)
        return None

    def finalize(self):
        self.front.stop()
        self.sends.close()
        self.metrics.stop()
        self.bls.decoupled.stop()
        pb_utils.Logger.log_info(
            f"tandem: BLS calls {self.bls.stats.summary()}"
            + (f"; pipelined {self.pipe.counts}" if isinstance(self.pipe, front.Pipeline) else "")
        )
