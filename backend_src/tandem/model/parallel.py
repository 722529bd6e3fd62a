"""Tensor and expert parallelism of the trunk over ``torch.distributed`` (gloo on the CPU, NCCL on CUDA).

One rank of a group of ``N`` holds (Megatron-LM's split, Shoeybi et al. 2019, as vLLM and SGLang apply it to
DeepSeek-style layers):

- **attention by heads**: a KDA layer's ``q/k/v`` projections, conv channels, gates and ``o_proj`` input
  columns; an MLA layer's ``q_b_proj`` / ``kv_b_proj`` heads and ``o_proj`` input columns; the DSA indexer's
  query heads (``wq_b``, ``weights_proj``), whose pool scores are summed across ranks before the top-k;
- **the dense MLP and the shared expert by their intermediate width** (``gate/up`` rows, ``down`` columns);
- **the routed experts by expert** (expert parallelism): rank ``r`` holds experts ``[r E/N, (r+1) E/N)``; the
  router runs whole on every rank and each rank adds the tokens' weights of its own experts;
- **the embedding and the LM head by vocabulary**: rank ``r`` holds rows ``[r V/N, (r+1) V/N)``; a lookup is
  summed across ranks, the logits gathered.

Every rank keeps whole what is small or low-rank: the norms, the mHC mixers, ``q_a_proj``,
``kv_a_proj_with_mqa``, the KDA gates' ``f_a`` / ``g_a``, the indexer's key side and the router. A block's
attention and FFN outputs are partial sums, reduced across ranks (one all-reduce each). The MTP layer is not
split: a tensor-parallel trunk is built without it.

The split runs without the CPU's compiled kernels, which stay single-rank: the torch path on the CPU; on CUDA
the Triton kernels but the DSA indexer's (its pool scores sum every rank's heads, which the torch path
all-reduces), so a rank's FP8 weights take the block-scaled FP8 GEMM. Each rank
reads its part of each tensor from the checkpoint (:func:`shard_span`; safetensors slices, its own experts only),
whole only for the KDA convs and FP8 weights, which it slices after reading.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TrunkConfig


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, on the default process group
    (``torch.distributed.init_process_group`` has run)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (a new contiguous tensor)."""
        import torch.distributed as dist

        y = x.contiguous().clone()
        dist.all_reduce(y)
        return y

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [..., n]`` concatenated in rank order along the last dimension: ``[..., N n]``."""
        import torch.distributed as dist

        parts = [torch.empty_like(x.contiguous()) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, -1)

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``n`` rows split evenly. Raises ``ValueError`` naming ``what`` when
        ``n`` does not divide by :attr:`size`."""
        if n % self.size:
            raise ValueError(f"tensor_parallel {self.size}: {what} ({n}) must divide by it")
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k


def local_config(cfg: TrunkConfig, tp: TensorParallel) -> TrunkConfig:
    """The config one rank's modules are built from: head counts, the dense MLP's width, the routed experts and
    the vocabulary divided by ``tp.size``. Raises ``ValueError`` naming a size that does not divide."""
    n = tp.size
    for name in ("num_attention_heads", "linear_num_heads", "index_n_heads", "intermediate_size", "n_routed_experts"):
        tp.span(getattr(cfg, name), name)
    tp.span(cfg.vocab_size, "vocab_size")
    tp.span(cfg.moe_intermediate_size * cfg.n_shared_experts, "moe_intermediate_size x n_shared_experts")
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // n,
        linear_num_heads=cfg.linear_num_heads // n,
        index_n_heads=cfg.index_n_heads // n,
        intermediate_size=cfg.intermediate_size // n,
        n_routed_experts=cfg.n_routed_experts // n,
    )


class VocabEmbedding(nn.Module):
    """An embedding split by vocabulary: ``weight [V/N, D]`` holds rows ``[start, start + V/N)``; a lookup
    ``ids [...] -> [..., D]`` sums every rank's rows (each id is found on one rank)."""

    def __init__(self, vocab: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.num_embeddings = tp, vocab
        self.start, end = tp.span(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(end - self.start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        e = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(e)


class VocabHead(nn.Module):
    """An LM head split by vocabulary: ``weight [V/N, D]``; ``h [..., D] -> [..., V]`` (every rank's logits
    gathered)."""

    def __init__(self, dim: int, vocab: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.out_features, self.in_features = tp, vocab, dim
        start, end = tp.span(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(end - start, dim))
        self.bias = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(h, self.weight))


def split_trunk(model: nn.Module, cfg: TrunkConfig, tp: TensorParallel) -> nn.Module:
    """Make a trunk built (on the meta device) from :func:`local_config` one rank's: the vocabulary-split
    embedding and head, each MoE's router whole and its shared expert split, its experts told their first id,
    the indexers their whole head count, every module the group (``tp``). Returns ``model``."""
    from .layers import MLP, Experts, MoE, Router
    from .mla import Indexer

    local = model.cfg
    model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
    model.lm_head = VocabHead(cfg.hidden_size, cfg.vocab_size, tp)
    for m in model.modules():
        if isinstance(m, MoE):
            m.gate = Router(cfg)
            m.shared_experts = MLP(local, cfg.moe_intermediate_size * cfg.n_shared_experts // tp.size)
        elif isinstance(m, Experts):
            m.first = tp.span(cfg.n_routed_experts, "n_routed_experts")[0]
        elif isinstance(m, Indexer):
            m.heads_total = cfg.index_n_heads
        m.tp = tp
    model.cfg = cfg
    return model


#: KDA conv weights ``[3C, 1, K]``: q, k and v channels in turn, each split by heads
_CONV = re.compile(r"\.conv1d\.weight$")


def shard_span(name: str, full: tuple[int, ...], like: tuple[int, ...], tp: TensorParallel):
    """Which part of the checkpoint tensor of shape ``full`` parameter ``name`` of local shape ``like`` takes on
    this rank: None (whole), ``(dim, start, end)`` (rank ``r``'s ``1/N`` along the one dimension that differs), or
    ``"conv"`` (a KDA conv: the q, k and v thirds each split). Raises ``ValueError`` naming a tensor whose shapes
    do not split that way."""
    if tuple(full) == tuple(like):
        return None
    if _CONV.search(name):
        return "conv"
    dims = [d for d in range(len(full)) if full[d] != like[d]]
    if len(full) != len(like) or len(dims) != 1 or full[dims[0]] != tp.size * like[dims[0]]:
        raise ValueError(f"{name}: {list(full)} does not split {tp.size} ways into {list(like)}")
    return (dims[0], *tp.span(full[dims[0]], name))


def shard(name: str, full: torch.Tensor, like: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of the checkpoint tensor ``full`` for parameter ``name`` of local shape ``like``
    (:func:`shard_span`)."""
    span = shard_span(name, tuple(full.shape), tuple(like.shape), tp)
    if span is None:
        return full
    if span == "conv":
        c = full.shape[0] // 3
        a, b = tp.span(c, name)
        return torch.cat([full[i * c + a : i * c + b] for i in range(3)])
    return full.narrow(span[0], span[1], span[2] - span[1])


#: weight dtypes :func:`split_bytes` counts
WEIGHT_DTYPES = ("fp8", "bf16", "fp32")
#: tensors every rank holds whole (in-memory names, :mod:`tandem.model.trunk`); every other tensor is split
_WHOLE = re.compile(
    r"(norm|layernorm)\.(weight|bias)$|_hc\.|\.(q_a_proj|kv_a_proj_with_mqa|f_a_proj|g_a_proj)\.weight$"
    r"|indexer\.(wk|k_norm|index_kpool_compress_ape|index_kpool_compress_gate)|mlp\.gate\.|e_score_correction_bias"
    r"|\.eh_proj\.|\.(enorm|hnorm)\."
)
_MTP_HEAD = re.compile(r"^layers\.\d+\.shared_head\.head\.weight$")


def _fp8_bytes(shape: tuple[int, ...], block: int = 128) -> int:
    """Bytes of an FP8 weight ``[..., r, c]``: one byte an element and an fp32 scale per ``block`` square."""
    lead = math.prod(shape[:-2])
    return lead * (shape[-2] * shape[-1] + 4 * math.ceil(shape[-2] / block) * math.ceil(shape[-1] / block))


def split_bytes(cfg: TrunkConfig, dtype: str, devices: int = 1) -> tuple[int, int, int]:
    """``(parameters, total bytes, bytes per rank)`` of the trunk (its MTP layer included) built from ``cfg`` in
    ``dtype`` (:data:`WEIGHT_DTYPES`; ``fp8``: the released FP8 set at a byte an element plus its block scales, the
    rest bf16) over ``devices`` ranks, counted on the meta device (see the module for what is split)."""
    from .layout import in_fp8_set, release_names
    from .trunk import Trunk, is_fp32_param

    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    with torch.device("meta"):
        model = Trunk(cfg, with_mtp=True)
    mla = {i for i, t in enumerate(cfg.layer_types) if t == "indexed_attention"} | {cfg.num_hidden_layers}
    n = total = rank = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n += t.numel()
        if is_fp32_param(name):
            b = 4 * t.numel()
        elif dtype == "fp8" and all(in_fp8_set(k, mla) for k in release_names(name, t)):
            b = _fp8_bytes(tuple(t.shape))
        else:
            b = (4 if dtype == "fp32" else 2) * t.numel()
        total += b
        rank += b if _WHOLE.search(name) and not _MTP_HEAD.match(name) else -(-b // devices)
    return n, total, rank
