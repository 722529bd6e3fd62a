"""FP8 weights held in FP8 (``fp8_weights=keep``, tandem.model.fp8): the shipped checkpoint's block-FP8 copy loads
with its FP8 set at a byte a weight plus its scales, and gives the tokens of the same copy dequantized at load; the
FP8 modules on the Triton kernel (Triton's interpreter here) agree with their reference, odd shapes and per-row
scales included; a part of a tensor cut off a block boundary is dequantized, not mis-scaled."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.engine.inprocess import Engine
from tandem.engine.ranks import weight_bytes
from tandem.model.checkpoint import load_trunk, weight_map
from tandem.model.fp8 import Fp8Experts, Fp8Linear
from tandem.model.layers import Experts
from tandem.model.layout import CheckpointTensors, Layout
from tandem.ops.fp8 import SCALE_SUFFIX, quantize
from tandem.ops.settings import REFERENCE, KernelSettings
from tandem.tools.fp8 import fp8_copy

from conftest import CHECKPOINT

PROMPTS = ("Explain what a hash table is.",)


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    fp8_copy(CHECKPOINT, folder)
    return folder


def test_kept_fp8_holds_a_byte_a_weight_and_gives_the_dequantized_tokens(fp8_folder):
    deq = load_trunk(fp8_folder, torch.float32, kernels=REFERENCE, fp8="dequantize")
    kept = load_trunk(fp8_folder, torch.float32, kernels=REFERENCE, fp8="keep")
    assert "dequantized at load" in deq.loaded_from and "FP8 128x128 blocks kept" in kept.loaded_from
    fp8 = {n: t for n, t in kept.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    assert any(".mlp.experts.gate_up_proj" in n for n in fp8) and any("q_a_proj" in n for n in fp8)
    assert not any(".self_attn.q_proj." in n or "embed_tokens" in n for n in fp8)  # KDA and embeddings stay
    # what it holds: the FP8 set at a byte an element plus fp32 scales, everything else as the dequantized load
    scales = sum(kept.state_dict()[n + SCALE_SUFFIX].numel() * 4 for n in fp8)
    deq_fp8 = sum(deq.state_dict()[n].numel() * 4 for n in fp8)
    assert weight_bytes(kept) == weight_bytes(deq) - deq_fp8 + sum(t.numel() for t in fp8.values()) + scales
    assert sum(t.numel() for t in fp8.values()) + scales < 0.26 * deq_fp8  # a byte a weight, not four
    ids = torch.randint(0, kept.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(kept.logits(kept.hidden(ids)), deq.logits(deq.hidden(ids)))
    a = Engine(model=deq, tokenizer=None, checkpoint=fp8_folder, kernel_settings=REFERENCE, adaptive_draft=False)
    b = Engine(model=kept, tokenizer=None, checkpoint=fp8_folder, kernel_settings=REFERENCE, adaptive_draft=False)
    p = a.tokenizer.chat_prompt(PROMPTS[0])  # the torch path dequantizes every FP8 weight a call: a few tokens
    want = a.generate(p, max_tokens=12, spec="off")["token_ids"]
    for spec in ("off", "dflash2", "mtp"):
        assert b.generate(p, max_tokens=12, spec=spec)["token_ids"] == want, spec


def test_the_cpu_dequantizes_by_default_at_the_dequantized_size(fp8_folder):
    bf16 = load_trunk(CHECKPOINT, torch.bfloat16)
    auto = load_trunk(fp8_folder, torch.bfloat16)  # fp8_weights auto on the CPU: dequantized, numba kernels on
    assert "dequantized at load" in auto.loaded_from and weight_bytes(auto) == weight_bytes(bf16)
    kept = load_trunk(fp8_folder, torch.float32, fp8="keep")  # kept on the CPU: the torch path (numba reads bf16)
    assert "kept (60 tensors, torch path)" in kept.loaded_from and not kept.kernels.numba
    plain = load_trunk(CHECKPOINT, torch.float32, fp8="keep")  # no FP8 weights to keep: the kernels stay
    assert "FP8" not in plain.loaded_from and plain.kernels.numba
    with pytest.raises(ValueError, match="fp8_weights must be one of"):
        load_trunk(fp8_folder, torch.float32, fp8="fp4")


@pytest.mark.parametrize("block", [(128, 128), (1, 128), (64, 32)])
def test_fp8_linear_on_the_triton_kernel_matches_its_reference(block):
    pytest.importorskip("triton")
    from tandem.ops import dispatch

    if not dispatch.interpreted():
        pytest.skip("CPU tensors on the Triton kernel need TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    m = Fp8Linear(200, 136, block)  # tails in both dimensions
    m.weight, s = quantize(torch.randn(200, 136, generator=g) * 0.1, block)
    setattr(m, "weight" + SCALE_SUFFIX, s)
    x = torch.randn(5, 136, generator=g)
    ref = m.eval()(x)
    m.kernels = KernelSettings(backend="triton")
    got = m(x)
    assert got.shape == (5, 200) and (got - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


def test_fp8_experts_on_the_triton_kernel_match_their_reference():
    pytest.importorskip("triton")
    from tandem.model.config import TrunkConfig
    from tandem.ops import dispatch

    if not dispatch.interpreted():
        pytest.skip("CPU tensors on the Triton kernel need TRITON_INTERPRET=1")
    cfg = TrunkConfig(hidden_size=72, moe_intermediate_size=40, n_routed_experts=3)  # 40 rows: gate | up off a block
    g = torch.Generator().manual_seed(4)
    like = Experts(cfg)
    m = Fp8Experts(like, (1, 32), (32, 32))
    up = [quantize(torch.randn(80, 72, generator=g) * 0.1, (1, 32)) for _ in range(3)]
    down = [quantize(torch.randn(72, 40, generator=g) * 0.1, (32, 32)) for _ in range(3)]
    m.gate_up_proj, m.down_proj = torch.stack([q for q, _ in up]), torch.stack([q for q, _ in down])
    setattr(m, "gate_up_proj" + SCALE_SUFFIX, torch.stack([s for _, s in up]))
    setattr(m, "down_proj" + SCALE_SUFFIX, torch.stack([s for _, s in down]))
    x = torch.randn(6, 72, generator=g)
    idx = torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1], [1, 0], [2, 1]])
    w = torch.rand(6, 2, generator=g)
    ref = m(x, idx, w)
    m.kernels = KernelSettings(backend="triton")
    got = m(x, idx, w)
    assert (got - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


def test_parts_off_a_block_boundary_repeat_scales_by_row_or_are_dequantized(fp8_folder):
    tensors = CheckpointTensors(weight_map(fp8_folder), Layout.read(fp8_folder))
    q_b = next(k for k in tensors.keys() if k.endswith("self_attn.q_b_proj.weight"))  # [256, 128]
    o = next(k for k in tensors.keys() if k.endswith("self_attn.o_proj.weight") and k.startswith("layers.3."))
    assert tensors.fp8_form(q_b) == (128, 128) and tensors.fp8_form(q_b, (0, 128, 256)) == (128, 128)
    assert tensors.fp8_form(q_b, (0, 64, 128)) == (1, 128)  # rows off a boundary: a scale per row
    assert tensors.fp8_form(o, (1, 64, 128)) is None  # columns off a boundary: dequantized
    w, s = tensors.read_fp8(q_b, (1, 128), (0, 64, 128))
    full_w, full_s = tensors.read_fp8(q_b, (128, 128))
    assert torch.equal(w.view(torch.uint8), full_w[64:128].view(torch.uint8))
    assert torch.equal(s, full_s.repeat_interleave(128, 0)[64:128])
    assert tensors.fp8_form(next(k for k in tensors.keys() if k.endswith("embed_tokens.weight"))) is None
    assert json.loads((fp8_folder / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_the_fp8_tool_refuses_a_block_the_gemm_cannot_take(tmp_path):
    from typer.testing import CliRunner

    from tandem.tools.fp8 import app

    for block in ("0", "100"):
        r = CliRunner().invoke(app, [str(CHECKPOINT), str(tmp_path / f"out{block}"), "--block", block])
        assert r.exit_code == 2 and "--block must be a positive multiple of 16" in r.output, r.output
        assert not (tmp_path / f"out{block}").exists()
