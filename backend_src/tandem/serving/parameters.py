"""A Triton model's configuration at load: its ``parameters`` over :data:`tandem.schema.DEFAULTS`, each
overridden by ``$TANDEM_<NAME>``, and the checkpoint and drafter folders they name."""

from __future__ import annotations

import os
from pathlib import Path

from .. import schema
from ..schema import env_name


def model_parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: ... value { string_value: ... } }`` of a parsed model config as a dict."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def serving_config(model_config: dict) -> schema.ServingConfig:
    """The model's parameters over :data:`tandem.schema.DEFAULTS`, each overridden by the environment
    variable :func:`env_name` (``$TANDEM_MAX_CTX`` for ``max_ctx``; ``tandem serve`` flags set them);
    ``$TANDEM_CHECKPOINT``, ``$TANDEM_DTYPE``, ``$TANDEM_DEVICE`` and ``$TANDEM_KERNELS`` apply to every
    model (``device`` and ``kernels`` are applied at load: :func:`tandem.model.device.placement`). Raises
    ``ValueError`` on a bad parameter."""
    params = model_parameters(model_config)
    env = {name: env_name(name) for name in ("checkpoint", "dtype", "device", "kernels", *params)}
    params.update({k: os.environ[v] for k, v in env.items() if os.environ.get(v)})
    return schema.ServingConfig.from_parameters(params)


def resolve_checkpoint(config: schema.ServingConfig, model_dir: str | Path, require_weights: bool = True) -> Path:
    """The checkpoint folder; a relative path resolves against the model repository (the parent of
    ``model_dir``, the folder Triton passes as ``args["model_repository"]``).

    Raises ``FileNotFoundError`` naming the folder and the missing file (``config.json``,
    ``tokenizer.json``, and ``model.safetensors`` or the sharded ``model.safetensors.index.json`` when
    ``require_weights``).
    """
    p = Path(config.checkpoint)
    if not p.is_absolute():
        p = Path(model_dir).resolve().parent / p
    weights = "model.safetensors.index.json" if (p / "model.safetensors.index.json").exists() else "model.safetensors"
    for f in ["config.json", "tokenizer.json"] + ([weights] if require_weights else []):
        if not (p / f).exists():
            raise FileNotFoundError(
                f"checkpoint folder {p} lacks {f} (set TANDEM_CHECKPOINT or the model's "
                f"'checkpoint' parameter; `make model` trains the default)"
            )
    return p


def drafter_dirs(config: schema.ServingConfig, model_dir: str | Path, checkpoint: Path) -> dict:
    """The DFlash drafter folders by spec (:func:`tandem.model.checkpoint.drafter_dirs`): the
    ``dflash_checkpoint`` / ``dflash2_checkpoint`` parameters (relative to the model repository, like
    ``checkpoint``) where set, else ``<checkpoint>/<spec>``. Raises ``FileNotFoundError``."""
    from ..model.checkpoint import drafter_dirs as dirs

    repo = Path(model_dir).resolve().parent
    given = {
        a: (p if Path(p).is_absolute() else repo / p)
        for a in schema.DFLASH_SPECS
        if (p := getattr(config, f"{a}_checkpoint"))
    }
    return dirs(checkpoint, given)
