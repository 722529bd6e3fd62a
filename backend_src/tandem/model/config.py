"""Trunk configuration: the fields of `Glm5NextTextConfig` (model_type ``glm5_next_text``) tandem uses.

The checkpoint's ``config.json`` is the Hugging Face one, so transformers can load it as well: the flat text
config (``glm5_next_text``), or the released layout's (``Glm5NextConfig``, model_type ``glm5_next``: the text
fields under ``text_config``, a ``vision_config`` tandem does not serve; :func:`text_fields`).
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
        for name, ok, what in (
            (
                "index_kpool_always_select_tail",
                self.index_kpool_always_select_tail,
                "tandem's DSA always selects the incomplete k-pool tail",
            ),
            ("tie_word_embeddings", not self.tie_word_embeddings, "tandem keeps lm_head separate from embed_tokens"),
            ("topk_group", self.topk_group == 1, "with n_group 1 the only group is always selected"),
            ("num_nextn_predict_layers", self.num_nextn_predict_layers in (0, 1), "tandem runs at most one MTP layer"),
            ("linear_lower_bound", self.linear_lower_bound is not None, "tandem's KDA gate needs the safe-gate bound"),
        ):
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r} is not supported: {what}")

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
        """From a ``config.json`` body, flat (model_type ``glm5_next_text``) or the released layout's
        (``glm5_next``, its text fields under ``text_config``: :func:`text_fields`), strictly: every field is
        honoured, or refused. Fields it lacks take transformers' defaults (:data:`HF_DEFAULTS`; the
        per-layer patterns computed as ``Glm5NextTextConfig`` computes them), never tandem's toy
        ones; transformers' aliases are converted (``linear_attn_config``, ``index_topk_pattern`` /
        ``index_topk_freq`` / ``index_skip_topk_offset``, ``"full_attention"`` layers); fields that do
        not change inference (:data:`INFERENCE_FREE`) are accepted. Raises ``ValueError`` naming an
        unknown field, a value tandem cannot serve, or another model type."""
        d = text_fields(d)
        if d.get("model_type", "glm5_next_text") != "glm5_next_text":
            raise ValueError(
                f"config.json: text_config.model_type must be 'glm5_next_text', got {d.get('model_type')!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        lin = d.pop("linear_attn_config", None)
        if lin is not None:  # transformers' nested form of the KDA fields
            for k, f in (
                ("head_dim", "linear_head_dim"),
                ("num_heads", "linear_num_heads"),
                ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                ("gate_lower_bound", "linear_lower_bound"),
            ):
                if k in lin:
                    d[f] = lin[k]
            if lin.get("safe_gate", True) and d.get("linear_lower_bound", -5.0) is None:
                d["linear_lower_bound"] = -5.0
        n = int(d.get("num_hidden_layers", HF_DEFAULTS["num_hidden_layers"]))
        pattern, freq, offset = (
            d.pop("index_topk_pattern", None),
            d.pop("index_topk_freq", 1),
            d.pop("index_skip_topk_offset", 2),
        )
        if d.get("indexer_types") is None:
            d["indexer_types"] = (
                [{"F": "full", "S": "shared"}[c] for c in pattern]
                if isinstance(pattern, str)
                else list(pattern)
                if pattern is not None
                else ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(n)]
            )
        if d.get("mlp_layer_types") is None:
            d["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        if d.get("layer_types") is None:
            d["layer_types"] = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
        d["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in d["layer_types"]]
        for k, want in FIXED.items():
            if k in d and d[k] != want:
                raise ValueError(
                    f"config.json: {k} must be {want!r} (the only glm5_next form tandem serves), got {d[k]!r}"
                )
        if d.get("num_key_value_heads") is None:
            d["num_key_value_heads"] = d.get("num_attention_heads", HF_DEFAULTS["num_attention_heads"])
        unknown = sorted(
            k
            for k in d
            if k not in fields and k not in INFERENCE_FREE and k not in FIXED and k not in ("head_dim", "qk_head_dim")
        )
        if unknown:
            raise ValueError(f"config.json: unknown field(s) {unknown}: tandem cannot honour them")
        cfg = cls(**{**{k: v for k, v in HF_DEFAULTS.items()}, **{k: v for k, v in d.items() if k in fields}})
        if "qk_head_dim" in d and d["qk_head_dim"] != cfg.qk_head_dim:
            raise ValueError(
                f"config.json: qk_head_dim {d['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim "
                f"({cfg.qk_head_dim})"
            )
        if cfg.num_attention_heads != cfg.num_key_value_heads:
            raise ValueError(
                f"config.json: num_key_value_heads ({cfg.num_key_value_heads}) must equal "
                f"num_attention_heads ({cfg.num_attention_heads})"
            )
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> "TrunkConfig":
        """Read ``config.json`` from a checkpoint folder (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        return cls.from_dict(json.loads(p.read_text()))

    def save(self, folder: str | Path) -> None:
        Path(folder, "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


#: the released layout's ``config.json`` (``Glm5NextConfig``, model_type ``glm5_next``): fields beside
#: ``text_config`` that do not change serving its text model (the vision tower's config and its placeholder
#: tokens, which :func:`vision_token_ids` reads; bookkeeping)
VLM_FREE = frozenset(
    {
        "vision_config",
        "image_token_id",
        "video_token_id",
        "image_start_token_id",
        "image_end_token_id",
        "video_start_token_id",
        "video_end_token_id",
    }
)
#: the placeholder token fields of the released layout, with transformers' defaults (``Glm5NextConfig``)
VISION_TOKENS = {
    "image_token_id": 154854,
    "video_token_id": 154855,
    "image_start_token_id": 154830,
    "image_end_token_id": 154831,
    "video_start_token_id": 154832,
    "video_end_token_id": 154833,
}


def is_released_layout(d: dict) -> bool:
    """Whether a ``config.json`` body is the released layout's (model_type ``glm5_next``)."""
    return d.get("model_type") == "glm5_next"


def text_fields(d: dict) -> dict:
    """The text model's fields of a ``config.json`` body: a flat one's own (less ``quantization_config``, read by
    :mod:`~tandem.model.layout`), or a released layout's ``text_config`` after checking the fields beside it:
    each is in :data:`VLM_FREE`, :data:`INFERENCE_FREE` or ``quantization_config``, and
    ``tie_word_embeddings`` agrees with the text config's. Raises ``ValueError`` naming a field it cannot honour."""
    d = {k: v for k, v in d.items() if k != "quantization_config"}
    if not is_released_layout(d):
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("config.json: model_type 'glm5_next' needs a text_config object (the text model's fields)")
    unknown = sorted(
        k
        for k in d
        if k not in VLM_FREE and k not in INFERENCE_FREE and k not in ("text_config", "tie_word_embeddings")
    )
    if unknown:
        raise ValueError(f"config.json: unknown field(s) {unknown} beside text_config: tandem cannot honour them")
    text = dict(text)
    if "tie_word_embeddings" in d:
        if text.setdefault("tie_word_embeddings", d["tie_word_embeddings"]) != d["tie_word_embeddings"]:
            raise ValueError(
                f"config.json: tie_word_embeddings {d['tie_word_embeddings']!r} disagrees with "
                f"text_config.tie_word_embeddings {text['tie_word_embeddings']!r}"
            )
    return text


def vision_token_ids(d: dict) -> tuple[int, ...]:
    """The image and video placeholder token ids of a released layout's ``config.json`` body (transformers'
    defaults where it leaves them out), which a text-only server refuses in a prompt; () for a flat one."""
    if not is_released_layout(d):
        return ()
    return tuple(sorted({int(d.get(k, v)) for k, v in VISION_TOKENS.items()}))


#: ``Glm5NextTextConfig``'s defaults (transformers 5.24) for the fields a config.json may leave out
#: (``tests/test_config.py`` checks them against transformers); the per-layer patterns (None) are
#: computed from ``num_hidden_layers`` as transformers does (:meth:`TrunkConfig.from_dict`)
HF_DEFAULTS = {
    "vocab_size": 154880,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 45,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 288,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "qk_nope_head_dim": 256,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 154820,
    "bos_token_id": None,
    "eos_token_id": None,
    "tie_word_embeddings": False,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "swiglu_limit": 10.0,
    "linear_head_dim": 128,
    "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "index_kpool": 16,
    "index_kpool_always_select_tail": True,
}
#: fields with one value tandem implements (transformers' only value too, but for a config naming another)
FIXED = {"hidden_act": "silu", "attention_bias": False}
#: config.json fields that do not change inference (training, bookkeeping, storage dtype), accepted as given
INFERENCE_FREE = frozenset(
    {
        "model_type",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "initializer_range",
        "router_aux_loss_coef",
        "output_router_logits",
        "use_cache",
        "attention_dropout",
        "id2label",
        "label2id",
        "problem_type",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
    }
)
