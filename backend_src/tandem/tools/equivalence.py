"""Record every spec's output on the bench prompts, in-process and served, and compare two records.

A change that must not change behaviour (a refactor of the engine, the kernels or the serving path) is
checked by recording before and after it and comparing::

    python -m tandem.tools.equivalence record before.json      # on the commit before the change
    python -m tandem.tools.equivalence record after.json       # on the change
    python -m tandem.tools.equivalence compare before.json after.json

A record holds, per prompt, the greedy token ids of every spec (``off``, ``mtp``, ``dflash``,
``dflash2``; the DFlash specs the checkpoint holds) in-process and served, and seeded sampled outputs
(``rejection`` and ``coupled``) of every spec, in-process and served. ``compare`` exits 1 on the first
difference, naming the prompt, spec, path and the first token that differs. Within one record, every
greedy spec must equal plain greedy decoding (exits 1 otherwise): speculation is lossless.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from .. import schema

app = typer.Typer(add_completion=False, no_args_is_help=True)

#: the seeded sampled turns recorded per prompt (every spec, both sampling modes)
SAMPLED = {"TEMPERATURE": 0.8, "TOP_P": 0.95, "SEED": 11}


def _prompts(checkpoint: Path, n_sharegpt: int, n_humaneval: int, tok) -> list[list[int]]:
    """The bench's prompts: seeded ShareGPT first turns the drafters never saw, then HumanEval."""
    from .data import humaneval_prompts, sharegpt_prompts
    from .distill import used_sharegpt_turns

    texts = sharegpt_prompts(n_sharegpt, seed=0, exclude=used_sharegpt_turns(checkpoint))
    return [tok.chat_prompt(t) for t in texts] + [tok.encode(t) for t in humaneval_prompts(n_humaneval, seed=0)]


@app.command()
def record(
    out: Path = typer.Argument(..., help="JSON file to write"),
    prompts: int = typer.Option(8, help="ShareGPT prompts"),
    humaneval: int = typer.Option(4, help="HumanEval prompts"),
    max_tokens: int = typer.Option(64, help="new tokens per prompt"),
    sampled_prompts: int = typer.Option(4, help="prompts of the seeded sampled turns"),
    served: bool = typer.Option(True, help="also record the served outputs (starts a tritonserver)"),
    checkpoint: Path = typer.Option(None, help="checkpoint folder (default: the shipped one)"),
    specs_: str = typer.Option("", "--specs", help="comma-separated specs (default: every spec the checkpoint has)"),
    set_: list[str] = typer.Option(
        [], "--set", help="a served model parameter, NAME=VALUE (repeatable; e.g. tensor_parallel=2, device=cuda)"
    ),
    torch_path: bool = typer.Option(
        False,
        "--torch-path",
        help="in-process on the torch reference path (no compiled kernels), as tensor "
        "parallelism runs: a served tensor_parallel server is then compared with one rank of the same arithmetic",
    ),
) -> None:
    """Run every spec on the bench prompts, in-process (one rank, this CPU) and served, and write the token ids to
    OUT. Fails when a greedy spec differs from plain greedy decoding, or a served greedy output from the
    in-process one."""
    from rich.console import Console

    from ..engine.inprocess import Engine
    from ..model.checkpoint import DEFAULT_CHECKPOINT, dflash_specs

    console = Console(stderr=True)
    checkpoint = Path(checkpoint or DEFAULT_CHECKPOINT)
    specs = [schema.OFF, schema.MTP] + [a for a in (schema.DFLASH, schema.DFLASH2) if a in dflash_specs(checkpoint)]
    if specs_:
        specs = [schema.OFF] + [a for a in specs_.split(",") if a in specs and a != schema.OFF]
    from ..launch.settings import parse_settings

    served_env = {schema.env_name(k): str(v) for k, v in parse_settings(set_).items()}
    from ..ops.settings import REFERENCE

    eng = Engine(checkpoint, prefix_cache_mb=0, kernel_settings=REFERENCE if torch_path else None)
    ids = _prompts(checkpoint, prompts, humaneval, eng.tokenizer)
    modes = (schema.REJECTION, schema.COUPLED)
    rec: dict = {"max_tokens": max_tokens, "specs": specs, "prompts": ids, "paths": {}}

    def run(path: str, greedy, sampled) -> None:
        got = rec["paths"][path] = {"greedy": {}, "sampled": {}}
        for spec in specs:
            console.print(f"{path}: {spec} ...")
            got["greedy"][spec] = [greedy(p, spec) for p in ids]
            for mode in modes:
                got["sampled"][f"{spec}/{mode}"] = [sampled(p, spec, mode) for p in ids[:sampled_prompts]]

    run(
        "in-process",
        lambda p, spec: eng.generate(p, max_tokens, spec=spec)["token_ids"],
        lambda p, spec, mode: eng.generate(
            p,
            max_tokens,
            spec=spec,
            temperature=SAMPLED["TEMPERATURE"],
            top_p=SAMPLED["TOP_P"],
            seed=SAMPLED["SEED"],
            sampling=mode,
        )["token_ids"],
    )
    if served:
        from tandem_client.client import generate

        from ..launch.serve import running_server

        console.print("starting tritonserver ...")
        env = {"TANDEM_CHECKPOINT": str(checkpoint.resolve()), "TANDEM_PREFIX_CACHE_MB": "0", **served_env}
        with running_server(env=env, ready_timeout_s=400) as srv:
            run(
                "served",
                lambda p, spec: generate(p, max_tokens, url=srv.grpc_url, spec=spec)["token_ids"],
                lambda p, spec, mode: generate(
                    p, max_tokens, url=srv.grpc_url, spec=spec, sampling={**SAMPLED, "SAMPLING": mode}
                )["token_ids"],
            )
    out.write_text(json.dumps(rec) + "\n")
    bad = lossless_errors(rec) + path_errors(rec)
    for line in bad:
        console.print(f"[red]{line}[/]")
    console.print(
        f"wrote {out}: {len(ids)} prompts x {len(specs)} specs x {len(rec['paths'])} paths"
        + ("" if bad else "; every greedy spec equals plain greedy decoding, served as in-process")
    )
    raise typer.Exit(1 if bad else 0)


def _first_diff(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token {i}: {a[i] if i < len(a) else 'end'} vs {b[i] if i < len(b) else 'end'}"


def lossless_errors(rec: dict) -> list[str]:
    """Within one record: each greedy spec's output that differs from plain greedy decoding on the same path."""
    out = []
    for path, got in rec["paths"].items():
        plain = got["greedy"][schema.OFF]
        for spec, outs in got["greedy"].items():
            for j, (a, b) in enumerate(zip(plain, outs)):
                if a != b:
                    out.append(f"{path} {spec} prompt {j} differs from plain greedy: {_first_diff(a, b)}")
    return out


def path_errors(rec: dict) -> list[str]:
    """Within one record: each served greedy output that differs from the in-process one (same spec, prompt)."""
    paths = rec["paths"]
    if "served" not in paths:
        return []
    out = []
    for spec, outs in paths["served"]["greedy"].items():
        for j, (a, b) in enumerate(zip(paths["in-process"]["greedy"][spec], outs)):
            if a != b:
                out.append(f"served {spec} prompt {j} differs from in-process: {_first_diff(a, b)}")
    return out


def differences(before: dict, after: dict) -> list[str]:
    """Every (path, kind, spec, prompt) whose token ids differ between two records, or that one lacks."""
    if before["prompts"] != after["prompts"] or before["max_tokens"] != after["max_tokens"]:
        return ["the records ran different prompts or max_tokens: record both with the same options"]
    out = []
    for path in sorted(set(before["paths"]) | set(after["paths"])):
        a, b = before["paths"].get(path), after["paths"].get(path)
        if a is None or b is None:
            out.append(f"{path}: only in {'after' if a is None else 'before'}")
            continue
        for kind in ("greedy", "sampled"):
            for spec in sorted(set(a[kind]) | set(b[kind])):
                xs, ys = a[kind].get(spec), b[kind].get(spec)
                if xs is None or ys is None:
                    out.append(f"{path} {kind} {spec}: only in {'after' if xs is None else 'before'}")
                    continue
                out += [
                    f"{path} {kind} {spec} prompt {j}: {_first_diff(x, y)}"
                    for j, (x, y) in enumerate(zip(xs, ys))
                    if x != y
                ]
    return out


@app.command()
def compare(before: Path = typer.Argument(...), after: Path = typer.Argument(...)) -> None:
    """Exit 1 when two records differ anywhere (each difference printed), else print what matched."""
    a, b = (json.loads(p.read_text()) for p in (before, after))
    diffs = differences(a, b) + lossless_errors(b)
    for line in diffs:
        print(line)
    if diffs:
        sys.exit(1)
    n = sum(len(v) for p in b["paths"].values() for kind in p.values() for v in kind.values())
    print(
        f"identical: {n} outputs ({len(b['prompts'])} prompts x {len(b['specs'])} specs, "
        f"{', '.join(b['paths'])}; greedy and seeded sampled)"
    )


if __name__ == "__main__":
    app()
