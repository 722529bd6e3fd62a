"""The released GLM-5.3-Flash layout (``Glm5NextForConditionalGeneration``: nested ``text_config``,
``model.language_model.*`` under transformers' on-disk names, the vision tower skipped, the MTP layer at
``layers.{N}``) and block-scaled FP8 weights: a folder written by transformers' ``save_pretrained`` loads and
gives transformers' logits; its FP8 copy (``tandem.tools.fp8``) loads as the dequantized weights; what does not
fit is refused naming it."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.engine.inprocess import Engine
from tandem.model.checkpoint import DEFAULT_CHECKPOINT, INDEX, init_weights, load_trunk, save_trunk, weight_map
from tandem.model.layout import release_names
from tandem.ops.fp8 import SCALE_SUFFIX, dequantize, quantize
from tandem.ops.settings import REFERENCE
from tandem.model.tokenizer import ChatTokenizer
from tandem.model.trunk import Trunk
from tandem.model.layout import in_fp8_set
from tandem.tools.fp8 import fp8_copy
from test_real_config import real_dims_config

#: the placeholder the test folder's config names (inside its 512-token vocabulary)
IMAGE_TOKEN = 500


def _hf_released(cfg, seed: int = 0):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures",)}
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=cfg.hidden_size)
    hc = Glm5NextConfig(text_config=text, vision_config={**vision, "projection_intermediate_size": 32})
    hc.image_token_id = IMAGE_TOKEN
    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(hc).float().eval()


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A released-layout folder in 3+ shards (transformers' ``save_pretrained``, fp32), with the MTP layer of a
    tandem trunk added under its on-disk names as the release stores it; returns (folder, hf model, mtp tensors)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = real_dims_config()
    folder = tmp_path_factory.mktemp("released")
    hf = _hf_released(cfg)
    with torch.no_grad():  # transformers zeroes some of them at init: real values everywhere
        for name, p in hf.named_parameters():
            if name.endswith(("hc_attn_base", "hc_ffn_base", "attn_hc.base", "ffn_hc.base", "compress_ape")):
                p.normal_(0.0, 0.05)
    hf.save_pretrained(folder, max_shard_size="2MB")
    n = cfg.num_hidden_layers
    donor = init_weights(Trunk(cfg), seed=5, std=0.05)
    mtp = {
        f"model.language_model.{k}": v.contiguous()
        for name, t in donor.state_dict().items()
        if name.startswith(f"layers.{n}.")
        for k, v in release_names(name, t).items()
    }
    save_file(mtp, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    (folder / INDEX).write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return folder, hf, {name: t for name, t in donor.state_dict().items() if name.startswith(f"layers.{n}.")}


def test_a_released_folder_loads_with_transformers_logits(released):
    folder, hf, mtp = released
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "glm5_next" and "vision_config" in config
    keys = set(weight_map(folder))
    assert len(set(weight_map(folder).values())) >= 3
    assert any(k.startswith("model.visual.") for k in keys) and "lm_head.weight" in keys
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in keys) and any("hc_attn_fn" in k for k in keys)
    ours = load_trunk(folder, torch.float32)
    assert "released layout" in ours.loaded_from and "vision tensors skipped unread" in ours.loaded_from
    assert ours.vision_token_ids and IMAGE_TOKEN in ours.vision_token_ids
    assert not any(
        p.device.type == "meta" for p in ours.parameters()
    )  # everything the trunk has was read; the vision tower was never built
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours.logits(ours.hidden(ids))
        b = hf(input_ids=ids).logits
    assert a.abs().max() > 1e-2
    assert (a - b).abs().max().item() <= 1e-4
    sd = ours.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in mtp.items())  # the MTP layer, from layers.{N}
    without = load_trunk(folder, torch.float32, with_mtp=False)
    assert without.mtp is None


def test_the_same_weights_flat_and_released_are_one_model(released, tmp_path):
    folder, _, _ = released
    ours = load_trunk(folder, torch.float32)
    save_trunk(ours, tmp_path / "flat", torch.float32)
    flat = load_trunk(tmp_path / "flat", torch.float32)
    assert flat.loaded_from == "flat text layout" and flat.vision_token_ids == ()
    a, b = ours.state_dict(), flat.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_copy_stores_the_released_fp8_set_and_loads_dequantized(released, tmp_path):
    folder, _, _ = released
    dst = tmp_path / "fp8"
    stats = fp8_copy(folder, dst)
    assert stats["fp8"] > 0 and stats["bytes_after"] < stats["bytes_before"]
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    n = json.loads((folder / "config.json").read_text())["text_config"]["num_hidden_layers"]
    files = weight_map(dst)
    src = weight_map(folder)
    fp8 = []
    for key, f in files.items():
        with safe_open(str(f), "pt") as st:
            t = st.get_tensor(key)
        if key.endswith(SCALE_SUFFIX) or key.startswith("model.visual.") or key == "lm_head.weight":
            continue
        name = key.removeprefix("model.language_model.")
        if t.dtype == torch.float8_e4m3fn:
            fp8.append(name)
            with safe_open(str(files[key + SCALE_SUFFIX]), "pt") as st:
                s = st.get_tensor(key + SCALE_SUFFIX)
            assert s.dtype == torch.float32 and tuple(s.shape) == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            with safe_open(str(src[key]), "pt") as st:
                w = st.get_tensor(key)
            q, s2 = quantize(w, (128, 128))
            assert torch.equal(q.view(torch.uint8), t.view(torch.uint8)) and torch.equal(s, s2)
            assert (dequantize(t, s, (128, 128)) - w).abs().max() <= 0.07 * w.abs().max()
    assert any(f"layers.{n}.self_attn.q_a_proj.weight" == k for k in fp8)  # the MTP layer's MLA too
    assert any(".mlp.experts.3.down_proj.weight" in k for k in fp8) and any("shared_experts" in k for k in fp8)
    assert not any(k.endswith(("embed_tokens.weight", "eh_proj.weight", "gate.weight")) for k in fp8)
    assert not any(".self_attn.q_proj." in k or ".self_attn.b_proj." in k for k in fp8)  # KDA stays bf16
    bf = load_trunk(folder, torch.float32)
    q8 = load_trunk(dst, torch.float32)
    assert "FP8 128x128 blocks dequantized at load" in q8.loaded_from
    a, b = bf.state_dict(), q8.state_dict()
    for k in a:
        if not torch.equal(a[k], b[k]):  # only the FP8 set differs, by e4m3's rounding
            assert "mlp" in k or "self_attn" in k, k
    ids = torch.randint(0, bf.cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        la, lb = bf.logits(bf.hidden(ids)), q8.logits(q8.hidden(ids))
    assert (la - lb).abs().max() <= 0.1 * la.abs().max()


def test_the_shipped_checkpoint_in_fp8_serves_in_process(tmp_path):
    dst = tmp_path / "tiny-fp8"
    fp8_copy(DEFAULT_CHECKPOINT, dst)
    assert (dst / "tokenizer.json").exists() and (dst / "dflash2" / "model.safetensors").exists()
    e = Engine(dst, adaptive_draft=False)
    p = e.tokenizer.chat_prompt("Explain what a hash table is.")
    plain = e.generate(p, max_tokens=24, spec="off")
    spec = e.generate(p, max_tokens=24, spec="dflash2")
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 24 and spec["accepted"] > 0


def test_image_placeholders_are_refused(released):
    folder, _, _ = released
    e = Engine(  # (the torch path: admission is what is tested, and the real dims' compiled kernels cost a compile)
        folder,
        tokenizer=ChatTokenizer(DEFAULT_CHECKPOINT / "tokenizer.json"),
        prefix_cache_mb=0,
        adaptive_draft=False,
        kernel_settings=REFERENCE,
    )
    assert len(e.generate([5, 6, 7], max_tokens=3, spec="off")["token_ids"]) == 3
    with pytest.raises(ValueError, match=f"token {IMAGE_TOKEN} is an image or video placeholder"):
        e.generate([5, IMAGE_TOKEN, 7], max_tokens=3, spec="off")


def _edit_config(folder, dst, fn):
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit, msg",
    [
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), "quant_method 'awq' is not served"),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt must be 'e4m3'"),
        (lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size must be"),
        (lambda c: c["quantization_config"].update(activation_scheme="static"), "activation_scheme must be"),
        (lambda c: c["quantization_config"].update(bits=4), r"unknown field\(s\) \['bits'\]"),
        (lambda c: c.update(audio_config={}), r"unknown field\(s\) \['audio_config'\] beside text_config"),
        (lambda c: c.pop("text_config"), "needs a text_config"),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings True disagrees"),
        (lambda c: c.pop("quantization_config"), "float8_e4m3fn but config.json has no quantization_config"),
    ],
)
def test_what_does_not_fit_is_refused_naming_it(released, tmp_path, edit, msg):
    folder, _, _ = released
    fp8 = tmp_path / "fp8"
    fp8_copy(folder, fp8)
    with pytest.raises((ValueError, KeyError), match=msg):
        load_trunk(_edit_config(fp8, tmp_path / "bad", edit), torch.float32)


def test_bad_fp8_tensors_are_refused_naming_them(released, tmp_path):
    folder, _, _ = released
    fp8 = tmp_path / "fp8"
    fp8_copy(folder, fp8)
    files = weight_map(fp8)
    key = next(k for k in files if k.endswith("q_a_proj.weight"))
    f = files[key]
    with safe_open(str(f), "pt") as st:
        sd = {k: st.get_tensor(k) for k in st.keys()}
    save_file({**sd, key + SCALE_SUFFIX: sd[key + SCALE_SUFFIX][:, :0]}, str(f))
    with pytest.raises(ValueError, match=f"{key}{SCALE_SUFFIX} has shape"):
        load_trunk(fp8, torch.float32)
    save_file({k: v for k, v in sd.items() if k != key + SCALE_SUFFIX}, str(f))
    index = json.loads((fp8 / INDEX).read_text())
    index["weight_map"].pop(key + SCALE_SUFFIX)
    (fp8 / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{key} is float8_e4m3fn without {key}{SCALE_SUFFIX}"):
        load_trunk(fp8, torch.float32)


def test_the_fp8_set_is_the_released_one():
    mla = {3, 4}
    assert in_fp8_set("layers.3.self_attn.q_a_proj.weight", mla)
    assert in_fp8_set("layers.4.self_attn.o_proj.weight", mla)
    assert not in_fp8_set("layers.0.self_attn.o_proj.weight", mla)  # a KDA layer's
    assert in_fp8_set("layers.1.mlp.experts.7.up_proj.weight", mla)
    assert in_fp8_set("layers.0.mlp.gate_proj.weight", mla) and in_fp8_set(
        "layers.2.mlp.shared_experts.down_proj.weight", mla
    )
    assert not in_fp8_set("layers.3.self_attn.kv_b_proj.weight", mla) and not in_fp8_set(
        "layers.1.mlp.gate.weight", mla
    )
    assert not in_fp8_set("layers.4.eh_proj.weight", mla) and not in_fp8_set("embed_tokens.weight", mla)
