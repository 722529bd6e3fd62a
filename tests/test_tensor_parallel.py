"""Tensor and expert parallelism (tandem.model.parallel, tandem.engine.ranks): a real tritonserver serving the
shipped checkpoint over 2 gloo ranks gives the single-rank engine's greedy tokens for plain decoding and DFlash2
(and its coupled samples), each rank holding at most 0.55 of one rank's trunk weights as its load line says;
the split of each tensor kind."""

from __future__ import annotations

import re

import pytest
import torch

from tandem.model.config import TrunkConfig
from tandem.model.parallel import TensorParallel, local_config, shard

from conftest import CHECKPOINT

PROMPTS = ("Explain what a hash table is.", "def fibonacci(n):")


def test_each_tensor_kind_splits_by_its_rule():
    tp = TensorParallel(1, 2)
    w = torch.arange(24.0).view(6, 4)
    assert torch.equal(shard("layers.0.self_attn.q_proj.weight", w, torch.empty(3, 4), tp), w[3:])
    assert torch.equal(shard("layers.0.self_attn.o_proj.weight", w, torch.empty(6, 2), tp), w[:, 2:])
    assert shard("norm.weight", w, torch.empty(6, 4), tp) is w
    conv = torch.arange(12.0).view(12, 1, 1)  # q, k, v thirds of 4 channels: rank 1 takes the second half of each
    got = shard("layers.0.self_attn.conv1d.weight", conv, torch.empty(6, 1, 1), tp).flatten().tolist()
    assert got == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="does not split 2 ways"):
        shard("layers.0.mlp.gate_proj.weight", w, torch.empty(4, 4), tp)
    cfg = TrunkConfig.load(CHECKPOINT)
    with pytest.raises(ValueError, match="tensor_parallel 3: num_attention_heads"):
        local_config(cfg, TensorParallel(0, 3))


def test_what_a_split_cannot_serve_is_refused_with_the_config():
    """Checked with the serving config, before a server starts: the MTP spec as the default (its layer is not
    split) and drafters in their own models (every rank runs them beside its trunk)."""
    from tandem import schema

    with pytest.raises(ValueError, match="spec 'mtp' is not served with tensor_parallel 2"):
        schema.ServingConfig(tensor_parallel=2, spec="mtp")
    with pytest.raises(ValueError, match="tensor_parallel 2 runs the drafters beside the trunk on every rank"):
        schema.ServingConfig(tensor_parallel=2, colocate=False)
    assert schema.ServingConfig(tensor_parallel=2, spec="dflash2").spec == "dflash2"


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    from tandem.launch.serve import running_server

    log = tmp_path_factory.mktemp("tp") / "tritonserver.log"
    env = {
        "TANDEM_CHECKPOINT": str(CHECKPOINT.resolve()),
        "TANDEM_TENSOR_PARALLEL": "2",
        "TANDEM_ADAPTIVE_DRAFT": "false",  # (no calibration: the torch path's rounds are slow to measure)
    }
    with running_server(env=env, ready_timeout_s=300, log_path=log) as srv:
        yield srv, log


def test_two_ranks_serve_the_single_rank_tokens_with_half_the_weights(tp_server, shipped):
    from tandem_client.client import TandemClientError, generate

    srv, log = tp_server
    tok = shipped.tokenizer
    for spec in ("off", "dflash2"):
        for text in PROMPTS:
            ids = tok.chat_prompt(text)
            want = shipped.generate(ids, 16, spec=spec)["token_ids"]
            got = generate(ids, 16, url=srv.grpc_url, spec=spec)
            assert got["token_ids"] == want, (spec, text)
            assert spec == "off" or got["accepted"] > 0
    ids = tok.chat_prompt(PROMPTS[0])
    smp = {"TEMPERATURE": 0.8, "SEED": 3, "SAMPLING": "coupled"}
    want = shipped.generate(ids, 12, spec="off", temperature=0.8, seed=3, sampling="coupled")["token_ids"]
    assert generate(ids, 12, url=srv.grpc_url, spec="dflash2", sampling=smp)["token_ids"] == want
    with pytest.raises(TandemClientError, match="SPEC 'mtp' is not served with tensor_parallel 2"):
        generate(ids, 4, url=srv.grpc_url, spec="mtp")
    text = log.read_text()
    shares = {
        int(r): float(x) for r, x in re.findall(r"rank (\d) of 2: [\d.]+ MiB of trunk weights, ([\d.]+) of", text)
    }
    assert sorted(shares) == [0, 1] and all(x <= 0.55 for x in shares.values()), shares


def _rank_logits(rank: int, size: int, port: int, folder: str, out: str, fp8: str = "auto") -> None:
    import torch.distributed as dist

    from tandem.model.checkpoint import load_trunk
    from tandem.ops.settings import REFERENCE

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    from tandem.engine.ranks import weight_bytes

    model = load_trunk(folder, torch.float32, kernels=REFERENCE, tp=TensorParallel(rank, size), fp8=fp8)
    with torch.no_grad():
        logits = model.logits(model.hidden(torch.tensor([IDS])))
    if rank == 0:
        torch.save((weight_bytes(model), logits, model.loaded_from), out)
    dist.destroy_process_group()


IDS = [5, 100, 2000, 33, 7, 800, 1234, 4000, 17, 99, 3, 8] * 3


@pytest.mark.parametrize("fp8", ["dequantize", "keep"])
def test_each_rank_reads_its_part_of_a_released_fp8_checkpoint(tmp_path, fp8):
    """The released layout in FP8 (per-expert tensors, block scales) loads split over 2 ranks, each reading its
    own experts and slices (kept in FP8 or dequantized): the logits agree with one rank's load of the same folder,
    at about half its bytes."""
    import torch.multiprocessing as mp

    from tandem.engine.ranks import weight_bytes
    from tandem.launch.host import free_ports
    from tandem.model.checkpoint import load_trunk
    from tandem.ops.settings import REFERENCE
    from tandem.tools.fp8 import fp8_copy

    folder = tmp_path / "fp8"
    fp8_copy(CHECKPOINT, folder)
    (port,) = free_ports(1)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_logits, args=(2, port, str(folder), str(out), fp8), nprocs=2, join=True)
    nbytes, logits, loaded_from = torch.load(out)
    one = load_trunk(folder, torch.float32, kernels=REFERENCE, with_mtp=False, fp8=fp8)
    with torch.no_grad():
        want = one.logits(one.hidden(torch.tensor([IDS])))
    assert (logits - want).abs().max().item() < 1e-4 and torch.equal(logits.argmax(-1), want.argmax(-1))
    assert nbytes <= 0.55 * weight_bytes(one)
    assert ("kept" in loaded_from) == (fp8 == "keep")
