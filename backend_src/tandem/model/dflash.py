"""The DFlash block drafter (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv:2602.06036) and its DFlash2 additions, in tandem's own torch code.

The drafter has no embedding or LM head of its own: it reads the trunk's (``embed``, ``head``
arguments). It is conditioned on the trunk's hidden states after ``target_layer_ids`` (the mean of
the mHC streams, concatenated ``[.., n_target * D]``), projected by ``fc`` and normalised by
``hidden_norm``; every drafter layer projects those context features with its own ``k_proj`` /
``v_proj`` and attends to them as extra keys and values. A block ``[anchor, MASK x (B-1)]`` is
drafted in one non-causal forward; the hidden of block position ``j >= 1`` gives the token at
``anchor position + j`` through the trunk's LM head.

DFlash2 adds (a) a two-tap depthwise causal convolution along the block around each sublayer
(before and after attention and MLP; identity at initialisation) and (b) a candidate selector:
the top-K tokens per block position, scored for adjacent pairs by ``U_t(b) + <A(a) * H(h_t), B(b)>``
(``U`` the drafter's logit, ``A``/``B`` low-rank predecessor / successor codebooks, ``H`` a
low-rank projection of the block hidden), and the path walked greedily from the anchor.

Positions use rotary embeddings (RoPE, Su et al. 2021) with absolute token positions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..ops import dispatch
from ..ops.settings import DEFAULT, KernelSettings

from .layers import RMSNorm, clamped_swiglu


@dataclasses.dataclass
class DFlashConfig:
    """Shape of a DFlash(2) drafter. ``hidden_size`` and ``vocab_size`` equal the trunk's;
    ``target_layer_ids`` index the trunk layers whose outputs condition it; ``block_size`` B is the
    block drafted per round (B - 1 drafts); ``selector_*`` and ``conv_taps`` are the DFlash2 parts."""

    hidden_size: int = 256
    vocab_size: int = 8192
    block_size: int = dataclasses.field(default=8, metadata={"doc": "anchor + drafts per round"})
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    head_dim: int = 64
    target_layer_ids: list[int] = dataclasses.field(
        default_factory=lambda: [5, 14, 24, 33, 42], metadata={"doc": "trunk layers read (GLM-5.3-Flash's)"}
    )
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    selector_rank: int = dataclasses.field(default=32, metadata={"doc": "DFlash2 codebook rank r"})
    swiglu_limit: float = 10.0
    selector_top_k: int = dataclasses.field(default=4, metadata={"doc": "DFlash2 candidates K per position"})
    conv_taps: int = dataclasses.field(default=2, metadata={"doc": "DFlash2 depthwise convolution taps"})

    @property
    def feature_size(self) -> int:
        """Width of the concatenated trunk features: ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def load(cls, folder: str | Path) -> "DFlashConfig":
        """Read ``config.json`` of a drafter checkpoint folder. Raises ``FileNotFoundError``, and
        ``ValueError`` naming a field tandem does not know."""
        d = json.loads(Path(folder, "config.json").read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(
            k
            for k in d
            if k not in names
            and k not in ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version")
        )
        if unknown:
            raise ValueError(f"{Path(folder, 'config.json')}: unknown field(s) {unknown}: tandem cannot honour them")
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        d = {"model_type": "dflash2", **dataclasses.asdict(self)}
        Path(folder, "config.json").write_text(json.dumps(d, indent=2) + "\n")


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [B, H, T, d]`` at positions ``pos [B, T]`` (or ``[T]``)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float().unsqueeze(-1) * inv  # [..., T, d/2]
    if ang.dim() == 3:
        ang = ang.unsqueeze(1)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class TwoTapConv(nn.Module):
    """Depthwise causal convolution along the block: ``y_t = w0 * x_t + w1 * x_{t-1}`` (``x_{-1} = 0``),
    per channel. ``[B, S, D] -> [B, S, D]``; identity at initialisation (``w0 = 1``, ``w1 = 0``)."""

    def __init__(self, dim: int, taps: int = 2) -> None:
        super().__init__()
        w = torch.zeros(taps, dim)
        w[0] = 1.0
        self.weight = nn.Parameter(w)

    def forward(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """``x [B, S, D]`` holding consecutive blocks of ``block`` positions each (the shift does not
        cross a block boundary)."""
        b, s, d = x.shape
        xb = x.view(b, s // block, block, d)
        y = xb * self.weight[0].to(x.dtype)
        for j in range(1, self.weight.shape[0]):
            y = y + F.pad(xb[:, :, :-j], (0, 0, j, 0)) * self.weight[j].to(x.dtype)
        return y.view(b, s, d)


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor]
) -> torch.Tensor:
    """Block attention of ``N = len(ctx_k)`` sequences (the reference of
    :func:`tandem.ops.triton.block_attention.block_attention`): ``q``, ``k``, ``v [1, H, N * S, d]`` hold
    the sequences' blocks of ``S`` rows in turn; the queries of block ``j`` attend, without a mask,
    to ``[ctx_k[j], block j's keys]`` (``ctx_k[j]``, ``ctx_v[j] [1, H, C_j, d]``, ``C_j >= 0``)
    with scale ``d ** -0.5``. Returns ``o [1, H, N * S, d]``."""
    n = q.shape[2] // len(ctx_k)
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, j * n : (j + 1) * n],
                torch.cat([ck, k[:, :, j * n : (j + 1) * n]], 2),
                torch.cat([cv, v[:, :, j * n : (j + 1) * n]], 2),
            )
            for j, (ck, cv) in enumerate(zip(ctx_k, ctx_v))
        ],
        2,
    )


class DFlashAttention(nn.Module):
    """Block queries over ``[context K/V, block K/V]``; per-head RMSNorm on q and k, RoPE."""

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.h, self.d = cfg.num_attention_heads, cfg.head_dim
        D, hd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        self.q_proj = nn.Linear(D, hd, bias=False)
        self.k_proj = nn.Linear(D, hd, bias=False)
        self.v_proj = nn.Linear(D, hd, bias=False)
        self.o_proj = nn.Linear(hd, D, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.theta = cfg.rope_theta

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values ``[B, H, T, d]`` of rows ``x [B, T, D]`` at ``pos``."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.h, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        return rope(k, pos, self.theta), v

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, ctx_k, ctx_v, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [B, S, D]`` block rows at ``pos``; ``ctx_k/v [B, H, C, d]``; ``mask [B or 1, S, C + S]``
        (True = visible; None = everything visible). Returns ``[B, S, D]``. With ``ctx_k``/``ctx_v``
        lists (one ``[1, H, C_i, d]`` per sequence, ``B = 1``), ``x`` holds the sequences' blocks in
        turn, equal in size; the projections run over all rows, attention per sequence (no mask)."""
        b, s, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(b, s, self.h, self.d)).transpose(1, 2), pos, self.theta)
        k, v = self.kv(x, pos)
        if isinstance(ctx_k, list):
            o = dispatch.block_attention(self.kernels, x, q, k, v, ctx_k, ctx_v)  # Triton, or None
            if o is None:
                o = block_attention(q, k, v, ctx_k, ctx_v)
        else:
            k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.unsqueeze(1))
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class DFlashLayer(nn.Module):
    """Pre-norm block: RMSNorm -> attention -> residual -> RMSNorm -> clamped SwiGLU -> residual, with
    DFlash2's two-tap convolutions around each sublayer when ``dflash2``."""

    def __init__(self, cfg: DFlashConfig, dflash2: bool) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(D, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(D, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, D, bias=False)
        self.limit = cfg.swiglu_limit
        self.convs = nn.ModuleList([TwoTapConv(D, cfg.conv_taps) for _ in range(4)]) if dflash2 else None

    def _conv(self, i: int, x: torch.Tensor, block: int) -> torch.Tensor:
        return x if self.convs is None else self.convs[i](x, block)

    def forward(self, x, pos, ctx_k, ctx_v, block: int, mask=None) -> torch.Tensor:
        a = self._conv(0, self.input_layernorm(x), block)
        x = x + self._conv(1, self.self_attn(a, pos, ctx_k, ctx_v, mask), block)
        m = self._conv(2, self.post_attention_layernorm(x), block)
        y = self.down_proj(clamped_swiglu(self.gate_proj(m), self.up_proj(m), self.limit))
        return x + self._conv(3, y, block)


class CandidateSelector(nn.Module):
    """DFlash2's path selector: ``score(a -> b at t) = U_t(b) + <A(a) * H(h_t), B(b)>`` over the top-K
    candidates ``b`` of each block position; ``A``, ``B`` are ``[V, r]`` codebooks, ``H`` a ``D -> r`` map."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_proj = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def pair_scores(self, h: torch.Tensor, prev: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        """``h [N, D]`` hidden at a position, ``prev [N]`` predecessor ids, ``cand [N, K]`` candidate ids,
        ``unary [N, K]`` their logits -> scores ``[N, K]`` (fp32)."""
        g = self.predecessor(prev).float() * self.hidden_proj(h).float()
        return unary.float() + torch.einsum("nr,nkr->nk", g, self.successor(cand).float())

    @torch.no_grad()
    def walk(self, h: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
        """Greedy path from ``anchor`` through ``h [S, D]`` / ``logits [S, V]``: at each position the
        candidate with the best pair score given the token chosen before it. Returns ``S`` ids.

        Every pair score is computed in one pass (``[S, K_prev, K]``: position 0's only predecessor is
        the anchor); the walk itself is ``S`` argmaxes over ``K`` numbers."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)  # [S, K]
        prev = torch.cat(
            [torch.full((1, self.top_k), anchor, dtype=cand.dtype, device=cand.device), cand[:-1]]
        )  # [S, K_prev]
        g = self.predecessor(prev).float() * self.hidden_proj(h).float().unsqueeze(1)  # [S, K_prev, r]
        pair = unary.unsqueeze(1) + torch.einsum("sar,sbr->sab", g, self.successor(cand).float())  # [S, K_prev, K]
        pair, cand_l = pair.cpu().numpy(), cand.tolist()
        out, a = [], 0  # row 0 of position 0: the anchor (every row of it is the anchor)
        for t in range(len(cand_l)):
            b = int(pair[t, a].argmax())
            out.append(cand_l[t][b])
            a = b
        return out

    @torch.no_grad()
    def walk_reference(self, h: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
        """:meth:`walk` one position at a time through :meth:`pair_scores` (the reference it is tested against)."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)
        prev = torch.tensor([anchor], device=cand.device)
        out = []
        for t in range(h.shape[0]):
            sc = self.pair_scores(h[t : t + 1], prev, cand[t : t + 1], unary[t : t + 1])
            prev = cand[t : t + 1].gather(-1, sc.argmax(-1, keepdim=True))[:, 0]
            out.append(int(prev))
        return out


class DFlashDrafter(nn.Module):
    """DFlash (``dflash2=False``) or DFlash2 drafter. Parameters: ``fc``, ``hidden_norm``,
    ``mask_embedding [D]`` (the MASK input; the trunk's vocabulary has no mask token), ``layers``,
    ``norm`` and (DFlash2) ``selector``."""

    def use_kernels(self, kernels: KernelSettings) -> "DFlashDrafter":
        """Run with the kernel settings ``kernels`` in the row-invariant mode (a draft's few rows take the
        row-invariant GEMM, faster than MKL here; :func:`tandem.ops.dispatch.install`). Returns the drafter."""
        return dispatch.install(self, kernels.replace(rows=True))

    def __init__(self, cfg: DFlashConfig, dflash2: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(D))
        self.layers = nn.ModuleList([DFlashLayer(cfg, dflash2) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.selector = CandidateSelector(cfg) if dflash2 else None

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Trunk features ``[B, T, n_target * D]`` -> normalised context rows ``[B, T, D]``."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context keys and values ``[B, H, T, d]`` of rows ``ctx [B, T, D]`` at ``pos``."""
        return [layer.self_attn.kv(ctx, pos) for layer in self.layers]

    def block_input(self, anchors: torch.Tensor, embed: nn.Embedding, size: int) -> torch.Tensor:
        """``[anchor, MASK x (size-1)]`` embeddings for ``anchors [N]`` -> ``[N, size, D]``."""
        e = embed(anchors).unsqueeze(1)
        m = self.mask_embedding.to(e.dtype).view(1, 1, -1).expand(e.shape[0], size - 1, -1)
        return torch.cat([e, m], 1)

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        block: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block rows ``x [B, S, D]`` (S a multiple of ``block``) at ``pos`` over per-layer context
        ``kv`` -> normalised hidden ``[B, S, D]``. With ``kv`` per layer a pair of lists (each
        sequence's context), ``x [1, S, D]`` holds the sequences' blocks in turn (see
        :meth:`DFlashAttention.forward`)."""
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, pos, k, v, block, mask)
        return self.norm(x)
