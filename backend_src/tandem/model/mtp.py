"""GLM's native multi-token-prediction (MTP) layer, stored at checkpoint index ``num_hidden_layers``."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops import dispatch
from .cache import MLACache
from .config import TrunkConfig
from .layers import RMSNorm
from .block import DecoderLayer


class MTPLayer(DecoderLayer):
    """GLM native MTP layer: ``h' = block(eh_proj(cat[enorm(emb(x)), hnorm(h)]))``; logits
    ``shared_head.head(shared_head.norm(mean_streams(h')))``; the normalised hidden is carried to
    the next chained step."""

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__(cfg, "indexed_attention", "sparse")
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.shared_head.head = nn.Linear(D, cfg.vocab_size, bias=False)
        self.hc_mult = cfg.hc_mult

    def _in(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))
        return u.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()

    def _out(self, streams: torch.Tensor) -> torch.Tensor:
        return self.shared_head.norm(streams.mean(2))

    def forward(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Training: ``emb [B,T,D]`` of tokens t+1, trunk hidden ``h [B,T,D]`` of position t ->
        normalised MTP hidden ``[B,T,D]`` (predicts token t+2 via ``shared_head.head``)."""
        return self._out(self.run(self._in(emb, h), lambda x: self.self_attn(x)[0]))

    def rows(self, emb: torch.Tensor, h: torch.Tensor, cache: MLACache) -> torch.Tensor:
        """Cached rows ``[1, R, D]`` at MTP positions ``len(cache) ..``; appends to ``cache``."""
        dispatch.new_pass()
        return self._out(self.run(self._in(emb, h), lambda x: self.self_attn.rows(x, cache)))
