"""The ``tandem`` Triton model's composition root: the engine core and its stages in this process.

``model_repository/tandem/1/model.py`` forwards ``initialize`` / ``execute`` / ``finalize`` here with
``pb_utils`` passed in. At load it builds the trunk stage (:class:`~tandem.engine.trunk_stage.TrunkStage`) and,
with ``colocate`` (the default), the drafter stages on the trunk's embedding and LM head, all in this process;
with ``colocate`` off the drafters are proxies of the ``drafter_mtp`` / ``drafter_dflash`` models over BLS, under
a stage deadline, probed while idle and restarted when their process dies. The engine core
(:class:`~tandem.serving.engine_core.EngineCore`: the scheduler on its worker thread) owns every session; ``execute``
only parses each request into a turn and queues it; a sender thread streams the responses
(:class:`~tandem.serving.send_queue.SendQueue`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json

import numpy as np

from .. import schema
from ..engine.calibration import calibrate
from ..engine.ranks import weight_bytes
from ..engine.round_costs import RoundCosts
from ..engine.stages import drafter_stages
from ..engine.state_size import StateSize
from ..engine.structured import Grammars
from ..engine.trunk_stage import TrunkStage
from ..model.checkpoint import dflash_specs, dflash_feature_layers, load_dflash, load_trunk
from ..ops import dispatch
from ..model.device import kernel_settings, placement
from ..model.tokenizer import ChatTokenizer
from . import engine_core, proxies, turns
from .metrics import Gauges, MetricsPublisher
from .parameters import drafter_dirs, resolve_checkpoint, serving_config
from .process import dump_stacks_on_signal, reload_model, require_one_instance, set_thread_nice, set_torch_threads
from .send_queue import SendQueue
from .stage_io import tensors_by_name
from .warmup import warm_stages


class TandemModel:
    """The ``tandem`` model's state and its three Triton entry points (``pb_utils``: the backend's module)."""

    def __init__(self, pb_utils, args: dict) -> None:
        pb = self.pb = pb_utils
        config = json.loads(args["model_config"])
        dump_stacks_on_signal()
        require_one_instance(config)
        if "sequence_batching" in config:  # Triton would hold each sequence in a slot of its own
            raise ValueError(
                "model 'tandem': remove sequence_batching from config.pbtxt (the engine core owns every "
                "session: idle expiry, max_sessions); requests still carry sequence_id and flags"
            )
        set_torch_threads(1)
        cfg = serving_config(config)
        repo = args["model_repository"]
        ckpt = resolve_checkpoint(cfg, repo)
        dirs = drafter_dirs(cfg, repo, ckpt)
        dev, dt = placement(cfg)
        kernels = kernel_settings(cfg)
        self.ranks = None
        log = pb.Logger.log_error
        specs = dflash_specs(ckpt, dirs)
        self.bls = watch = None
        if cfg.tensor_parallel > 1:  # rank 0 here, the other ranks started now (tandem.engine.ranks)
            model, trunk, drafters = self._start_ranks(cfg, ckpt, dt, kernels)
            cfg = dataclasses.replace(cfg, max_ctx=min(cfg.max_ctx, model.cfg.max_position_embeddings))
            self.max_ctx = cfg.max_ctx
        else:
            model = load_trunk(ckpt, dt, device=dev, kernels=kernels, fp8=cfg.fp8_weights)
            cfg = dataclasses.replace(cfg, max_ctx=min(cfg.max_ctx, model.cfg.max_position_embeddings))
            self.max_ctx = cfg.max_ctx
            trunk = TrunkStage(
                model,
                cfg.max_ctx,
                feature_layers=dflash_feature_layers(ckpt, dirs),
                batch_invariant=cfg.batch_invariant,
                decode_threads=cfg.decode_threads,
                split_threads=cfg.split_threads,
            )
            dispatch.set_pool_initializer(functools.partial(set_thread_nice, cfg.compute_nice))
            if cfg.colocate:  # the drafters here, on the trunk's embedding and LM head: a round crosses no process
                drafters = drafter_stages(
                    model,
                    {a: load_dflash(ckpt, a, dt, dirs[a], dev, kernels) for a in specs},
                    cfg.max_num_draft_tokens,
                    cfg.split_threads,
                )
            else:  # the drafter models over BLS, each call under the stage deadline
                self.bls = proxies.BLSTransport(pb)
                watch = proxies.WatchedTransport(self.bls, cfg.stage_timeout_s)
                drafters = {schema.MTP: proxies.DrafterProxy(watch, on_error=log)}
                dflash = proxies.DFlashProxy(watch, on_error=log)
                drafters.update({spec: dflash for spec in specs})
        # the first client turn finds the kernels' layouts built (BLS calls work only inside execute: with the
        # drafter models, the trunk alone); tensor parallelism runs no compiled CPU kernel: none to build
        warm = warm_stages(trunk, drafters if cfg.colocate else {}, cfg) if cfg.tensor_parallel == 1 else {}
        costs = RoundCosts()  # this machine's round costs, for the adaptive draft length (drafters over BLS: later)
        if cfg.adaptive_draft:
            warm["calibration"] = calibrate(trunk, drafters if cfg.colocate else {}, cfg, costs)
        tok = ChatTokenizer(ckpt / "tokenizer.json")
        self.gauges = gauges = Gauges(pb, "tandem", engine_core.GAUGES)
        self.core = engine_core.EngineCore(
            trunk,
            drafters,
            tok.stop_ids,
            cfg,
            log=log,
            decode=tok.decode,
            info=pb.Logger.log_info,
            watch=watch,
            restart=self._restart if watch is not None else None,
            gauges=gauges.set,
            state_size=StateSize.from_folders(ckpt, dirs),
            nice=cfg.compute_nice,
            exit_probe=self._server_exiting,
            costs=costs,
            grammars=Grammars(ckpt / "tokenizer.json", trunk.vocab_size, tok.stop_ids).load(),
        )
        self.metrics = MetricsPublisher(pb, self.core.telemetry)
        self.sends = SendQueue(self._response, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, log)
        costs_ms = (
            ", ".join(f"{k} {v:.2f}" for k, v in costs.summary().items())
            if costs.calibrated
            else "from the first rounds"
        )
        pb.Logger.log_info(
            f"tandem: loaded {ckpt} ({model.loaded_from}; {weight_bytes(model) / 2**20:.1f} MiB of trunk weights "
            f"held; {dt} on {dev}, batch_invariant={cfg.batch_invariant}, GEMM tiles "
            f"{dispatch.gemm_tiles(cfg.amx)}); drafters {sorted(drafters)} "
            f"{'in this process' if cfg.colocate else 'in their models (colocate off)'}, DFlash "
            f"drafters {({a: str(dirs[a]) for a in specs}) or 'none'}; "
            f"warm-up turns {sum(warm.values()):.2f} s ({', '.join(warm)}); round costs {costs_ms}; {cfg}"
        )

    def _start_ranks(self, cfg, ckpt, dt, kernels):
        """Tensor parallelism: start ranks ``1 .. N-1``, load rank 0's part of the trunk and the drafters, each
        stage behind a :class:`~tandem.engine.ranks.RankedStage`; log this rank's weight bytes against one rank's.
        Returns ``(model, trunk stage, drafters)``."""
        import torch

        from ..engine.ranks import RankGroup, build_stages, stage_order
        from ..model.checkpoint import param_bytes

        if not cfg.colocate:
            raise ValueError("tensor_parallel > 1 runs the drafters beside the trunk on every rank: set colocate true")
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dt]
        self.ranks = RankGroup.start(cfg.tensor_parallel, ckpt, cfg, name, log=self.pb.Logger.log_info)
        trunk, drafters = build_stages(ckpt, cfg, dt, kernels, self.ranks.tp)
        wrapped = {id(st): self.ranks.wrap(st) for st in stage_order(trunk, drafters)}
        one = param_bytes(trunk.model.cfg, dt, with_mtp=True)[1]
        mine = weight_bytes(trunk.model)
        self.pb.Logger.log_info(
            f"tandem: rank 0 of {cfg.tensor_parallel}: {mine / 2**20:.1f} MiB of trunk weights, "
            f"{mine / one:.2f} of one rank's {one / 2**20:.1f} MiB (no compiled CPU kernels; drafters {sorted(drafters)} on every rank)"
        )
        return trunk.model, wrapped[id(trunk)], {spec: wrapped[id(st)] for spec, st in drafters.items()}

    def _response(self, arrays, error):
        pb = self.pb
        if error is not None:
            return pb.InferenceResponse([], error=pb.TritonError(error))
        return pb.InferenceResponse([pb.Tensor(k, v) for k, v in arrays.items()])

    def _server_exiting(self) -> bool:
        """Whether the server has begun to exit: a no-op ``CANCEL`` sent to this model (sequence 0, which no
        session has) is then refused "Server not ready" (Triton takes no new request once it exits)."""
        pb = self.pb
        req = pb.InferenceRequest(
            model_name=schema.TANDEM.name,
            requested_output_names=[],
            correlation_id=0,
            inputs=[
                pb.Tensor(schema.CANCEL, np.array([True])),
                pb.Tensor(schema.MAX_TOKENS, np.array([1], np.int32)),
            ],
        )
        try:
            for resp in req.exec(decoupled=True):
                if resp.has_error():
                    return "not ready" in resp.error().message().lower()
        except Exception as e:  # noqa: BLE001 - the exec raises what the server answered
            return "not ready" in str(e).lower()
        return False

    def _restart(self, model: str) -> None:
        # pb_utils.load_model holds the GIL until the model is loaded (seconds): the turns' errors first
        self.sends.flush()
        reload_model(self.pb, model)

    def execute(self, requests) -> None:
        """Parse each request into a turn (or a ``CANCEL``) and queue it; every answer is streamed later."""
        for request in requests:
            send, is_cancelled = self.sends.stream(request.get_response_sender(), request.requested_output_names())
            arrays = tensors_by_name(request.inputs(), schema.TANDEM.input_names)
            if schema.CANCEL in arrays and bool(arrays[schema.CANCEL].reshape(-1)[0]):
                number = arrays.get(schema.CANCEL_TURN)
                self.core.cancel_session(
                    int(request.correlation_id()), send, None if number is None else int(number.reshape(-1)[0])
                )
                continue
            try:
                turn = turns.parse_turn(arrays, request.correlation_id(), request.flags(), self.max_ctx)
            except schema.WireError as e:
                self.core.reject(send, str(e))
                continue
            self.core.submit(turn, send, is_cancelled)

    def finalize(self) -> None:
        self.core.stop()
        if self.ranks is not None:
            self.ranks.stop()
        self.sends.close()
        self.metrics.stop()
        self.gauges.release()
        calls = f"; BLS calls {self.bls.stats.summary()}" if self.bls is not None else ""
        self.pb.Logger.log_info(f"tandem: engine core thread {self.core.priority}{calls}")
        # Triton's objects the turns held (response senders, in closures) and the metrics are released here, while
        # the stub runs: left to the interpreter's exit, their destructors crash the stub once the grammar engine's
        # native libraries are loaded (they change the exit's order)
        self.core = self.sends = self.metrics = self.gauges = None
        gc.collect()
