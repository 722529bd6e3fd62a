"""The glm5_next decoder block shared by the trunk layers and the MTP layer."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops import dispatch
from ..ops.settings import DEFAULT, KernelSettings
from .config import TrunkConfig
from .kda import LinearAttention
from .layers import MLP, MoE, HyperConnection, RMSNorm, hc_merge
from .mla import MLAttention


class DecoderLayer(nn.Module):
    """One glm5_next block: mHC-collapsed input -> norm -> KDA or MLA -> mHC merge -> norm -> MLP/MoE
    -> mHC merge. Streams ``[B, T, N, D]`` in and out."""

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT
    #: the tensor-parallel group (:mod:`tandem.model.parallel`; None: one rank): the attention and FFN outputs
    #: are partial sums, reduced here
    tp = None

    def __init__(self, cfg: TrunkConfig, layer_type: str, mlp_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = LinearAttention(cfg) if layer_type == "linear_attention" else MLAttention(cfg)
        self.mlp = MoE(cfg) if mlp_type == "sparse" else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def run(self, streams: torch.Tensor, attn_fn) -> torch.Tensor:
        """Apply the block with ``attn_fn(normed_input [B,T,D]) -> [B,T,D]``. In the CPU row-invariant
        mode (fp32) the FFN half of a MoE block is one :func:`~tandem.ops.cpu.block.ffn_block` call."""
        post, comb, x = self.attn_hc.normed(streams, self.input_layernorm)
        y = attn_fn(x)
        streams = hc_merge(post, comb, y if self.tp is None else self.tp.all_reduce(y), streams, self.kernels)
        return self.ffn(streams)

    def ffn(self, streams: torch.Tensor) -> torch.Tensor:
        """The block's FFN half (mHC weights and norm, MLP / MoE, mHC merge) on streams ``[B, T, N, D]``;
        in the CPU row-invariant mode (fp32) one :func:`~tandem.ops.cpu.block.ffn_block` call for a MoE."""
        out = dispatch.ffn_block(self.kernels, self, streams)
        if out is not None:
            return out
        post, comb, x = self.ffn_hc.normed(streams, self.post_attention_layernorm)
        y = self.mlp(x)
        return hc_merge(post, comb, y if self.tp is None else self.tp.all_reduce(y), streams, self.kernels)
