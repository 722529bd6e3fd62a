"""The engine on the Triton kernels: the shipped model's speculative decoding with every kernel forced
(kernel settings with the ``triton`` backend; on the CPU they run in Triton's interpreter) gives the
same tokens as the pure-torch path, and each hooked kernel is actually called. Auto mode on the CPU
takes no kernel (torch / numba)."""

import pytest

pytest.importorskip("triton")

from tandem.engine.inprocess import Engine  # noqa: E402
from tandem.ops import dispatch  # noqa: E402
from tandem.ops.settings import REFERENCE, KernelSettings  # noqa: E402

#: (module, launcher the engine calls) for every hooked kernel
HOOKS = [
    ("sampler", "targets_and_gaps"),
    ("kda_verify", "kda_rows"),
    ("block_attention", "block_attention"),
    ("dsa_indexer", None),
    ("mla_attention", None),
]


def test_auto_takes_no_kernel_on_the_cpu(engine, tokenizer, calls):
    ids = tokenizer.chat_prompt("Write a haiku about the sea.")
    out = engine.generate(ids, 6, spec="dflash2")  # (the engine's settings: auto)
    assert len(out["token_ids"]) == 6 and not calls


def _engine(trunk, tokenizer, settings=None):
    """An engine on ``trunk`` with the kernel settings ``settings`` (default: from the serving defaults, auto)."""
    return Engine(
        model=trunk,
        tokenizer=tokenizer,
        burst_rounds=2,
        adaptive_draft=False,
        prefix_cache_mb=0,
        kernel_settings=settings,
    )


@pytest.fixture
def engine(trunk_fp32, tokenizer):
    return _engine(trunk_fp32, tokenizer)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of every public launcher of the hooked kernel modules."""
    import importlib

    counts: dict[str, int] = {}
    for name, _ in HOOKS:
        mod = importlib.import_module(f"tandem.ops.triton.{name}")
        for attr in getattr(mod, "ENGINE_LAUNCHERS", ()):
            fn = getattr(mod, attr)

            def wrapped(*a, _fn=fn, _key=f"{name}.{attr}", **k):
                counts[_key] = counts.get(_key, 0) + 1
                return _fn(*a, **k)

            monkeypatch.setattr(mod, attr, wrapped)
    return counts


@pytest.mark.parametrize("spec,sampled,n", [("dflash2", False, 16), ("mtp", True, 10)])
def test_speculative_decoding_on_kernels_equals_torch(trunk_fp32, tokenizer, sharegpt_prompts, calls, spec, sampled, n):
    """Greedy DFlash2 and sampled (rejection, seeded) MTP; the interpreter costs seconds a round."""
    if not dispatch.interpreted():
        pytest.skip("the in-process engine holds CPU tensors: forcing the kernels on them needs TRITON_INTERPRET=1")
    # a whole chat prompt of > 64 tokens (DSA selects pools, rows cross pool boundaries) that the drafters continue
    # well: the n tokens take a few verify rounds, each of which costs seconds in the interpreter, with acceptances
    ids = tokenizer.chat_prompt(sharegpt_prompts[14])
    assert 64 < len(ids) <= 96, len(ids)
    kw = dict(temperature=0.8, seed=11) if sampled else {}
    ref = _engine(trunk_fp32, tokenizer, REFERENCE).generate(ids, n, spec=spec, **kw)
    assert not calls
    got = _engine(trunk_fp32, tokenizer, KernelSettings(backend="triton")).generate(ids, n, spec=spec, **kw)
    _engine(trunk_fp32, tokenizer)  # the shared trunk back on the default settings
    assert got["error"] is None and ref["error"] is None
    assert got["token_ids"] == ref["token_ids"] and len(got["token_ids"]) == n
    assert got["accepted"] == ref["accepted"] and got["accepted"] > 0 and got["rounds"] == ref["rounds"] >= 3
    hooked = {k.split(".")[0] for k, n in calls.items() if n > 0}
    want = {"sampler", "kda_verify", "dsa_indexer", "mla_attention"} | (
        {"block_attention"} if spec == "dflash2" else set()
    )
    assert hooked >= want, calls


def test_the_switch_is_a_checked_server_parameter(monkeypatch):
    """``--set kernels=…`` reaches every model that computes as $TANDEM_KERNELS, checked before anything starts:
    a bad value, or the kernels forced on the CPU without Triton's interpreter, is refused with the way out."""
    from tandem import schema
    from tandem.launch.settings import parameter_overrides
    from tandem.serving.parameters import serving_config

    assert {m for m, spec in schema.MODELS.items() if "kernels" in spec.parameters} == {
        "tandem",
        "drafter_mtp",
        "drafter_dflash",
    }
    assert parameter_overrides({"kernels": "torch"}) == {"TANDEM_KERNELS": "torch"}
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'triton', 'torch'\), got 'fast'"):
        parameter_overrides({"kernels": "fast"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert parameter_overrides({"kernels": "triton"}) == {"TANDEM_KERNELS": "triton"}
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"kernels=triton .* on the CPU needs TRITON_INTERPRET=1.*use kernels=auto"):
        parameter_overrides({"kernels": "triton"})
    monkeypatch.setenv("TANDEM_DEVICE", "gpu")  # the shell's variables are checked as the flags are
    with pytest.raises(ValueError, match=r"\$TANDEM_DEVICE \(from the environment\): device must be one of"):
        parameter_overrides({})
    monkeypatch.delenv("TANDEM_DEVICE")
    # a stage model's start-up (serving_config, then placement) gives its models the kernel settings
    from tandem.model.device import kernel_settings, placement

    monkeypatch.setenv("TANDEM_KERNELS", "torch")
    cfg = serving_config({"parameters": {"kernels": {"string_value": "auto"}}})
    assert placement(cfg)[0].type == "cpu"
    assert cfg.kernels == "torch" and kernel_settings(cfg).backend == "torch"
