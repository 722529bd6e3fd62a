"""Start-up glue shared by the ``model_repository/*/1/model.py`` adapters (Python backend): model
parameters, the checkpoint and dtype they name, and per-process torch threads."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import schema


def model_parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: ... value { string_value: ... } }`` of a parsed model config as a dict."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def serving_config(model_config: dict) -> schema.ServingConfig:
    """The model's parameters over :data:`tandem.schema.DEFAULTS`, with ``$TANDEM_CHECKPOINT``,
    ``$TANDEM_DTYPE``, ``$TANDEM_PREFIX_CACHE_MB`` and ``$TANDEM_BATCH_INVARIANT`` overriding
    ``checkpoint``, ``dtype``, ``prefix_cache_mb`` and ``batch_invariant`` (where the model has that parameter). Raises ``ValueError`` on a bad parameter."""
    params = model_parameters(model_config)
    env = {"checkpoint": "TANDEM_CHECKPOINT", "dtype": "TANDEM_DTYPE"}
    for name in ("prefix_cache_mb", "batch_invariant"):  # only the tandem / trunk model has it
        if name in params:
            env[name] = "TANDEM_" + name.upper()
    params.update({k: os.environ[v] for k, v in env.items() if os.environ.get(v)})
    return schema.ServingConfig.from_parameters(params)


def resolve_checkpoint(config: schema.ServingConfig, model_dir: str | Path, require_weights: bool = True) -> Path:
    """The checkpoint folder; a relative path resolves against the model repository (the parent of
    ``model_dir``, the folder Triton passes as ``args["model_repository"]``).

    Raises ``FileNotFoundError`` naming the folder and the missing file (``config.json``,
    ``tokenizer.json``, and ``model.safetensors`` when ``require_weights``).
    """
    p = Path(config.checkpoint)
    if not p.is_absolute():
        p = Path(model_dir).resolve().parent / p
    for f in ["config.json", "tokenizer.json"] + (["model.safetensors"] if require_weights else []):
        if not (p / f).exists():
            raise FileNotFoundError(f"checkpoint folder {p} lacks {f} (set TANDEM_CHECKPOINT or the model's "
                                    f"'checkpoint' parameter; `make model` trains the default)")
    return p


def set_torch_threads(n: int = 1) -> None:
    """One intra-op (and, if still possible, inter-op) thread per model process: the models share
    a 2-core machine."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass
