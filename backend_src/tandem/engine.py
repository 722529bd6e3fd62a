"""In-process engine: load a checkpoint, build the stages and a scheduler, generate synchronously.

The same stages and scheduler run behind Triton; this is the reference the integration tests
compare the served stream against.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from .stages import MTPStage, TrunkStage
from .tokenizer import ChatTokenizer
from .trunk import Trunk, load_trunk
from .worker import Scheduler, Turn

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "model_repository" / "weights" / "tandem-tiny"

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"`` / ``"fp32"`` -> torch dtype. Raises ``ValueError`` otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


class Engine:
    """Trunk + MTP drafter + scheduler in one process.

    Args: ``checkpoint`` folder (config.json, model.safetensors, tokenizer.json); ``dtype``;
    ``k`` drafts per round; ``burst_rounds``; ``max_ctx`` tokens per session.
    """

    def __init__(self, checkpoint: str | Path = DEFAULT_CHECKPOINT, dtype: str | torch.dtype = "bf16",
                 k: int = 3, burst_rounds: int = 4, max_ctx: int = 4096, model: Trunk | None = None,
                 tokenizer: ChatTokenizer | None = None) -> None:
        dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.model = model if model is not None else load_trunk(checkpoint, dt)
        self.tokenizer = tokenizer if tokenizer is not None else ChatTokenizer(Path(checkpoint) / "tokenizer.json")
        self.trunk = TrunkStage(self.model, max_ctx)
        self.trunk.vocab_size = self.model.cfg.vocab_size
        self.drafter = MTPStage(self.model) if self.model.mtp is not None else None
        self.sched = Scheduler(self.trunk, self.drafter, k=k, burst_rounds=burst_rounds, max_ctx=max_ctx,
                               stop_ids=self.tokenizer.stop_ids)
        self._ids = itertools.count(1 << 40)

    def generate(self, prompt_ids: list[int], max_tokens: int = 128, spec: str = "mtp", k: int | None = None,
                 on_burst=None) -> dict:
        """Generate one turn in a fresh sequence. Returns ``token_ids``, ``rounds``, ``drafted``,
        ``accepted``, ``accepted_at``, ``mean_acceptance_length``, ``finish_reason``, ``ttft_s``,
        ``elapsed_s``, ``tokens_per_s``, ``bursts`` and ``top2_gaps``.

        Raises ``ValueError`` with the scheduler's message on bad input.
        """
        sid = next(self._ids)
        out = {"token_ids": [], "rounds": 0, "drafted": 0, "accepted": 0, "accepted_at": [], "finish_reason": None,
               "bursts": 0, "top2_gaps": [], "error": None}
        t0 = time.perf_counter()

        def emit(r, err, final):
            if err:
                out["error"] = err
                return
            if not out["token_ids"]:
                out["ttft_s"] = time.perf_counter() - t0
            out["token_ids"] += r.tokens
            out["rounds"] += r.rounds
            out["drafted"] += r.drafted
            out["accepted"] += r.accepted
            out["top2_gaps"] += r.top2_gaps
            if r.accepted_at:
                acc = out["accepted_at"]
                acc += [0] * (len(r.accepted_at) - len(acc))
                for i, v in enumerate(r.accepted_at):
                    acc[i] += v
            out["bursts"] += 1
            if final:
                out["finish_reason"] = r.finish_reason
            if on_burst is not None:
                on_burst(r)

        self.sched.admit([Turn(sid, list(prompt_ids), max_tokens, emit, spec=spec, k=k)])
        while sid in self.sched.turns:
            self.sched.burst()
        if out["error"]:
            raise ValueError(out["error"])
        el = time.perf_counter() - t0
        out["elapsed_s"] = el
        out["tokens_per_s"] = len(out["token_ids"]) / el if el > 0 else 0.0
        out["mean_acceptance_length"] = 1.0 + out["accepted"] / out["rounds"] if out["rounds"] else 0.0
        return out
