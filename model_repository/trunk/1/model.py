"""Triton adapter for the decoupled `trunk` model: pb_utils tensors <-> tandem.engine.trunk_stage.TrunkStage.handle,
run in arrival order by the compute thread of tandem.serving.stage_worker.StageWorker."""

import functools
import json

import triton_python_backend_utils as pb_utils

from tandem import schema
from tandem.model.warm import compile_kernels
from tandem.engine.colocated import StageHost
from tandem.engine.trunk_stage import TrunkStage
from tandem.model import cpu_decode
from tandem.model.checkpoint import dflash_arms, dflash_feature_layers, load_dflash, load_trunk
from tandem.model.cpu_amx import gemm_tiles
from tandem.model.device import placement
from tandem.serving import backend
from tandem.serving.memory import Trimmer
from tandem.serving.stage_worker import StageWorker, set_thread_nice
from tandem.serving.warmup import warm_stage


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        backend.dump_stacks_on_signal()
        backend.require_one_instance(config)
        backend.set_torch_threads(1)
        self.gauges = backend.Gauges(pb_utils, config["name"], backend.STAGE_GAUGES)
        self.stats = backend.CallStats()
        self.trimmer = Trimmer()
        compile_kernels()  # from numba's disk cache (make setup fills it); else compiled now
        cfg = backend.serving_config(config)
        ckpt = backend.resolve_checkpoint(cfg, args["model_repository"])
        dirs = backend.drafter_dirs(cfg, args["model_repository"], ckpt)
        features = dflash_feature_layers(ckpt, dirs)
        dev, dt = placement(cfg)
        self.stage = TrunkStage(
            load_trunk(ckpt, dt, device=dev),
            feature_layers=features,
            batch_invariant=cfg.batch_invariant,
            decode_threads=cfg.decode_threads,
        )
        if cfg.colocate:  # the drafters run here, on the trunk's embedding and LM head: one call a round
            self.stage = StageHost.build(
                self.stage,
                {a: load_dflash(ckpt, a, dt, dirs[a], dev) for a in dflash_arms(ckpt, dirs)},
                cfg.max_num_draft_tokens,
                run_ahead=cfg.run_ahead,
            )
            if cfg.run_ahead:  # the speculative call's thread yields the GIL to the stub's soon
                backend.share_the_gil()
        warm = warm_stage(self.stage, cfg)  # the first client turn finds the kernels' layouts built
        pb_utils.Logger.log_info(
            f"trunk: loaded {ckpt} ({dt} on {dev}, batch_invariant={cfg.batch_invariant}, GEMM tiles "
            f"{gemm_tiles()}), "
            f"DFlash features from layers {list(features)}, drafters hosted: "
            f"{sorted(getattr(self.stage, 'drafters', {})) if cfg.colocate else 'none (colocate off)'}"
            f"{', run_ahead' if cfg.colocate and cfg.run_ahead else ''}; "
            f"warm-up turns {sum(warm.values()):.2f} s ({', '.join(warm)})"
        )

        # execute only queues: Triton hands this process the next request (a pipelined call) while one runs;
        # the compute thread and the decode threads run ahead of the server's other threads (compute_nice)
        cpu_decode.set_pool_initializer(functools.partial(set_thread_nice, cfg.compute_nice))
        self.worker = StageWorker(
            self._run,
            pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            pb_utils.Logger.log_error,
            "trunk",
            nice=cfg.compute_nice,
        )
        pb_utils.Logger.log_info(f"trunk: compute thread at {self.worker.priority}")

    def _run(self, request):
        held = len(self.stage.states)
        response = backend.stage_response(
            pb_utils, schema.TRUNK, self.stage, request, stats=self.stats, only_requested=True
        )
        self.gauges.set({"stage_sequences": len(self.stage.states)})
        if len(self.stage.states) < held:  # sessions closed: their memory goes back to the system (memory.py)
            self.trimmer.closed()
        self.trimmer.after_request()  # (the front's idle probes reach here too: a flood's last closes are trimmed)
        return response

    def execute(self, requests):
        self.worker.submit(requests)
        return None

    def finalize(self):
        self.worker.stop()
        ahead = getattr(self.stage, "ahead", None)
        runs = f"; {ahead.summary()}" if ahead is not None else ""
        pb_utils.Logger.log_info(f"trunk: handled {self.stats.summary()}{runs}")
        pb_utils.Logger.log_info(f"trunk: compute thread {self.worker.summary()}")  # read by the bench (bench_report)
