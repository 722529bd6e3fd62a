"""Every config.pbtxt agrees with tandem.schema, read with Triton's own model-config protobuf.

The checker compares both directions (each schema tensor is in the config with the same dtype,
dims and optional flag, and the config has no tensor the schema lacks), so renaming an input in
either place fails until the other follows; `test_checker_catches_a_renamed_input` proves it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tandem import schema, schema_text
from tandem.launch.serve import MODELS, MODEL_REPOSITORY


def load_config(name: str) -> mc.ModelConfig:
    return text_format.Parse((MODEL_REPOSITORY / name / "config.pbtxt").read_text(), mc.ModelConfig())


def _tensors(entries) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    return {e.name: (mc.DataType.Name(e.data_type), tuple(e.dims), getattr(e, "optional", False)) for e in entries}


def config_errors(wire: schema.ModelWire, cfg: mc.ModelConfig) -> list[str]:
    """Every disagreement between a model's schema and its parsed config, as readable lines."""
    errs = []
    if cfg.name != wire.name:
        errs.append(f"name {cfg.name!r} != {wire.name!r}")
    for what, want_specs, got in (
        ("input", wire.inputs, _tensors(cfg.input)),
        ("output", wire.outputs, _tensors(cfg.output)),
    ):
        want = {t.name: (t.dtype, t.dims, t.optional if what == "input" else False) for t in want_specs}
        for n in sorted(want.keys() - got.keys()):
            errs.append(f"{what} {n} is in the schema but not in config.pbtxt")
        for n in sorted(got.keys() - want.keys()):
            errs.append(f"{what} {n} is in config.pbtxt but not in the schema")
        for n in sorted(want.keys() & got.keys()):
            if want[n] != got[n]:
                errs.append(f"{what} {n}: schema (dtype, dims, optional) {want[n]} != config {got[n]}")
    if cfg.model_transaction_policy.decoupled != wire.decoupled:
        errs.append(f"decoupled {cfg.model_transaction_policy.decoupled} != {wire.decoupled}")
    if cfg.HasField("sequence_batching"):  # the worker owns sessions (tandem's model.py refuses it too)
        errs.append("sequence_batching is set; sessions belong to tandem's worker")
    if set(cfg.parameters) != set(wire.parameters):
        errs.append(f"parameters {sorted(cfg.parameters)} != {sorted(wire.parameters)}")
    for k in set(cfg.parameters) & set(wire.parameters):
        default = getattr(schema.DEFAULTS, k)
        if str(default) != cfg.parameters[k].string_value:
            errs.append(f"parameter {k} = {cfg.parameters[k].string_value!r}, schema default {default!r}")
    return errs


@pytest.mark.parametrize("name", MODELS)
def test_config_matches_schema(name):
    assert config_errors({**schema.MODELS, **schema_text.MODELS}[name], load_config(name)) == []


def test_no_model_runs_more_than_one_instance():
    """Each model keeps per-sequence state in one process: the shipped configs ask for one instance,
    and a config asking for more is refused at load with the reason."""
    from google.protobuf import json_format

    from tandem.serving.process import IN_ORDER, require_one_instance

    for name in (*schema.MODELS, schema_text.POSTPROCESSING.name):  # preprocessing is stateless
        cfg = load_config(name)
        assert sum(g.count for g in cfg.instance_group) == 1, name
        require_one_instance(json_format.MessageToDict(cfg, preserving_proto_field_name=True))
        cfg.instance_group[0].count = 2
        post = name == schema_text.POSTPROCESSING.name
        with pytest.raises(
            ValueError,
            match=f"model '{name}': instance_group asks for 2 instances, but "
            f"{'two instances could finish' if post else 'tandem keeps'}.*replicas",
        ):
            require_one_instance(
                json_format.MessageToDict(cfg, preserving_proto_field_name=True), *([IN_ORDER] if post else [])
            )
    from tandem.serving import text_models

    assert "require_one_instance(config, IN_ORDER)" in Path(text_models.__file__).read_text()


def test_checker_catches_a_renamed_input():
    spec = schema.TANDEM
    renamed = dataclasses.replace(
        spec,
        inputs=tuple(
            dataclasses.replace(t, name="MAX_NEW_TOKENS") if t.name == schema.MAX_TOKENS else t for t in spec.inputs
        ),
    )
    errs = config_errors(renamed, load_config("tandem"))
    assert "input MAX_NEW_TOKENS is in the schema but not in config.pbtxt" in errs
    assert "input MAX_TOKENS is in config.pbtxt but not in the schema" in errs
    retyped = dataclasses.replace(
        spec, outputs=tuple(dataclasses.replace(t, dims=(-1,)) if t.name == schema.ROUNDS else t for t in spec.outputs)
    )
    assert any(e.startswith("output ROUNDS:") for e in config_errors(retyped, load_config("tandem")))
    cfg = load_config("tandem")
    other = next(d for d in schema.DTYPES if d != schema.DEFAULTS.dtype)
    cfg.parameters["dtype"].string_value = other
    assert config_errors(schema.TANDEM, cfg) == [
        f"parameter dtype = {other!r}, schema default {schema.DEFAULTS.dtype!r}"
    ]


def test_serving_config_parameters():
    cfg = schema.ServingConfig.from_parameters({"num_draft_tokens": "2", "max_ctx": "512"}, dtype="fp32")
    assert (cfg.num_draft_tokens, cfg.max_ctx, cfg.dtype, cfg.burst_rounds) == (
        2,
        512,
        "fp32",
        schema.DEFAULTS.burst_rounds,
    )
    with pytest.raises(ValueError, match="unknown model parameter 'max_k'"):
        schema.ServingConfig.from_parameters({"max_k": "16"})
    with pytest.raises(ValueError, match="model parameter 'max_ctx' must be int, got 'lots'"):
        schema.ServingConfig.from_parameters({"max_ctx": "lots"})
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[1, 8\], got 9"):
        schema.ServingConfig(num_draft_tokens=9)
    with pytest.raises(ValueError, match=r"compute_nice must be in \[-20, 19\], got -21"):
        schema.ServingConfig.from_parameters({"compute_nice": "-21"})


def test_range_errors_use_wire_names():
    spec = schema.TANDEM.input(schema.NUM_DRAFT_TOKENS)
    schema.check_range(spec, 8)
    with pytest.raises(schema.WireError, match=r"^NUM_DRAFT_TOKENS must be in \[1, 4\], got 5$"):
        schema.check_range(spec, 5, hi=4)
    with pytest.raises(schema.WireError, match=r"^LENGTHS must be >= 1, got 0$"):
        schema.check_range(schema.DRAFTER_MTP.input("LENGTHS"), 0)


def test_serve_options_become_checked_model_parameters(monkeypatch):
    """`tandem serve` flags and `--set NAME=VALUE` become the TANDEM_<NAME> variables the models read;
    an unknown name, a name no model takes, or a bad value is refused before anything starts."""
    from tandem.launch.settings import parameter_overrides, parse_settings
    from tandem.serving.parameters import serving_config

    env = parameter_overrides({"spec": "mtp", "burst_rounds": 1, "max_ctx": None, **parse_settings(["max_sessions=9"])})
    assert env == {"TANDEM_SPEC": "mtp", "TANDEM_BURST_ROUNDS": "1", "TANDEM_MAX_SESSIONS": "9"}
    from google.protobuf import json_format

    cfg = json_format.MessageToDict(load_config("tandem"), preserving_proto_field_name=True)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = serving_config(cfg)
    assert (got.spec, got.burst_rounds, got.max_sessions) == ("mtp", 1, 9)
    for bad, msg in [
        ({"spec": "beam"}, "spec must be one of"),
        ({"max_k": "3"}, "no model takes parameter 'max_k'"),
        ({"burst_rounds": "x"}, "'burst_rounds' must be int"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parameter_overrides(bad)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_settings(["burst_rounds"])
