"""In-process engine: load a checkpoint, build the stages and a scheduler, generate synchronously.

The same stages and scheduler run behind Triton; this is the reference the integration tests
compare the served stream against.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch

from .. import schema
from ..model.checkpoint import (
    DEFAULT_CHECKPOINT,
    dflash_specs,
    dflash_feature_layers,
    load_dflash,
    load_trunk,
    parse_dtype,
)
from ..model.device import kernel_settings as kernel_settings_of
from ..ops.settings import KernelSettings
from ..model.tokenizer import ChatTokenizer
from ..model.trunk import Trunk
from .stages import drafter_stages
from .calibration import calibrate, shared_costs
from .prefix import PrefixIndex
from .round_costs import RoundCosts
from .sampling import SamplingParams
from .scheduler import Scheduler, Turn
from .state_size import StateSize
from .structured import Grammars
from .trunk_stage import TrunkStage


class Engine:
    """Trunk + drafters (the MTP layer; the DFlash drafters the checkpoint holds) + scheduler in one process.

    Args: ``checkpoint`` folder (config.json, model.safetensors, tokenizer.json, optional
    ``dflash/`` and ``dflash2/`` drafters); ``dtype`` (``"auto"``: fp32 here on the CPU with bf16 GEMM inputs, ``"bf16"``, ``"fp32"``: fp32 GEMM inputs too, or a torch dtype);
    ``model``/``tokenizer`` to share loaded ones; ``dflash`` — spec -> drafter to use instead of the
    checkpoint's (e.g. a freshly trained one);
    ``config`` overrides (any :class:`~tandem.schema.ServingConfig` field, e.g.
    ``num_draft_tokens=1``, ``burst_rounds=2``, ``max_ctx=256``; ``amx``, ``kernels`` and ``dtype`` make the kernel
    settings :attr:`kernels` the models, shared ones included, run with); ``kernel_settings`` to give those
    settings whole instead (e.g. :data:`tandem.ops.settings.REFERENCE`); ``costs`` the round costs the adaptive
    draft length weighs (default: measured once per trunk and settings, :func:`~tandem.engine.calibration.calibrate`).
    """

    def __init__(
        self,
        checkpoint: str | Path = DEFAULT_CHECKPOINT,
        dtype: str | torch.dtype = schema.DEFAULTS.dtype,
        model: Trunk | None = None,
        tokenizer: ChatTokenizer | None = None,
        dflash: dict | None = None,
        kernel_settings: KernelSettings | None = None,
        costs: RoundCosts | None = None,
        **config,
    ) -> None:
        dt = dtype
        self.config = dataclasses.replace(schema.DEFAULTS, **config)
        if isinstance(dtype, str):
            dt = parse_dtype(dtype)
        #: the kernel settings the models run with (a shared ``model`` or ``dflash`` drafters too)
        self.kernels = kernel_settings or kernel_settings_of(self.config, dtype if isinstance(dtype, str) else None)
        #: the tensor-parallel group (:class:`~tandem.engine.ranks.RankGroup`; None: one rank), stopped by :meth:`close`
        self.ranks = None
        if self.config.tensor_parallel > 1:
            self._start_ranks(checkpoint, dtype, model, dflash)
            self.tokenizer = tokenizer if tokenizer is not None else ChatTokenizer(Path(checkpoint) / "tokenizer.json")
            dflash = {spec: st.drafters[spec] for spec, st in self._local_drafters.items()}
        else:
            if model is not None:
                model.use_kernels(self.kernels)
            self.model = (
                model
                if model is not None
                else load_trunk(checkpoint, dt, kernels=self.kernels, fp8=self.config.fp8_weights)
            )
            self.tokenizer = tokenizer if tokenizer is not None else ChatTokenizer(Path(checkpoint) / "tokenizer.json")
            if dflash is None:
                dflash = {
                    spec: load_dflash(checkpoint, spec, self.model.dtype, kernels=self.kernels)
                    for spec in dflash_specs(checkpoint)
                }
            else:
                for d in dflash.values():
                    d.use_kernels(self.kernels)
            feature_layers = (
                next(iter(dflash.values())).cfg.target_layer_ids if dflash else dflash_feature_layers(checkpoint)
            )
            self.trunk = TrunkStage(
                self.model,
                self.config.max_ctx,
                tuple(feature_layers),
                self.config.batch_invariant,
                self.config.decode_threads,
                self.config.split_threads,
            )
            self.drafters: dict = drafter_stages(
                self.model, dflash, self.config.max_num_draft_tokens, self.config.split_threads
            )
        #: the measured round costs the draft-length policy weighs (one per trunk and settings in this process,
        #: measured at the first engine that needs them; or the ``costs`` given)
        self.costs = costs if costs is not None else shared_costs(self.model, self.config)
        if (
            costs is None
            and self.config.adaptive_draft
            and not (self.costs.calibrated and self.costs.known(self.drafters))
        ):
            calibrate(self.trunk, self.drafters, self.config, self.costs)
        self.sched = Scheduler(
            self.trunk,
            self.drafters,
            self.config,
            stop_ids=self.tokenizer.stop_ids,
            decode=getattr(self.tokenizer, "decode", None),  # None: no stop strings
            state_size=StateSize.from_configs(
                self.model.cfg.to_hf_dict(), {a: d.cfg.__dict__ for a, d in dflash.items()}
            ),
            costs=self.costs,
            grammars=Grammars(Path(checkpoint) / "tokenizer.json", self.model.cfg.vocab_size, self.tokenizer.stop_ids),
        )
        self._ids = itertools.count(1 << 40)

    def _start_ranks(self, checkpoint, dtype, model, dflash) -> None:
        """Start the tensor-parallel ranks and make this process rank 0 (:mod:`tandem.engine.ranks`): its part of the
        trunk, the drafters, each stage behind a :class:`~tandem.engine.ranks.RankedStage`."""
        from .ranks import RankGroup, build_stages, stage_order

        if model is not None or dflash is not None:
            raise ValueError("tensor_parallel > 1 loads its own part of the checkpoint: pass no model or dflash")
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.").replace("float32", "fp32")
        name = "fp32" if name == "auto" else name.replace("bfloat16", "bf16")
        self.ranks = RankGroup.start(self.config.tensor_parallel, checkpoint, self.config, name)
        trunk, drafters = build_stages(checkpoint, self.config, parse_dtype(name), self.kernels, self.ranks.tp)
        wrapped = {id(st): self.ranks.wrap(st) for st in stage_order(trunk, drafters)}
        self.model, self.trunk = trunk.model, wrapped[id(trunk)]
        self.drafters = {spec: wrapped[id(st)] for spec, st in drafters.items()}
        self._local_drafters = {spec: st for spec, st in drafters.items() if spec in schema.DFLASH_SPECS}

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    def reset_prefix_cache(self) -> None:
        """Forget every published prefix (index and stores): the next prompts start cold."""
        if self.sched.prefix is not None:
            self.sched.prefix = PrefixIndex(self.sched.prefix.capacity, self.sched.prefix.hasher)
        self.trunk.blocks.clear()
        for stage in {id(d): d for d in self.drafters.values()}.values():
            getattr(stage, "tails", {}).clear()

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int = 128,
        spec: str | None = None,
        num_draft_tokens: int | None = None,
        on_burst=None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        sampling: str = schema.REJECTION,
        stop_token_ids: tuple[int, ...] = (),
        stop: tuple[str, ...] = (),
        cache_salt: str = "",
        response_format: str | dict | None = None,
    ) -> dict:
        """Generate one turn in a fresh sequence (``temperature`` 0: greedy; else sampled with
        ``top_k``, ``top_p``, ``seed`` — None: a fresh one — and ``sampling`` mode, see
        :mod:`tandem.engine.sampling`; ``stop_token_ids`` and ``stop`` strings end the turn too; ``cache_salt``: the
        prefix-cache namespace, see :mod:`tandem.engine.prefix`; ``response_format``: structured output, the
        ``RESPONSE_FORMAT`` JSON text or its object, see :mod:`tandem.engine.structured`). Returns ``token_ids``, ``rounds``, ``drafted``,
        ``accepted``, ``accepted_at``, ``mean_acceptance_length`` (None without verify rounds),
        ``finish_reason``, ``ttft_s``, ``elapsed_s``, ``tokens_per_s``, ``bursts`` and ``top2_gaps``;
        ``on_burst(receipt)`` sees each burst.

        Raises ``ValueError`` with the scheduler's message on bad input.
        """
        params = SamplingParams.create(temperature, top_k, top_p, seed, sampling) if temperature else None
        sid = next(self._ids)
        out = {
            "token_ids": [],
            "rounds": 0,
            "spec_rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "accepted_at": [],
            "finish_reason": None,
            "bursts": 0,
            "top2_gaps": [],
            "error": None,
            "ttft_s": None,
            "stop_string": "",
        }
        t0 = time.perf_counter()

        def emit(r, err, final):
            if err:
                out["error"] = err
                return
            if out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - t0
            out["token_ids"] += r.tokens
            for key in ("rounds", "spec_rounds", "drafted", "accepted"):
                out[key] += getattr(r, key)
            out["top2_gaps"] += r.top2_gaps
            acc = out["accepted_at"]
            acc += [0] * (len(r.accepted_at) - len(acc))
            for i, v in enumerate(r.accepted_at):
                acc[i] += v
            out["bursts"] += 1
            if final:
                out["finish_reason"], out["stop_string"] = r.finish_reason, r.stop_string
            if on_burst is not None:
                on_burst(r)

        self.sched.admit(
            [
                Turn(
                    sid,
                    list(prompt_ids),
                    max_tokens,
                    emit,
                    spec=spec,
                    num_draft_tokens=num_draft_tokens,
                    sampling=params,
                    stop_token_ids=tuple(stop_token_ids),
                    stop=tuple(stop),
                    cache_salt=cache_salt,
                    response_format=json.dumps(response_format)
                    if isinstance(response_format, dict)
                    else (response_format or ""),
                )
            ]
        )
        while sid in self.sched.turns:
            self.sched.burst()
        if out["error"]:
            raise ValueError(out["error"])
        el = time.perf_counter() - t0
        out["elapsed_s"] = el
        out["tokens_per_s"] = len(out["token_ids"]) / el if el > 0 else 0.0
        out["mean_acceptance_length"] = 1.0 + out["accepted"] / out["rounds"] if out["rounds"] else None
        return out
