"""Checkpoints: load and save the Hugging Face layout (``config.json`` + ``model.safetensors``), the
fp32-kept parameters, and transformers-style initialisation."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import schema
from .config import TrunkConfig
from .layers import input_major_linears
from .trunk import Trunk

#: The shipped checkpoint: ``model_repository/<ServingConfig.checkpoint>``.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[3] / "model_repository" / schema.DEFAULTS.checkpoint

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"`` / ``"fp32"`` (:data:`tandem.schema.DTYPES`) -> torch dtype. Raises ``ValueError`` otherwise."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {schema.DTYPES}, got {name!r}") from None


FP32_KEEP = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log",
             "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale")


def is_fp32_param(name: str) -> bool:
    """Parameters kept in fp32 whatever the compute dtype (transformers' ``_keep_in_fp32_modules_strict``)."""
    return any(k in name for k in FP32_KEEP)


def cast_trunk(model: Trunk, dtype: torch.dtype) -> Trunk:
    """Cast to ``dtype`` except the fp32-kept parameters and buffers, linear weights stored
    input-major (:func:`~tandem.model.layers.input_major_linears`). Returns ``model``."""
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if is_fp32_param(name) else dtype)
    for name, b in model.named_buffers():
        if not is_fp32_param(name):
            b.data = b.data.to(dtype)
    return input_major_linears(model)


def load_trunk(folder: str | Path, dtype: torch.dtype = torch.bfloat16, with_mtp: bool = True,
               overrides: dict | None = None) -> Trunk:
    """Load ``config.json`` + ``model.safetensors`` from a checkpoint folder; ``overrides`` replace
    config fields (e.g. ``{"index_topk": 4096}`` for the dense DSA regime).

    Raises ``FileNotFoundError`` if the folder lacks them, ``KeyError`` on missing trunk keys.
    """
    import dataclasses

    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"no model.safetensors in {folder} (run `make model`)")
    cfg = TrunkConfig.load(folder)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    model = Trunk(cfg, with_mtp=with_mtp)
    sd = load_file(str(folder / "model.safetensors"))
    if not with_mtp:
        prefix = f"layers.{cfg.num_hidden_layers}."
        sd = {k: v for k, v in sd.items() if not k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise KeyError(f"checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    model.eval().requires_grad_(False)
    return cast_trunk(model, dtype)


def save_trunk(model: Trunk, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (``dtype`` except fp32-kept parameters)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.cfg.save(folder)
    sd = {}
    for k, v in model.state_dict().items():
        sd[k] = v.detach().to(torch.float32 if is_fp32_param(k) else dtype).contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def init_weights(model: Trunk, seed: int = 0, std: float = 0.02) -> Trunk:
    """Initialise like transformers' ``_init_weights`` (normal(0, std) linears/embeddings, KDA gate
    per FLA, mHC ``fn ~ N(0, std)``, ``base = 0``, ``scale = 1``)."""
    import math

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "k_norm.weight" in name:
                p.fill_(1.0)
            elif "k_norm.bias" in name or name.endswith(".base") or "compress_ape" in name:
                p.zero_()
            elif name.endswith(".scale"):
                p.fill_(1.0)
            elif "compress_gate" in name:
                p.normal_(0.0, std, generator=g)
            elif name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "conv1d" in name:
                p.normal_(0.0, 0.5, generator=g)
            else:
                p.normal_(0.0, std, generator=g)
    return model


# -- DFlash drafters: <checkpoint>/<arm>/{config.json, model.safetensors}, arm in tandem.schema.DFLASH_ARMS --------
def dflash_arms(folder: str | Path) -> list[str]:
    """The DFlash arms whose drafter checkpoint exists under ``folder``."""
    return [a for a in schema.DFLASH_ARMS if (Path(folder) / a / "model.safetensors").exists()]


def dflash_feature_layers(folder: str | Path) -> tuple[int, ...]:
    """The trunk layers every DFlash drafter under ``folder`` reads (empty without drafters).
    Raises ``ValueError`` when two drafters want different layers (the trunk exports one set)."""
    from .dflash import DFlashConfig

    sets = {tuple(DFlashConfig.load(Path(folder) / a).target_layer_ids) for a in dflash_arms(folder)}
    if len(sets) > 1:
        raise ValueError(f"DFlash drafters in {folder} read different target layers: {sorted(sets)}")
    return sets.pop() if sets else ()


def load_dflash(folder: str | Path, arm: str, dtype: torch.dtype = torch.bfloat16):
    """The ``arm`` drafter (:class:`~tandem.model.dflash.DFlashDrafter`) of a checkpoint folder, in
    eval mode. Raises ``FileNotFoundError`` when it is missing, ``KeyError`` on missing or unexpected keys."""
    from safetensors.torch import load_file

    from .dflash import DFlashConfig, DFlashDrafter

    sub = Path(folder) / arm
    if not (sub / "model.safetensors").exists():
        raise FileNotFoundError(f"no {arm} drafter in {folder} (expected {sub}/model.safetensors; `make model` trains it)")
    model = DFlashDrafter(DFlashConfig.load(sub), dflash2=arm == schema.DFLASH2)
    missing, unexpected = model.load_state_dict(load_file(str(sub / "model.safetensors")), strict=False)
    if missing or unexpected:
        raise KeyError(f"{arm} drafter checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    return input_major_linears(model.eval().requires_grad_(False).to(dtype))


def save_dflash(model, folder: str | Path, arm: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``<folder>/<arm>/config.json`` and ``model.safetensors``."""
    from safetensors.torch import save_file

    sub = Path(folder) / arm
    model.cfg.save(sub)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()},
              str(sub / "model.safetensors"), metadata={"format": "pt"})
