"""Real GLM-5.3-Flash checkpoints without the real weights: transformers' default config on the meta
device, a random-weight checkpoint with the real per-head dimensions written as 2 shards plus an
index (logits vs transformers), strict config fields, and the memory refusal."""

import dataclasses
import json
import re

import pytest
import torch

from tandem.model.checkpoint import INDEX, init_weights, load_trunk, param_bytes, save_sharded
from tandem.model.config import HF_DEFAULTS, TrunkConfig
from tandem.model.trunk import Trunk


def _hf_default():
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig()


def test_defaults_are_transformers_defaults():
    """A config.json that leaves a field out gets transformers' value (per-layer patterns included)."""
    hf = _hf_default()
    assert {k: getattr(hf, k) for k in HF_DEFAULTS} == HF_DEFAULTS
    ours = TrunkConfig.from_dict({"model_type": "glm5_next_text"})
    for f in dataclasses.fields(TrunkConfig):
        if f.name != "num_nextn_predict_layers":
            assert getattr(ours, f.name) == getattr(hf, f.name), f.name
    from transformers import Glm5NextTextConfig

    for n in (2, 6):
        small = Glm5NextTextConfig(num_hidden_layers=n)
        got = TrunkConfig.from_dict({"num_hidden_layers": n})
        assert (got.layer_types, got.mlp_layer_types, got.indexer_types) == (
            small.layer_types,
            small.mlp_layer_types,
            small.indexer_types,
        )


def test_full_size_layout_on_meta():
    """tandem's trunk from the real default config (45 layers, hidden 4096, 288 experts)
    has exactly transformers' Glm5NextTextModel parameter names and shapes, built on the meta device
    (no memory); its MTP layer at layers.45 is a decoder layer in the same layout plus GLM's
    eh_proj / enorm / hnorm / shared_head.{norm, head}."""
    from transformers import Glm5NextTextModel

    hf_cfg = _hf_default()
    cfg = TrunkConfig.from_dict(hf_cfg.to_dict())
    with torch.device("meta"):
        hf = Glm5NextTextModel(hf_cfg)
        ours = Trunk(cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    n, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    assert n == 45 and H == 4096 and cfg.n_routed_experts == 288
    trunk = {k: s for k, s in mine.items() if not k.startswith(f"layers.{n}.") and k != "lm_head.weight"}
    assert trunk == theirs
    assert mine["lm_head.weight"] == (V, H)
    mtp = {k[len(f"layers.{n}.") :]: s for k, s in mine.items() if k.startswith(f"layers.{n}.")}
    glm = {
        "eh_proj.weight": (H, 2 * H),
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "shared_head.norm.weight": (H,),
        "shared_head.head.weight": (V, H),
    }
    assert {k: mtp[k] for k in glm} == glm
    ref = next(i for i in range(n) if cfg.layer_types[i] == "indexed_attention" and cfg.mlp_layer_types[i] == "sparse")
    layer = {k[len(f"layers.{ref}.") :]: s for k, s in theirs.items() if k.startswith(f"layers.{ref}.")}
    assert {k: s for k, s in mtp.items() if k not in glm} == layer
    params, nbytes = param_bytes(cfg, torch.bfloat16)
    assert params > 300e9 and 2 * params <= nbytes < 2.01 * params  # bf16, a few fp32-kept tensors


def real_dims_config(**over) -> TrunkConfig:
    """Every real config flag and the real per-head dimensions (qk/v head 256, kv_lora_rank 512,
    index_head_dim 128, linear_head_dim 128, index_kpool 16, hc_mult 4, 8 experts per token, 20
    Sinkhorn iterations, routed scaling 2.5, swiglu limit 10, lower bound -5), with hidden size,
    head counts, depth, experts and vocabulary cut down; index_topk covers the test's context
    (dense DSA)."""
    d = {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 384,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_routed_experts": 10,
        "q_lora_rank": 192,
        "index_n_heads": 2,
        "linear_num_heads": 2,
        "index_topk": 64,
        "max_position_embeddings": 256,
        "num_nextn_predict_layers": 1,
        "pad_token_id": None,
    }
    d.update(over)
    cfg = TrunkConfig.from_dict(d)
    for k in (
        "qk_nope_head_dim",
        "v_head_dim",
        "kv_lora_rank",
        "index_head_dim",
        "linear_head_dim",
        "index_kpool",
        "hc_mult",
        "num_experts_per_tok",
        "hc_sinkhorn_iters",
        "routed_scaling_factor",
        "swiglu_limit",
        "linear_lower_bound",
        "index_kpool_always_select_tail",
        "n_shared_experts",
        "rms_norm_eps",
    ):
        assert getattr(cfg, k) == HF_DEFAULTS[k], k
    return cfg


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm-real-dims")
    model = init_weights(Trunk(real_dims_config()), seed=3, std=0.05)
    save_sharded(model, folder, shards=2, dtype=torch.float32)
    return folder


def test_random_weights_in_two_shards_match_transformers(sharded):
    """The 2-shard checkpoint loads into tandem (through the index) and transformers;
    fp32 logits agree within 1e-4 with dense DSA."""
    from transformers import Glm5NextTextModel
    from transformers.utils import logging as hf_logging

    index = json.loads((sharded / INDEX).read_text())
    assert len(set(index["weight_map"].values())) == 2
    ours = load_trunk(sharded, torch.float32)
    hf_logging.set_verbosity_error()
    hf, info = Glm5NextTextModel.from_pretrained(sharded, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    n = ours.cfg.num_hidden_layers
    assert {k for k in info["unexpected_keys"] if not (k.startswith(f"layers.{n}.") or k == "lm_head.weight")} == set()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours.logits(ours.hidden(ids))
        b = ours.logits(hf.eval()(ids).last_hidden_state)
    assert a.abs().max() > 1e-2  # real activations, not a degenerate zero
    assert (a - b).abs().max().item() <= 1e-4


def test_sharded_loading_names_what_is_wrong(sharded, tmp_path):
    """A missing shard, a missing or unexpected key, and a wrong shape are errors that name it."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(sharded, bad)
    index = json.loads((bad / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    sd = load_file(str(bad / shard))
    key = sorted(sd)[0]
    save_file({k: v for k, v in sd.items() if k != key}, str(bad / shard))
    index["weight_map"].pop(key)
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(KeyError, match=f"1 missing key.*{key}"):
        load_trunk(bad, torch.float32)
    index["weight_map"][key] = shard
    index["weight_map"]["layers.0.extra.weight"] = shard
    save_file(
        {**{k: v for k, v in sd.items() if k != key}, key: sd[key], "layers.0.extra.weight": torch.zeros(1)},
        str(bad / shard),
    )
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(KeyError, match=r"1 unexpected key\(s\) \['layers.0.extra.weight'\]"):
        load_trunk(bad, torch.float32)
    index["weight_map"].pop("layers.0.extra.weight")
    save_file({**{k: v for k, v in sd.items() if k != key}, key: torch.zeros(*sd[key].shape, 2)}, str(bad / shard))
    (bad / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{shard}: {key} has shape"):
        load_trunk(bad, torch.float32)
    (bad / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"names shard\\(s\\) not in the folder: \\['{shard}'\\]"):
        load_trunk(bad, torch.float32)


@pytest.mark.parametrize(
    "change, msg",
    [
        ({"rope_theta": 1e6}, r"unknown field\(s\) \['rope_theta'\]"),
        (
            {"model_type": "glm5_next", "text_config": {}},
            r"unknown field\(s\) \['num_hidden_layers'\] beside text_config",
        ),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
        ({"attention_bias": True}, "attention_bias must be False"),
        ({"model_type": "glm5_next"}, "needs a text_config"),
        ({"model_type": "llama"}, "model_type must be 'glm5_next_text'"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings = True is not supported"),
        ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail = False is not supported"),
        ({"index_topk_freq": 2}, "shared DSA indexers"),
        ({"num_nextn_predict_layers": 2}, "at most one MTP layer"),
        ({"qk_head_dim": 128}, "qk_head_dim 128 != qk_nope_head_dim"),
        ({"num_key_value_heads": 1}, "must equal num_attention_heads"),
    ],
)
def test_config_fields_are_honoured_or_refused(change, msg):
    with pytest.raises(ValueError, match=msg):
        TrunkConfig.from_dict({"num_hidden_layers": 4, **change})


def test_transformers_aliases_are_converted():
    cfg = TrunkConfig.from_dict(
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_attn_config": {
                "head_dim": 64,
                "num_heads": 3,
                "short_conv_kernel_size": 3,
                "gate_lower_bound": -4.0,
            },
            "initializer_range": 0.01,
        }
    )
    assert cfg.layer_types[-1] == "indexed_attention"
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim, cfg.linear_lower_bound) == (
        64,
        3,
        3,
        -4.0,
    )


def test_a_checkpoint_too_large_is_refused_before_loading(tmp_path):
    """The real default config (no weights needed: one placeholder shard) is refused by
    the memory check before anything is allocated, with the estimate and the free memory."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(_hf_default().to_dict()))
    save_file({"embed_tokens.weight": torch.zeros(1)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / INDEX).write_text(
        json.dumps({"weight_map": {"embed_tokens.weight": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(
        MemoryError,
        match=r"needs about \d+\.\d GiB for its weights \(3\d\d\.\d\dB parameters in "
        r"bfloat16\), but cpu has only \d+\.\d GiB free",
    ) as e:
        load_trunk(tmp_path, torch.bfloat16)
    # and what tensor parallelism would need a rank, as make plan counts it
    from tandem.model.parallel import split_bytes

    n, gib = re.search(
        r"split over (\d+) ranks \(--tensor-parallel \d+\) it needs ([\d.]+) GiB a rank", str(e.value)
    ).groups()
    assert float(gib) == round(split_bytes(TrunkConfig.load(tmp_path), "bf16", int(n))[2] / 2**30, 1)
