"""The glm5_next trunk and its native MTP layer, in tandem's own torch code.

Module and parameter names equal the Hugging Face checkpoint keys (``embed_tokens``,
``layers.{i}.…``, ``norm``, ``lm_head``; the MTP layer at ``layers.{num_hidden_layers}``), so
``state_dict()`` is the checkpoint and transformers' ``Glm5NextTextModel`` loads it.

Three entry points share one set of layer functions:

* :meth:`Trunk.hidden` — full causal pass from position 0 (training);
* :meth:`Trunk.prime` — prefill rows into a :class:`TrunkCache` (chunked KDA);
* :meth:`Trunk.verify` — rows appended after the committed ones, keeping every row's KDA state
  so :meth:`TrunkCache.commit` can roll back exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from .cache import KDAState, MLACache, TrunkCache
from .config import TrunkConfig
from .kda import LinearAttention
from .layers import MLP, MoE, HyperConnection, RMSNorm, hc_merge
from .mla import MLAttention


class DecoderLayer(nn.Module):
    """One glm5_next block: mHC-collapsed input -> norm -> KDA or MLA -> mHC merge -> norm -> MLP/MoE
    -> mHC merge. Streams ``[B, T, N, D]`` in and out."""

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
        """Apply the block with ``attn_fn(normed_input [B,T,D]) -> [B,T,D]``."""
        post, comb, x = self.attn_hc(streams)
        streams = hc_merge(post, comb, attn_fn(self.input_layernorm(x)), streams)
        post, comb, x = self.ffn_hc(streams)
        return hc_merge(post, comb, self.mlp(self.post_attention_layernorm(x)), streams)


def mla_rows(attn: MLAttention, x: torch.Tensor, cache: MLACache) -> torch.Tensor:
    """Run rows ``x [1, R, D]`` at positions ``len(cache) ..`` through an MLA layer, appending them
    (and any pools they complete) to ``cache``. Returns ``[1, R, D]``."""
    pos0 = len(cache)
    rows = attn.project(x)
    cache.append(rows)
    n_complete = len(cache) // cache.kp
    if n_complete > cache.n_pools():
        lo = cache.n_pools() * cache.kp
        cache.add_pools(attn.indexer.pool_keys(cache.ik[:, lo: n_complete * cache.kp], cache.ig[:, lo: n_complete * cache.kp]))
    q_pos = pos0 + torch.arange(x.shape[1], device=x.device)
    pk = cache.pk if cache.pk is not None else cache.ik.new_zeros(1, 0, cache.ik.shape[-1])
    y, _ = attn.attend(x, rows, cache.k, cache.v, pk, q_pos)
    return y


def mla_prime(attn: MLAttention, x: torch.Tensor, cache: MLACache) -> torch.Tensor:
    """Prime rows into an MLA cache: the full pass when the cache is empty, else :func:`mla_rows`."""
    if len(cache) > 0:
        return mla_rows(attn, x, cache)
    y, rows = attn(x)
    cache.append(rows)
    cache.add_pools(rows["pk"])
    return y


def _check_rows(cache: TrunkCache, ids: torch.Tensor, what: str) -> int:
    """Rows in ``ids [1, T]``; raises ``ValueError`` if a verify is pending or they overflow the cache."""
    if cache.pending is not None:
        raise ValueError(f"{what} while a verify pass is pending")
    n = ids.shape[1]
    if cache.pos + n > cache.max_ctx:
        raise ValueError(f"context full: {cache.pos} + {n} tokens > max_ctx {cache.max_ctx}")
    return n


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
        return self._out(self.run(self._in(emb, h), lambda x: mla_rows(self.self_attn, x, cache)))


class Trunk(nn.Module):
    """glm5_next trunk + LM head + (optional) MTP layer.

    ``dtype`` is the compute dtype (bf16 serving default, fp32 exactness mode); parameters listed
    in :data:`FP32_KEEP` stay fp32 as in transformers.
    """

    def __init__(self, cfg: TrunkConfig, with_mtp: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i]) for i in range(cfg.num_hidden_layers)]
        if with_mtp:
            layers.append(MTPLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def mtp(self) -> MTPLayer | None:
        n = self.cfg.num_hidden_layers
        return self.layers[n] if len(self.layers) > n else None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _streams(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(ids)
        return e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def _final(self, streams: torch.Tensor) -> torch.Tensor:
        return self.norm(streams.mean(2))

    # -- training / full pass -------------------------------------------------------------------
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Full causal pass. ``ids [B, T]`` -> final normalised hidden ``[B, T, D]``."""
        s = self._streams(ids)
        for layer in self.layers[: self.cfg.num_hidden_layers]:
            s = layer.run(s, lambda x, l=layer: l.self_attn(x)[0])
        return self._final(s)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head in fp32: ``[..., D] -> [..., V]``."""
        return self.lm_head(h).float()

    # -- serving ----------------------------------------------------------------------------------
    def new_cache(self, max_ctx: int | None = None) -> TrunkCache:
        """An empty cache with capacity ``max_ctx`` tokens (default ``max_position_embeddings``)."""
        return TrunkCache(self.cfg.layer_types, self.cfg.index_kpool, max_ctx or self.cfg.max_position_embeddings)

    @torch.no_grad()
    def prime(self, cache: TrunkCache, ids: torch.Tensor) -> torch.Tensor:
        """Prefill ``ids [1, T]`` after the committed rows; commits them. Returns hidden ``[1, T, D]``.

        Raises ``ValueError`` when the rows do not fit in ``cache.max_ctx`` or a verify is pending.
        """
        T = _check_rows(cache, ids, "prime")
        s = self._streams(ids)
        for i, layer in enumerate(self.layers[: self.cfg.num_hidden_layers]):
            st = cache.layers[i]
            if layer.layer_type == "linear_attention":
                def fn(x, l=layer, i=i, st=st):
                    y, (tail, S) = l.self_attn(x, None if st is None else (st.tail, st.S))
                    cache.layers[i] = KDAState(tail, S)
                    return y
            else:
                def fn(x, l=layer, st=st):
                    return mla_prime(l.self_attn, x, st)
            s = layer.run(s, fn)
        cache.pos += T
        return self._final(s)

    @torch.no_grad()
    def verify(self, cache: TrunkCache, ids: torch.Tensor) -> torch.Tensor:
        """Run ``ids [1, R]`` (anchor + drafts) at positions ``cache.pos ..`` without committing.
        Returns hidden ``[1, R, D]``; follow with ``cache.commit(n_rows)``.

        Raises ``ValueError`` when the rows do not fit in ``cache.max_ctx`` or a verify is pending.
        """
        R = _check_rows(cache, ids, "verify")
        pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        s = self._streams(ids)
        for i, layer in enumerate(self.layers[: self.cfg.num_hidden_layers]):
            st = cache.layers[i]
            if layer.layer_type == "linear_attention":
                if st is None:
                    st = KDAState(*layer.self_attn.init_state(1, ids.device))
                def fn(x, l=layer, i=i, st=st):
                    y, full, states = l.self_attn.forward_rows(x, (st.tail, st.S))
                    pending[i] = (full, states)
                    return y
            else:
                def fn(x, l=layer, st=st):
                    return mla_rows(l.self_attn, x, st)
            s = layer.run(s, fn)
        cache.pending, cache.pending_rows = pending, R
        return self._final(s)


FP32_KEEP = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log",
             "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale")


def is_fp32_param(name: str) -> bool:
    """Parameters kept in fp32 whatever the compute dtype (transformers' ``_keep_in_fp32_modules_strict``)."""
    return any(k in name for k in FP32_KEEP)


def cast_trunk(model: Trunk, dtype: torch.dtype) -> Trunk:
    """Cast to ``dtype`` except the fp32-kept parameters and buffers. Returns ``model``."""
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if is_fp32_param(name) else dtype)
    for name, b in model.named_buffers():
        if not is_fp32_param(name):
            b.data = b.data.to(dtype)
    return model


def load_trunk(folder: str | Path, dtype: torch.dtype = torch.bfloat16, with_mtp: bool = True,
               overrides: dict | None = None) -> Trunk:
    """Load ``config.json`` + ``model.safetensors`` from a checkpoint folder; ``overrides`` replace
    config fields (e.g. ``{"index_topk": 4096}`` for the dense DSA regime).

    Raises ``FileNotFoundError`` if the folder lacks them, ``KeyError`` on missing trunk keys.
    """
    import dataclasses

    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"no model.safetensors in {folder} (run `make model`)")
    cfg = TrunkConfig.load(folder)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    model = Trunk(cfg, with_mtp=with_mtp)
    sd = load_file(str(folder / "model.safetensors"))
    if not with_mtp:
        prefix = f"layers.{cfg.num_hidden_layers}."
        sd = {k: v for k, v in sd.items() if not k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise KeyError(f"checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    model.eval().requires_grad_(False)
    return cast_trunk(model, dtype)


def save_trunk(model: Trunk, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (``dtype`` except fp32-kept parameters)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.cfg.save(folder)
    sd = {}
    for k, v in model.state_dict().items():
        sd[k] = v.detach().to(torch.float32 if is_fp32_param(k) else dtype).contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def init_weights(model: Trunk, seed: int = 0, std: float = 0.02) -> Trunk:
    """Initialise like transformers' ``_init_weights`` (normal(0, std) linears/embeddings, KDA gate
    per FLA, mHC ``fn ~ N(0, std)``, ``base = 0``, ``scale = 1``)."""
    import math

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "k_norm.weight" in name:
                p.fill_(1.0)
            elif "k_norm.bias" in name or name.endswith(".base") or "compress_ape" in name:
                p.zero_()
            elif name.endswith(".scale"):
                p.fill_(1.0)
            elif "compress_gate" in name:
                p.normal_(0.0, std, generator=g)
            elif name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "conv1d" in name:
                p.normal_(0.0, 0.5, generator=g)
            else:
                p.normal_(0.0, std, generator=g)
    return model
