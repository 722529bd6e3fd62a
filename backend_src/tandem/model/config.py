"""Trunk configuration: the fields of `Glm5NextTextConfig` (model_type ``glm5_next_text``) tandem uses.

The checkpoint's ``config.json`` is the Hugging Face one, so transformers can load it as well.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass
class TrunkConfig:
    """Shape of a glm5_next trunk (and its MTP layer at index ``num_hidden_layers``).

    Defaults are tandem's toy scale; every field mirrors the transformers field of the same name.
    """

    # sizes, special tokens and per-layer patterns (None: transformers' defaults, see __post_init__)
    layer_types: list[str] | None = None
    intermediate_size: int = 512
    bos_token_id: int | None = None
    hidden_size: int = 256
    vocab_size: int = 8192
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    pad_token_id: int | None = None
    num_hidden_layers: int = 4
    eos_token_id: int | list[int] | None = None
    # MoE: sigmoid router over routed experts, plus shared experts; the clamped SwiGLU
    swiglu_limit: float = 10.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_routed_experts: int = 4
    mlp_layer_types: list[str] | None = None
    norm_topk_prob: bool = True
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    n_shared_experts: int = 1
    # KDA (linear_attention layers)
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    linear_num_heads: int = 4
    # MLA (indexed_attention layers), NoPE, and its DSA indexer (top-k over k-pools)
    v_head_dim: int = 64
    qk_rope_head_dim: int = 0
    index_n_heads: int = 4
    kv_lora_rank: int = 64
    index_kpool_always_select_tail: bool = True
    qk_nope_head_dim: int = 64
    indexer_types: list[str] | None = None
    num_key_value_heads: int = 4
    index_kpool: int = 4
    index_head_dim: int = 32
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    index_topk: int = 64
    # mHC hyper-connections, norms, MTP
    rms_norm_eps: float = 1e-5
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 20

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            # transformers' default pattern: every 4th layer (idx % 4 == 3) is indexed attention.
            self.layer_types = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense"] + ["sparse"] * (n - 1)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n or len(self.indexer_types) != n:
            raise ValueError("layer_types, mlp_layer_types and indexer_types need num_hidden_layers entries")
        if "shared" in self.indexer_types:
            raise ValueError("tandem does not implement shared DSA indexers (indexer_types must all be 'full')")
        if self.qk_rope_head_dim != 0:
            raise ValueError("glm5_next indexed attention is NoPE: qk_rope_head_dim must be 0")
        if self.index_topk % self.index_kpool:
            raise ValueError("index_topk must be divisible by index_kpool")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_hf_dict(self) -> dict:
        """The config.json body (model_type glm5_next_text) transformers reads."""
        d = dataclasses.asdict(self)
        d.update(
            {
                "model_type": "glm5_next_text",
                "architectures": ["Glm5NextTextModel"],
                "hidden_act": "silu",
                "attention_bias": False,
                "head_dim": 0,
                "torch_dtype": "bfloat16",
            }
        )
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrunkConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, path: str | Path) -> "TrunkConfig":
        """Read ``config.json`` from a checkpoint folder (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        return cls.from_dict(json.loads(p.read_text()))

    def save(self, folder: str | Path) -> None:
        Path(folder, "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")
