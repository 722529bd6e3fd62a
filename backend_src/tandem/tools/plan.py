"""The memory plan of a checkpoint on a group of devices: weights per rank, one session's state per rank at
``max_ctx``, and how many sessions fit.

``python -m tandem.tools.plan [CHECKPOINT] --devices 8 --memory-gb 80 --dtype fp8 [--max-ctx 4096]`` (no
CHECKPOINT, or ``--default``: the real GLM-5.3-Flash, transformers' default ``glm5_next`` config). Exit status 1
when the weights do not fit, with both numbers.

Weights are counted on the meta device (nothing is allocated) from the model tandem builds:

- **dtype**: ``bf16`` keeps every weight in bf16 (``A_log``, ``dt_bias`` and the router's bias in fp32);
  ``fp8`` stores the released FP8 set (:func:`tandem.model.layout.in_fp8_set`: the MLA/DSA projections, the dense
  and shared MLPs, the routed experts) at one byte an element plus one fp32 scale per 128 x 128 block, the rest
  as ``bf16``.
- **per rank** with ``--devices N`` as one tensor-parallel group: attention heads (KDA, MLA, the indexer's query
  heads), the dense MLP and the shared expert split N ways by tensor parallelism, the routed experts N ways by
  expert parallelism, the embedding and LM heads by vocabulary; the norms, the low-rank down projections
  (``q_a_proj``, ``kv_a_proj_with_mqa``, the KDA gates' ``f_a`` / ``g_a``), the indexer's key projection, the
  router, the mHC mixers and the MTP layer's ``eh_proj`` are kept whole on every rank (as vLLM's DeepSeek and
  Kimi-Linear layers keep them).

A session's state per rank at ``max_ctx`` tokens (:mod:`tandem.engine.state_size`'s buffers, in bf16 on a GPU):
per MLA/DSA layer (the MTP layer's included: its drafter state) and token the latent and the indexer's key and
gate whole, the decompressed keys and values split by heads, one compressed pool key per ``index_kpool`` tokens (not
the MTP layer's); per KDA layer its recurrent state and conv tail split by heads. ``--reserve`` of each device (default 10%, as vLLM's
``gpu_memory_utilization`` 0.9) is left for activations, the CUDA context and the allocator.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from ..model.config import TrunkConfig
from ..model.parallel import WEIGHT_DTYPES as DTYPES
from ..model.parallel import split_bytes as weight_bytes

app = typer.Typer(add_completion=False)

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checkpoint's memory on ``devices`` devices of ``memory`` bytes each, in ``dtype``: ``params``, the
    weights' ``total`` bytes and ``per_rank``, one ``session`` per rank at ``max_ctx`` tokens, the ``usable``
    bytes a device gives (after ``--reserve``) and the ``sessions`` that fit (0 when the weights do not)."""

    params: int
    total: int
    per_rank: int
    session: int
    max_ctx: int
    devices: int
    memory: int
    dtype: str
    usable: int
    sessions: int

    @property
    def fits(self) -> bool:
        return self.per_rank < self.usable

    def lines(self) -> list[str]:
        """The plan as a user reads it."""
        g = lambda b: f"{b / GIB:,.1f} GiB" if b >= GIB / 10 else f"{b / 2**20:,.1f} MiB"  # noqa: E731
        out = [
            f"{self.params / 1e9:.2f}B parameters, {g(self.total)} of weights in {self.dtype}",
            f"{self.devices} x {self.memory / 1e9:,.0f} GB ({g(self.memory)}): {g(self.per_rank)} of weights per rank, "
            f"{g(self.usable)} usable per device",
            f"one session at {self.max_ctx:,} tokens: {self.session / 2**20:,.1f} MiB per rank",
        ]
        if self.fits:
            out.append(
                f"fits: {g(self.usable - self.per_rank)} per rank left for sessions, "
                f"{self.sessions:,} sessions of {self.max_ctx:,} tokens"
            )
        else:
            out.append(
                f"does not fit: the weights need {g(self.per_rank)} per rank, a device gives {g(self.usable)}; "
                "use more devices (tensor parallelism), larger ones" + (", or fp8" if self.dtype != "fp8" else "")
            )
        return out


def session_bytes(cfg: TrunkConfig, tokens: int, devices: int = 1, element: int = 2) -> int:
    """Bytes of one session's trunk state per rank at ``tokens`` tokens, ``element`` bytes an element (see the
    module)."""
    H = cfg.num_attention_heads
    n_mla = cfg.layer_types.count("indexed_attention")
    n_kda = cfg.layer_types.count("linear_attention")
    whole = cfg.kv_lora_rank + 2 * cfg.index_head_dim
    heads = H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    rows = (n_mla + 1) * tokens * (whole + -(-heads // devices))  # (+1: the MTP layer's rows, its drafter state)
    mla = rows + n_mla * (tokens // cfg.index_kpool) * cfg.index_head_dim
    lh, ld, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    kda = n_kda * -(-(lh * ld * ld + 3 * lh * ld * (K - 1)) // devices)
    return element * (mla + kda)


def plan(cfg: TrunkConfig, devices: int, memory: int, dtype: str, max_ctx: int = 4096, reserve: float = 0.1) -> Plan:
    """The :class:`Plan` of ``cfg`` on ``devices`` devices of ``memory`` bytes each."""
    params, total, per_rank = weight_bytes(cfg, dtype, devices)
    session = session_bytes(cfg, max_ctx, devices)
    usable = int(memory * (1 - reserve))
    sessions = max(0, (usable - per_rank) // session) if per_rank < usable else 0
    return Plan(params, total, per_rank, session, max_ctx, devices, memory, dtype, usable, sessions)


@app.command()
def main(
    checkpoint: Path = typer.Argument(None, help="checkpoint folder (default: the real GLM-5.3-Flash config)"),
    devices: int = typer.Option(8, min=1, help="devices in the tensor-parallel group"),
    memory_gb: float = typer.Option(80.0, min=0.1, help="memory of each device, GB (1e9 bytes, as GPUs are sold)"),
    dtype: str = typer.Option("fp8", help=" | ".join(DTYPES)),
    max_ctx: int = typer.Option(4096, min=1, help="tokens of context a session holds"),
    reserve: float = typer.Option(0.1, min=0.0, max=0.9, help="share of each device left for activations"),
) -> None:
    """Print the memory plan; exit status 1 when the weights do not fit, or the model does not split ``devices``
    ways (the server would refuse it: :func:`~tandem.model.parallel.local_config`)."""
    from ..model.parallel import TensorParallel, local_config

    if dtype not in DTYPES:
        typer.echo(f"--dtype must be one of {DTYPES}, got {dtype!r}", err=True)
        raise typer.Exit(2)
    try:
        if checkpoint is None:
            cfg, what = TrunkConfig.from_dict({"model_type": "glm5_next_text"}), "GLM-5.3-Flash (the default config)"
        else:
            cfg, what = TrunkConfig.load(checkpoint), str(checkpoint)
    except (OSError, ValueError) as e:
        typer.echo(f"tandem: {checkpoint}: {e}", err=True)
        raise typer.Exit(2)
    try:
        local_config(cfg, TensorParallel(0, devices))
    except ValueError as e:
        typer.echo(f"memory plan of {what}\n  does not split over {devices} devices: {e}", err=True)
        raise typer.Exit(1)
    p = plan(cfg, devices, int(memory_gb * 1e9), dtype, max_ctx, reserve)
    typer.echo(f"memory plan of {what}")
    for line in p.lines():
        typer.echo("  " + line)
    if not p.fits:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
