"""The serving parameter ``device`` (and ``dtype`` ``auto``): validation, resolution, the memory check
against the device's free memory (its CUDA branch through a mocked ``torch.cuda``: our arithmetic and
message, not CUDA), and a CPU tripwire for tensors the stages create off the model's device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem import schema
from tandem.engine.dflash_stage import DFlashStage
from tandem.engine.mtp_stage import MTPStage
from tandem.engine.scheduler import Scheduler, Turn
from tandem.engine.sampling import SamplingParams
from tandem.engine.trunk_stage import TrunkStage
from tandem.ops.cpu import gemm as cpu_gemm
from tandem.ops.settings import DEFAULT, REFERENCE, KernelSettings
from tandem.model.checkpoint import (
    check_fits,
    dflash_specs,
    dflash_feature_layers,
    load_dflash,
    load_trunk,
    param_bytes,
)
from tandem.model.config import TrunkConfig
from tandem.model.device import kernel_settings, parse_dtype, placement, resolve_device
from tandem.launch.settings import parameter_overrides
from tandem.serving.parameters import serving_config
from tandem.serving import proxies

GiB = 2**30


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports one CUDA device with ``free[0]`` bytes free (the test sets it)."""
    free = [80 * GiB]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * GiB))
    return free


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_device_values_parse(device):
    assert schema.ServingConfig.from_parameters({"device": device}).device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "mps", ""])
def test_bad_device_is_refused_naming_the_field(device):
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cpu', 'cuda', 'cuda:N'\)"):
        schema.ServingConfig(device=device)
    with pytest.raises(ValueError, match=r"device must be one of"):
        resolve_device(device)


def test_device_is_global_through_the_environment(monkeypatch):
    """``$TANDEM_DEVICE`` (``tandem serve --device``) applies to every model, over its config.pbtxt."""
    model = {"parameters": {"device": {"string_value": "auto"}, "dtype": {"string_value": "auto"}}}
    assert serving_config(model).device == "auto"
    monkeypatch.setenv("TANDEM_DEVICE", "cuda:1")
    assert serving_config(model).device == "cuda:1"
    assert serving_config({"parameters": {}}).device == "cuda:1"  # a model whose config names none
    monkeypatch.setenv("TANDEM_DEVICE", "gpu")
    with pytest.raises(ValueError, match="device must be one of"):
        serving_config(model)
    assert parameter_overrides({"device": "cpu", "dtype": None}) == {"TANDEM_DEVICE": "cpu"}
    with pytest.raises(ValueError, match="device must be one of"):
        parameter_overrides({"device": "tpu"})


def test_auto_is_the_cpu_and_fp32_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert placement(schema.DEFAULTS) == (torch.device("cpu"), torch.float32)  # the served CPU default
    assert placement(schema.ServingConfig(dtype="bf16", device="cpu")) == (torch.device("cpu"), torch.bfloat16)
    w = torch.randn(70, 8).to(torch.bfloat16).float()  # bf16 values: the GEMM inputs follow dtype
    fp32 = schema.ServingConfig(dtype="fp32")
    assert placement(fp32) == (torch.device("cpu"), torch.float32)
    assert kernel_settings(fp32) == KernelSettings(gemm_inputs="fp32")
    assert cpu_gemm.kernel_weight(w, kernel_settings(fp32))[0].dtype == np.uint16  # fp32 inputs: bf16 bits, strips
    assert kernel_settings(schema.DEFAULTS) == DEFAULT
    # auto: bf16 inputs, pairs (int32: AMX)
    assert cpu_gemm.kernel_weight(w, kernel_settings(schema.DEFAULTS))[0].dtype in (np.uint32, np.int32)
    with pytest.raises(ValueError, match=r"GEMM inputs must be one of \('bf16', 'fp32'\), got 'fp16'"):
        KernelSettings(gemm_inputs="fp16")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(
            ValueError,
            match=rf"device '{name}' \(model parameter 'device', \$TANDEM_DEVICE\): torch "
            r"sees no CUDA device .*use 'cpu' or 'auto'",
        ):
            resolve_device(name)
        with pytest.raises(ValueError, match="torch sees no CUDA device"):  # `tandem serve --device cuda`
            parameter_overrides({"device": name})


def test_auto_is_cuda_and_bf16_on_a_gpu(fake_gpu, monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert resolve_device("auto") == torch.device("cuda")
    assert parse_dtype("auto", "cuda") == parse_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert parse_dtype("auto", "cpu") == torch.float32 and parse_dtype("fp32", "cuda") == torch.float32
    assert placement(schema.ServingConfig(device="cuda:0")) == (torch.device("cuda:0"), torch.bfloat16)
    assert current == [torch.device("cuda:0")]  # Triton kernels launch on the current device
    with pytest.raises(ValueError, match=r"GPU index 1 is out of range, torch sees 1 GPU\(s\) \(cuda:0 \.\. cuda:0\)"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'bf16', 'fp32'\), got 'fp16'"):
        parse_dtype("fp16", "cuda")


def test_memory_check_uses_the_gpus_free_memory(fake_gpu, checkpoint):
    """The CUDA branch: the estimate is checked against ``mem_get_info`` of that device, and the refusal
    gives both numbers; a checkpoint that fits passes and the check returns the estimate."""
    cfg = TrunkConfig.load(checkpoint)
    n, need = param_bytes(cfg, torch.bfloat16)
    fake_gpu[0] = need // 3
    with pytest.raises(MemoryError) as e:
        check_fits(cfg, torch.bfloat16, True, checkpoint, "cuda:0")
    msg = str(e.value)
    assert f"needs about {need / 2**20:.1f} MiB for its weights ({n / 1e9:.2f}B parameters in bfloat16)" in msg
    assert f"but cuda:0 has only {need // 3 / 2**20:.1f} MiB free" in msg and "another GPU (device=cuda:N)" in msg
    fake_gpu[0] = need
    assert check_fits(cfg, torch.bfloat16, True, checkpoint, "cuda:0") == need


def test_loads_are_refused_before_touching_the_gpu(fake_gpu, checkpoint):
    """``load_trunk`` / ``load_dflash`` onto a GPU that cannot hold the weights raise before any
    CUDA allocation (this CPU build has none: an allocation would fail differently)."""
    fake_gpu[0] = 1 * 2**20
    with pytest.raises(MemoryError, match=rf"checkpoint {checkpoint} needs about .* but cuda:0 has only 1.0 MiB free"):
        load_trunk(checkpoint, torch.bfloat16, device="cuda:0")
    for spec in dflash_specs(checkpoint):
        fake_gpu[0] = 1000
        with pytest.raises(
            MemoryError,
            match=rf"the {spec} drafter .* needs about \d+\.\d MiB for its weights "
            r"\(0\.\d\dB parameters in bfloat16\), but cuda:0 has only 0\.0 MiB free",
        ):
            load_dflash(checkpoint, spec, torch.bfloat16, device="cuda:0")


def test_host_memory_check_names_the_cpu(monkeypatch, checkpoint):
    monkeypatch.setattr("tandem.model.checkpoint.free_bytes", lambda device="cpu": 5 * 2**20)
    with pytest.raises(MemoryError, match=r"but cpu has only 5\.0 MiB free; serve it on a larger machine, a GPU"):
        load_trunk(checkpoint, torch.float32, device="cpu")


class _MetaDefault(proxies.LocalTransport):
    """Every stage call runs with ``meta`` as torch's default device: a tensor a stage makes for the
    model without ``device=`` is then a meta tensor, which fails the call or changes its outputs."""

    def __call__(self, model, op, arrays):
        with torch.device("meta"):
            return super().__call__(model, op, arrays)


class _OnMeta:
    """A stage whose every method runs with ``meta`` as torch's default device (as :class:`_MetaDefault`)."""

    def __init__(self, stage) -> None:
        self.stage = stage

    def __getattr__(self, name):
        attr = getattr(self.stage, name)
        if not callable(attr):
            return attr

        def call(*a, **kw):
            with torch.device("meta"):
                return attr(*a, **kw)

        return call


def _turns(checkpoint, trunk, meta: bool, kernels: KernelSettings = DEFAULT) -> list[list[int]]:
    """Greedy turns on every spec and one sampled turn (prefix cache on): the trunk stage in this process, the
    drafters (loaded with ``kernels``) through their models' wire form (``colocate`` off); ``meta``: every
    stage call on meta."""
    feats = dflash_feature_layers(checkpoint)
    drafters = {a: load_dflash(checkpoint, a, torch.float32, kernels=kernels) for a in dflash_specs(checkpoint)}
    tr = (_MetaDefault if meta else proxies.LocalTransport)(
        {
            "drafter_mtp": MTPStage(trunk),
            "drafter_dflash": DFlashStage(drafters, trunk.embed_tokens, trunk.lm_head),
        }
    )
    dfl = proxies.DFlashProxy(tr)
    stage = TrunkStage(trunk, 512, feats)
    sched = Scheduler(
        _OnMeta(stage) if meta else stage,
        {schema.MTP: proxies.DrafterProxy(tr), **{a: dfl for a in drafters}},
        schema.DEFAULTS,
    )
    prompt = list(range(10, 10 + schema.PREFIX_BLOCK + 9))
    out = []
    for i, (spec, smp) in enumerate(
        [
            (schema.MTP, None),
            (schema.OFF, None),
            *((a, None) for a in drafters),
            (schema.MTP, SamplingParams.create(0.8, 0, 1.0, 7)),
        ]
    ):
        got: list[int] = []

        def emit(r, err, final, got=got):
            assert err is None, err
            got.extend(r.tokens)

        sched.admit([Turn(100 + i, prompt, 6, emit, spec=spec, sampling=smp)])
        while 100 + i in sched.turns:
            sched.burst()
        out.append(got)
    return out


def test_stages_create_no_tensor_off_the_model_device(checkpoint):
    """On the torch path (what CUDA runs with kernels=torch, and around the Triton kernels otherwise)
    every tensor the stages make for the model goes to its device: with meta as the default device
    the served turns are unchanged."""
    trunk = load_trunk(checkpoint, torch.float32, kernels=REFERENCE)
    want = _turns(checkpoint, trunk, False, REFERENCE)
    got = _turns(checkpoint, trunk, True, REFERENCE)
    assert got == want and all(len(t) == 6 for t in want)
