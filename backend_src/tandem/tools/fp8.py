"""Write a block-scaled FP8 copy of a bf16 (or fp32) checkpoint, in the form GLM-5.3-Flash is released in.

``python -m tandem.tools.fp8 SRC DST`` copies the folder ``SRC`` (either layout of :mod:`tandem.model.layout`,
sharded or not) to ``DST`` with the released FP8 set stored ``float8_e4m3fn`` beside a ``*.weight_scale_inv``
per 128 x 128 block (:func:`tandem.ops.fp8.quantize`) and a ``quantization_config`` in ``config.json``. The
FP8 set (NVIDIA NeMo's GLM-5.3-Flash converter): on the MLA/DSA layers (the MTP layer's too) ``q_a_proj``,
``q_b_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``; the dense MLPs, the shared experts and the routed experts.
Everything else keeps its dtype: embeddings, the LM head, norms, the router, ``eh_proj``, the KDA layers'
projections, the indexers. Every tensor takes the release's on-disk name (:func:`~tandem.model.layout.release_names`:
one tensor per routed expert and projection, as FP8 scales are per 2-D weight). Other files
of the folder (tokenizer, generation config, drafters) are copied as they are. Prints what it wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import typer

from ..model.checkpoint import INDEX, weight_map
from ..model.config import TrunkConfig
from ..model.layout import RENAMES, TEXT_PREFIX, VISION_PREFIX, Layout, in_fp8_set, release_names
from ..ops.fp8 import SCALE_SUFFIX, quantize

app = typer.Typer(add_completion=False)


def fp8_copy(src: Path, dst: Path, block: tuple[int, int] = (128, 128), progress=None) -> dict:
    """Write ``src``'s FP8 copy to ``dst`` (see the module text). Returns ``{"fp8": tensors quantized, "kept":
    tensors kept, "bytes_before", "bytes_after"}``; ``progress(i, n, name)`` is called after each of the n weight files.
    Raises ``ValueError`` when ``src`` is FP8 already or ``dst``
    exists, and what :func:`~tandem.model.checkpoint.weight_map` raises."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a checkpoint folder (no config.json)")
    layout = Layout.read(src)
    if layout.fp8 is not None:
        raise ValueError(f"{src} is FP8 already (its config.json has a quantization_config)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty folder: give a new one")
    cfg = TrunkConfig.load(src)
    mla = {i for i, t in enumerate(cfg.layer_types) if t == "indexed_attention"} | {cfg.num_hidden_layers}
    files = weight_map(src)
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():  # everything but the weights and config.json
        if p.name not in {f.name for f in files.values()} | {INDEX, "config.json"}:
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst / p.name)
    stats = {"fp8": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    new_map: dict[str, str] = {}
    shards = sorted(set(files.values()))
    for i, f in enumerate(shards):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), "pt") as st:
            for key in (k for k, g in files.items() if g == f):
                t = st.get_tensor(key)
                stats["bytes_before"] += t.numel() * t.element_size()
                if key.startswith(VISION_PREFIX):  # the vision tower as it is
                    out[key] = t
                    stats["kept"] += 1
                    continue
                prefix = TEXT_PREFIX if layout.released and key.startswith(TEXT_PREFIX) else ""
                name = key[len(prefix) :]
                for pattern, repl in RENAMES:  # in-memory, then the release's on-disk names
                    name = pattern.sub(repl, name)
                for n, v in release_names(name, t).items():
                    if in_fp8_set(n, mla):
                        q, s = quantize(v, block)
                        out[prefix + n], out[prefix + n + SCALE_SUFFIX] = q, s
                        stats["fp8"] += 1
                    else:
                        out[prefix + n] = v.contiguous()
                        stats["kept"] += 1
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        stats["bytes_after"] += sum(v.numel() * v.element_size() for v in out.values())
        new_map.update({k: f.name for k in out})
        if progress is not None:
            progress(i + 1, len(shards), f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / INDEX).exists():
        total = stats["bytes_after"]
        (dst / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": new_map}, indent=2) + "\n"
        )
    return stats


@app.command()
def main(
    src: Path = typer.Argument(..., help="a bf16 or fp32 checkpoint folder"),
    dst: Path = typer.Argument(..., help="the new folder to write the FP8 copy to"),
    block: int = typer.Option(128, help="rows and columns of a scale's block"),
) -> None:
    """Write a block-scaled FP8 copy of a checkpoint (GLM-5.3-Flash's released FP8 set)."""
    if block < 16 or block % 16:
        raise typer.BadParameter(f"--block must be a positive multiple of 16 (the FP8 GEMM's limit), got {block}")
    try:
        s = fp8_copy(src, dst, (block, block), lambda i, n, name: print(f"  {i}/{n} {name}", flush=True))
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e)) from None
    print(
        f"tandem: wrote {dst}: {s['fp8']} weights in FP8 ({block}x{block} blocks), {s['kept']} tensors kept; "
        f"{s['bytes_before'] / 2**20:.1f} MiB -> {s['bytes_after'] / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    app()
