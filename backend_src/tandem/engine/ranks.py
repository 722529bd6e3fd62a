"""Tensor parallelism of the engine core's stages: one engine core over ``N`` ranks.

Rank 0 is the engine core's process (the ``tandem`` model's, or in-process): it runs the scheduler, the accept
walk and sampling, and holds its part of the trunk (:mod:`tandem.model.parallel`). Ranks ``1 .. N-1`` are
processes it starts (``python -m tandem.engine.ranks``), each holding its part of the trunk and the same stages
over it. Every stage call rank 0 makes goes first to the other ranks (:class:`RankedStage`: a broadcast of the
method's name and arguments), which replay it on their own stages, so the collectives inside the model's
forward (all-reduces after attention and FFN, the vocabulary gather) meet in the same order on every rank.

The drafters run on every rank whole (a DFlash drafter is small), over the trunk's vocabulary-split embedding
and LM head; the MTP layer is not split, so a tensor-parallel engine serves ``off``, ``dflash`` and
``dflash2``. Sampling parameters and structured-output constraints stay on rank 0: the other ranks compute
greedy targets they never use. Collectives: gloo on the CPU, NCCL on CUDA (``torch.distributed``, a TCP
rendezvous on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import schema
from ..model.parallel import TensorParallel
from .protocols import Rows

#: seconds rank 0 waits for the other ranks to join (each loads its part of the checkpoint first)
JOIN_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python() -> str:
    """A Python interpreter of this environment (inside Triton's stub ``sys.executable`` is not one)."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return str(Path(sys.prefix) / "bin" / "python")


def rank_device(device: str, rank: int) -> str:
    """Where rank ``rank`` holds its part: ``cuda:<rank>`` for a CUDA ``device`` (``auto`` with a GPU; a given
    index is replaced: each rank takes its own GPU), else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def _init(rank: int, size: int, port: int, device: str) -> TensorParallel:
    import torch.distributed as dist

    backend = "nccl" if rank_device(device, rank).startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=__import__("datetime").timedelta(seconds=JOIN_S),
    )
    return TensorParallel(rank, size)


def _for_ranks(x):
    """A call's argument as the other ranks get it: :class:`Rows` without rank 0's sampling and constraint."""
    if isinstance(x, Rows) and (x.sampling is not None or x.constraint is not None):
        return dataclasses.replace(x, sampling=None, constraint=None)
    if isinstance(x, list):
        return [_for_ranks(y) for y in x]
    return x


class Channel:
    """Rank 0's calls to the other ranks: one ``torch.distributed.broadcast_object_list`` a call."""

    def send(self, msg) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([msg], src=0)

    def recv(self):
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class RankedStage:
    """A stage on rank 0 whose every public method call is first sent to the other ranks (stage ``index`` of
    theirs) and then run here; attributes (the model and its modules among them) are this rank's."""

    def __init__(self, stage, index: int, channel: Channel) -> None:
        self.__dict__.update(_stage=stage, _index=index, _channel=channel)

    def __getattr__(self, name: str):
        v = getattr(self._stage, name)
        if name.startswith("_") or not inspect.ismethod(v):  # (a module attribute is callable, not a stage call)
            return v
        stage, index, channel = self._stage, self._index, self._channel

        def call(*args, **kwargs):
            channel.send((index, name, [_for_ranks(a) for a in args], {k: _for_ranks(a) for k, a in kwargs.items()}))
            return getattr(stage, name)(*args, **kwargs)

        return call

    def __setattr__(self, name: str, value) -> None:
        setattr(self._stage, name, value)


def weight_bytes(model) -> int:
    """Bytes of a model's parameters and buffers as held (one rank's part under tensor parallelism)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def build_stages(checkpoint, config: schema.ServingConfig, dtype, kernels, tp: TensorParallel, dflash_dirs=None):
    """One rank's trunk stage and drafter stages (the same on every rank): ``(trunk stage, {spec: drafter
    stage})`` over its part of the trunk on :func:`rank_device`, without the compiled CPU kernels (single-rank):
    the torch path on the CPU; on CUDA the Triton kernels but the DSA indexer's (its pool scores sum every rank's
    heads), so FP8 weights take the block-scaled FP8 GEMM."""
    from ..model.checkpoint import dflash_feature_layers, dflash_specs, load_dflash, load_trunk
    from .stages import drafter_stages
    from .trunk_stage import TrunkStage

    kernels = kernels.replace(numba=False)
    device = rank_device(config.device, tp.rank)
    model = load_trunk(checkpoint, dtype, kernels=kernels, tp=tp, device=device, fp8=config.fp8_weights)
    dflash = {
        spec: load_dflash(checkpoint, spec, model.dtype, device=model.device, kernels=kernels)
        for spec in dflash_specs(checkpoint)
    }
    layers = next(iter(dflash.values())).cfg.target_layer_ids if dflash else dflash_feature_layers(checkpoint)
    trunk = TrunkStage(model, config.max_ctx, tuple(layers), config.batch_invariant, 1, 1)
    return trunk, drafter_stages(model, dflash, config.max_num_draft_tokens, 1)


class RankGroup:
    """Rank 0's view of a tensor-parallel group of ``size``: :meth:`start` launches ranks ``1 .. size-1`` and joins
    them; :meth:`wrap` makes a stage a :class:`RankedStage`; :meth:`stop` ends the other ranks."""

    def __init__(self, size: int, procs: list[subprocess.Popen], tp: TensorParallel) -> None:
        self.size, self.procs, self.tp, self.channel = size, procs, tp, Channel()
        self._stages: list = []

    @classmethod
    def start(cls, size: int, checkpoint, config: schema.ServingConfig, dtype: str, log=None) -> "RankGroup":
        """Start ranks ``1 .. size-1`` (each loads its part of ``checkpoint``) and join them as rank 0. Raises
        ``RuntimeError`` when a rank exits before joining."""
        port = _free_port()
        procs = []
        cfg = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        for r in range(1, size):
            argv = [_python(), "-m", "tandem.engine.ranks", "--rank", str(r), "--size", str(size)]
            argv += ["--port", str(port), "--checkpoint", str(checkpoint), "--dtype", dtype, "--config", repr(cfg)]
            # a session of its own: the server's Ctrl-C reaches rank 0, which stops the rank (:meth:`stop`)
            procs.append(subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True))
        try:
            tp = _init(0, size, port, config.device)
        except Exception as e:
            for p in procs:
                p.kill()
            raise RuntimeError(f"tensor_parallel {size}: the other ranks did not join: {e}") from e
        if log is not None:
            log(f"tandem: tensor parallel {size}: ranks 1..{size - 1} joined (pids {[p.pid for p in procs]})")
        return cls(size, procs, tp)

    def wrap(self, stage):
        """``stage`` as a :class:`RankedStage` (the other ranks build theirs in the same order: :func:`build_stages`,
        the trunk first, then the distinct drafter stages by spec)."""
        self._stages.append(stage)
        return RankedStage(stage, len(self._stages) - 1, self.channel)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to exit and wait for them (killed after ``timeout_s``)."""
        import torch.distributed as dist

        try:
            self.channel.send(None)
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a rank already gone: stop the rest
            pass
        end = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


def stage_order(trunk, drafters: dict) -> list:
    """The stages in the order every rank wraps them: the trunk, then each distinct drafter stage by spec."""
    out, seen = [trunk], set()
    for spec in sorted(drafters):
        if id(drafters[spec]) not in seen:
            seen.add(id(drafters[spec]))
            out.append(drafters[spec])
    return out


def main(argv: list[str] | None = None) -> int:
    """A rank ``1 .. N-1``: join, build its stages, replay rank 0's calls until told to stop."""
    ap = argparse.ArgumentParser(description="a tandem tensor-parallel rank (started by rank 0)")
    for flag in ("--rank", "--size", "--port"):
        ap.add_argument(flag, type=int, required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--config", required=True)
    a = ap.parse_args(argv)
    import ast

    from ..model.checkpoint import parse_dtype
    from ..model.device import kernel_settings

    torch.set_num_threads(1)
    config = schema.ServingConfig(**ast.literal_eval(a.config))
    tp = _init(a.rank, a.size, a.port, config.device)
    trunk, drafters = build_stages(a.checkpoint, config, parse_dtype(a.dtype), kernel_settings(config, a.dtype), tp)
    from ..model.checkpoint import param_bytes

    one = param_bytes(trunk.model.cfg, trunk.model.dtype, with_mtp=True)[1]
    print(
        f"tandem: rank {a.rank} of {a.size}: {weight_bytes(trunk.model) / 2**20:.1f} MiB of trunk weights, "
        f"{weight_bytes(trunk.model) / one:.2f} of one rank's {one / 2**20:.1f} MiB",
        file=sys.stderr,
        flush=True,
    )
    stages = stage_order(trunk, drafters)
    channel = Channel()
    torch.set_grad_enabled(False)
    import torch.distributed as dist

    while True:
        try:
            msg = channel.recv()
        except RuntimeError as e:  # rank 0 is gone (its process ended without a stop): nothing left to serve
            print(f"tandem: rank {a.rank} of {a.size}: rank 0 went away ({str(e)[:120]}); exiting", file=sys.stderr)
            return 1
        if msg is None:
            break
        index, name, args, kwargs = msg
        try:
            getattr(stages[index], name)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - rank 0 met the same refusal (a stage checks before it computes)
            print(f"tandem: rank {a.rank}: {name} failed as on rank 0: {type(e).__name__}: {e}", file=sys.stderr)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
