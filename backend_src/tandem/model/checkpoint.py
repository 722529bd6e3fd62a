"""Checkpoints: load and save the Hugging Face layout (``config.json`` + ``model.safetensors``), the
fp32-kept parameters, and transformers-style initialisation."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..ops.settings import DEFAULT, KernelSettings
from .. import schema
from .config import TrunkConfig
from .device import check_bytes, free_bytes, parse_dtype  # noqa: F401 - parse_dtype, free_bytes: re-exported
from .layers import input_major_linears
from .trunk import FP32_KEEP, Trunk, is_fp32_param  # noqa: F401 - FP32_KEEP, is_fp32_param: re-exported

#: The shipped checkpoint: ``model_repository/<ServingConfig.checkpoint>``.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[3] / "model_repository" / schema.DEFAULTS.checkpoint


def cast_trunk(model: Trunk, dtype: torch.dtype) -> Trunk:
    """Cast to ``dtype`` except the fp32-kept parameters and buffers, linear weights stored
    input-major (:func:`~tandem.model.layers.input_major_linears`). Returns ``model``."""
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if is_fp32_param(name) else dtype)
    for name, b in model.named_buffers():
        if not is_fp32_param(name):
            b.data = b.data.to(dtype)
    return input_major_linears(model)


#: a sharded checkpoint's index (transformers' layout: ``{"weight_map": {key: shard file}}``)
INDEX = "model.safetensors.index.json"


def weight_map(folder: str | Path) -> dict[str, Path]:
    """Every tensor key of a checkpoint folder -> the safetensors file holding it: through
    ``model.safetensors.index.json`` (sharded) or the single ``model.safetensors``. Raises
    ``FileNotFoundError`` naming a missing file (the weights, or a shard the index names)."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / INDEX).exists():
        wm = json.loads((folder / INDEX).read_text())["weight_map"]
        files = {f: folder / f for f in set(wm.values())}
        gone = sorted(f for f, path in files.items() if not path.exists())
        if gone:
            raise FileNotFoundError(f"{folder / INDEX} names shard(s) not in the folder: {gone}")
        return {k: files[f] for k, f in wm.items()}
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"no model.safetensors or {INDEX} in {folder} (run `make model`)")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: folder / "model.safetensors" for k in f.keys()}


def param_bytes(cfg: TrunkConfig, dtype: torch.dtype, with_mtp: bool = True) -> tuple[int, int]:
    """(parameters, bytes) of the trunk built from ``cfg`` in ``dtype`` (fp32-kept ones at 4 bytes),
    counted on the meta device: no memory is used."""
    with torch.device("meta"):
        model = Trunk(cfg, with_mtp=with_mtp)
    n = b = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n += t.numel()
        b += t.numel() * (4 if is_fp32_param(name) else dtype.itemsize)
    return n, b


def check_fits(
    cfg: TrunkConfig, dtype: torch.dtype, with_mtp: bool, folder: str | Path, device: str | torch.device = "cpu"
) -> int:
    """Refuse a checkpoint whose weights cannot fit on ``device`` before anything is allocated:
    :func:`param_bytes` against :func:`~tandem.model.device.free_bytes` (host ``MemAvailable``, or
    the GPU's free memory). Returns the estimate in bytes; raises ``MemoryError`` giving both."""
    n, need = param_bytes(cfg, dtype, with_mtp)
    free = free_bytes(device)
    try:
        check_bytes(
            need,
            free,
            f"checkpoint {folder}",
            device,
            f" ({n / 1e9:.2f}B parameters in {str(dtype).removeprefix('torch.')})",
        )
    except MemoryError as e:
        raise MemoryError(f"{e}{_split_hint(cfg, dtype, free)}") from None
    return need


def _split_hint(cfg: TrunkConfig, dtype: torch.dtype, free: int) -> str:
    """What tensor parallelism would need a rank (:func:`~tandem.model.parallel.split_bytes`, as ``make plan``
    prints it): the fewest ranks, up to 64, whose part fits in ``free`` bytes, or the 64-way part."""
    from .parallel import split_bytes

    kind = "fp32" if dtype == torch.float32 else "bf16"
    for n in (2, 4, 8, 16, 32, 64):
        rank = split_bytes(cfg, kind, n)[2]
        if rank < free or n == 64:
            fits = "fits" if rank < free else "still does not fit"
            return f"; split over {n} ranks (--tensor-parallel {n}) it needs {rank / 2**30:.1f} GiB a rank, which {fits} (make plan)"
    return ""


def load_trunk(
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    with_mtp: bool = True,
    overrides: dict | None = None,
    device: str | torch.device = "cpu",
    kernels: KernelSettings = DEFAULT,
    tp=None,
    fp8: str = "auto",
) -> Trunk:
    """Load a checkpoint folder: ``config.json`` (:meth:`TrunkConfig.from_dict`, strict) and its
    weights, sharded (``model.safetensors.index.json``) or one ``model.safetensors``, in either layout of
    :mod:`~tandem.model.layout` (flat text, or the released ``Glm5NextForConditionalGeneration``: its vision tower
    skipped unread) with in-memory or on-disk tensor names, FP8 block-scaled weights dequantized as they are
    read, into a model built on the meta device and allocated once on ``device`` in ``dtype`` (fp32-kept
    parameters in fp32) after :func:`check_fits`. ``overrides`` replace config fields (e.g. ``{"index_topk":
    4096}`` for the dense DSA regime); the MTP layer is left out (not read) without ``with_mtp`` or when
    ``num_nextn_predict_layers`` is 0. The model runs with the kernel settings ``kernels``
    (:func:`tandem.ops.dispatch.install`); its :attr:`~tandem.model.trunk.Trunk.loaded_from` says what was read,
    and its :attr:`~tandem.model.trunk.Trunk.vision_token_ids` are the placeholders a prompt may not hold.
    With ``tp`` (a :class:`~tandem.model.parallel.TensorParallel` group) the model is that rank's part of the
    trunk, without its MTP layer (:mod:`tandem.model.parallel`), and the memory check counts that part.
    ``fp8`` (:data:`tandem.schema.FP8_MODES`, the serving parameter ``fp8_weights``) says what becomes of an FP8
    checkpoint's block-scaled weights: ``dequantize`` to bfloat16 values at load; ``keep`` held in FP8
    (:mod:`tandem.model.fp8`: a byte a weight plus its scales; the memory check counts that); ``auto`` keeps them on
    CUDA and dequantizes them elsewhere. A trunk kept in FP8 on the CPU runs without the numba kernels (they read
    dequantized weights): its kernel settings are ``kernels`` with ``numba`` off, and the torch path dequantizes each
    weight per call (a checking path, many times slower than the dequantized trunk).

    Raises ``FileNotFoundError`` if the folder lacks a file, ``KeyError`` naming missing or
    unexpected keys, ``ValueError`` naming a key whose shape differs (or whose FP8 form does not fit, or a
    config field tandem cannot honour, an unknown ``fp8``), ``MemoryError`` when the weights cannot fit.
    """
    import dataclasses

    from ..ops.fp8 import SCALE_SUFFIX
    from .fp8 import keep_fp8
    from .layout import CheckpointTensors, Layout

    folder = Path(folder)
    files = weight_map(folder)
    cfg = TrunkConfig.load(folder)
    layout = Layout.read(folder)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    with_mtp = with_mtp and cfg.num_nextn_predict_layers > 0 and tp is None
    keep = keeps_fp8(fp8, layout.fp8 is not None, device)
    if tp is None and not keep:
        check_fits(cfg, dtype, with_mtp, folder, device)
    tensors = CheckpointTensors(files, layout)
    if not with_mtp:
        tensors.drop(f"layers.{cfg.num_hidden_layers}.")
    with torch.device("meta"):
        if tp is None:
            model = Trunk(cfg, with_mtp=with_mtp)
        else:
            from .parallel import local_config, split_trunk

            model = split_trunk(Trunk(local_config(cfg, tp), with_mtp=False), cfg, tp)
    spans = {k: _span(k, tensors, tuple(t.shape), tp) for k, t in model.state_dict().items()}
    forms: dict[str, tuple[int, int]] = {}
    if keep:
        for k in tensors.keys() & spans.keys():
            if (k.endswith(".weight") or k.endswith("_proj")) and (b := tensors.fp8_form(k, _part(spans[k]))):
                forms[k] = b
        with torch.device("meta"):
            keep_fp8(model, forms)
        held = model.state_dict()
        forms = {k: b for k, b in forms.items() if k + SCALE_SUFFIX in held}  # those swapped
    if tp is not None or keep:
        need = sum(_held_bytes(n, t, dtype) for n, t in list(model.named_parameters()) + list(model.named_buffers()))
        what = f"checkpoint {folder}" if tp is None else f"rank {tp.rank} of checkpoint {folder}"
        check_bytes(need, free_bytes(device), what, device, " (FP8 kept)" if forms else "")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.dtype != torch.float8_e4m3fn and not name.endswith(SCALE_SUFFIX):
            t.data = t.data.to(torch.float32 if is_fp32_param(name) else dtype)
    model = model.to_empty(device=device)
    sd = model.state_dict()
    have = tensors.keys()
    scales = {k + SCALE_SUFFIX for k in forms}
    missing, unexpected = sorted(sd.keys() - have - scales), sorted((have - sd.keys()) | set(tensors.unexpected))
    if missing or unexpected:
        raise KeyError(
            f"checkpoint {folder} does not fit its config: {len(missing)} missing key(s) {missing[:5]}, "
            f"{len(unexpected)} unexpected key(s) {unexpected[:5]}"
        )
    by_file: dict[Path, list[str]] = {}
    for k in (k for k in sd if k not in scales):
        by_file.setdefault(files[tensors.sources(k)[0]], []).append(k)
    for f in sorted(by_file):  # about one shard at a time
        for k in by_file[f]:
            if k in forms:  # held in FP8: the weight and its scales
                w, sc = tensors.read_fp8(k, forms[k], _part(spans[k]))
                for key, t in ((k, w), (k + SCALE_SUFFIX, sc)):
                    if tuple(t.shape) != tuple(sd[key].shape):
                        raise ValueError(f"{f.name}: {key} has shape {list(t.shape)}, FP8 wants {list(sd[key].shape)}")
                    sd[key].copy_(t)
                continue
            if tp is None:
                t = tensors.read(k)
            else:  # this rank's part only (a KDA conv's thirds: read whole, then split)
                from .parallel import shard

                t = tensors.read(k, _part(spans[k]))
                t = shard(k, t, sd[k], tp) if spans[k] == "conv" else t
            if tuple(t.shape) != tuple(sd[k].shape):
                raise ValueError(f"{f.name}: {k} has shape {list(t.shape)}, the config wants {list(sd[k].shape)}")
            sd[k].copy_(t)
    tensors.close()
    model.eval().requires_grad_(False)
    n_vis, vis_bytes = tensors.skipped
    model.loaded_from = ", ".join(
        ["released layout (model.language_model.*)" if layout.released else "flat text layout"]
        + ([f"{n_vis} vision tensors skipped unread ({vis_bytes / 2**20:.1f} MiB)"] if n_vis else [])
        + (
            [
                f"FP8 {layout.fp8.block[0]}x{layout.fp8.block[1]} blocks "
                + (
                    f"kept ({len(forms)} tensors{', torch path' if torch.device(device).type == 'cpu' else ''})"
                    if forms
                    else "dequantized at load"
                )
            ]
            if layout.fp8
            else []
        )
    )
    model.vision_token_ids = layout.vision_token_ids
    model.fp8_kept = bool(forms)  # (on the CPU its kernel settings then lose the numba kernels: use_kernels)
    return input_major_linears(model).use_kernels(kernels)


def keeps_fp8(mode: str, fp8_checkpoint: bool, device: str | torch.device) -> bool:
    """Whether a load holds a checkpoint's FP8 weights in FP8 (``mode``: :data:`tandem.schema.FP8_MODES`; see
    :func:`load_trunk`): never for a checkpoint without them. Raises ``ValueError`` naming ``fp8_weights`` for an
    unknown mode."""
    if mode not in schema.FP8_MODES:
        raise ValueError(f"fp8_weights must be one of {schema.FP8_MODES}, got {mode!r}")
    return fp8_checkpoint and (mode == "keep" or (mode == "auto" and torch.device(device).type == "cuda"))


def _span(key: str, tensors, like: tuple[int, ...], tp):
    """The part of checkpoint key ``key`` a parameter of shape ``like`` takes (:func:`~tandem.model.parallel.shard_span`;
    None without tensor parallelism or for a key the checkpoint lacks)."""
    if tp is None or key not in tensors.keys():
        return None
    from .parallel import shard_span

    return shard_span(key, tensors.shape(key), like, tp)


def _part(span):
    """A span as :meth:`~tandem.model.layout.CheckpointTensors.read` takes it: a ``(dim, start, end)`` or None."""
    return span if isinstance(span, tuple) else None


def _held_bytes(name: str, t: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes a loaded tensor holds: FP8 at one byte, its scales and fp32-kept ones at four, the rest in ``dtype``."""
    if t.dtype == torch.float8_e4m3fn:
        return t.numel()
    return t.numel() * (4 if is_fp32_param(name) or name.endswith("_scale_inv") else dtype.itemsize)


def save_sharded(model: Trunk, folder: str | Path, shards: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json``, ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``
    (transformers' sharded layout), keys split into ``shards`` files of about equal size."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.cfg.save(folder)
    sd = {
        k: v.detach().to(torch.float32 if is_fp32_param(k) else dtype).contiguous()
        for k, v in model.state_dict().items()
    }
    total = sum(v.numel() * v.element_size() for v in sd.values())
    parts, acc, cur = [[]], 0, 0
    for k, v in sd.items():
        if acc >= total * (cur + 1) / shards and cur < shards - 1:
            parts.append([])
            cur += 1
        parts[-1].append(k)
        acc += v.numel() * v.element_size()
    wm = {}
    for i, keys in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: sd[k] for k in keys}, str(folder / name), metadata={"format": "pt"})
        wm.update({k: name for k in keys})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2) + "\n")


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


# -- DFlash drafters: <checkpoint>/<spec>/{config.json, model.safetensors}, spec in tandem.schema.DFLASH_SPECS --------
#: ``spec -> drafter folder`` (each holding ``config.json`` and ``model.safetensors``)
DrafterDirs = dict


def drafter_dirs(folder: str | Path, given: dict[str, str | Path] | None = None) -> DrafterDirs:
    """The DFlash drafter folders of a checkpoint, by spec: ``given[spec]`` (a drafter checkpoint of
    its own, in the layout ``make model`` writes) where set, else ``<folder>/<spec>`` when it exists.
    Raises ``FileNotFoundError`` naming a given folder that holds no drafter."""
    out = {}
    for a in schema.DFLASH_SPECS:
        d = Path(given[a]) if given and given.get(a) else Path(folder) / a
        if (d / "model.safetensors").exists():
            out[a] = d
        elif given and given.get(a):
            raise FileNotFoundError(f"the {a} drafter folder {d} lacks model.safetensors (and config.json)")
    return out


def dflash_specs(folder: str | Path, dirs: DrafterDirs | None = None) -> list[str]:
    """The DFlash specs with a drafter (``dirs`` from :func:`drafter_dirs`; default: under ``folder``)."""
    return list(dirs if dirs is not None else drafter_dirs(folder))


def dflash_feature_layers(folder: str | Path, dirs: DrafterDirs | None = None) -> tuple[int, ...]:
    """The trunk layers every DFlash drafter reads (empty without drafters). Raises ``ValueError``
    when two drafters want different layers (the trunk exports one set)."""
    from .dflash import DFlashConfig

    dirs = dirs if dirs is not None else drafter_dirs(folder)
    sets = {tuple(DFlashConfig.load(d).target_layer_ids) for d in dirs.values()}
    if len(sets) > 1:
        raise ValueError(
            f"the DFlash drafters {sorted(map(str, dirs.values()))} read different target layers: {sorted(sets)}"
        )
    return sets.pop() if sets else ()


def load_dflash(
    folder: str | Path,
    spec: str,
    dtype: torch.dtype = torch.bfloat16,
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    kernels: KernelSettings = DEFAULT,
):
    """The ``spec`` drafter (:class:`~tandem.model.dflash.DFlashDrafter`) of a checkpoint folder (or
    from its own folder ``path``), in eval mode, in ``dtype`` on ``device`` (read on the host, moved
    once), run with the kernel settings ``kernels``. Raises ``FileNotFoundError`` when it is missing, ``KeyError`` on missing or unexpected keys,
    ``ValueError`` on a config field it cannot honour, ``MemoryError`` (before reading the weights)
    when they cannot fit on ``device`` (:func:`~tandem.model.device.check_bytes`)."""
    from safetensors.torch import load_file

    from .dflash import DFlashConfig, DFlashDrafter

    sub = Path(path) if path is not None else Path(folder) / spec
    if not (sub / "model.safetensors").exists():
        raise FileNotFoundError(
            f"no {spec} drafter in {sub.parent} (expected {sub}/model.safetensors; `make model` trains it)"
        )
    cfg = DFlashConfig.load(sub)
    with torch.device("meta"):
        shapes = DFlashDrafter(cfg, dflash2=spec == schema.DFLASH2).state_dict()
    need = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in shapes.values())
    check_bytes(
        need,
        free_bytes(device),
        f"the {spec} drafter {sub}",
        device,
        f" ({sum(t.numel() for t in shapes.values()) / 1e9:.2f}B parameters in {str(dtype).removeprefix('torch.')})",
    )
    model = DFlashDrafter(cfg, dflash2=spec == schema.DFLASH2)
    missing, unexpected = model.load_state_dict(load_file(str(sub / "model.safetensors")), strict=False)
    if missing or unexpected:
        raise KeyError(f"{spec} drafter checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    model = input_major_linears(model.eval().requires_grad_(False).to(device=device, dtype=dtype))
    return model.use_kernels(kernels)


def save_dflash(model, folder: str | Path, spec: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``<folder>/<spec>/config.json`` and ``model.safetensors``."""
    from safetensors.torch import save_file

    sub = Path(folder) / spec
    model.cfg.save(sub)
    save_file(
        {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()},
        str(sub / "model.safetensors"),
        metadata={"format": "pt"},
    )
