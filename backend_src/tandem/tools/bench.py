"""`make bench`: rows measured side by side in one run, interleaved prompt by prompt (rotating
order) so machine drift cancels, on real prompts the drafters never saw in training (seeded ShareGPT
first turns from beyond the distillation range, + HumanEval).

Rows: plain greedy in-process; each speculative method in-process (``--specs``: MTP with d drafts per
round, DFlash, DFlash2); plain and the ``--served-specs`` through a running tritonserver (gRPC
stream); transformers' ``generate`` (greedy) on the same checkpoint. Per row: median tokens/s and
its interquartile spread, mean acceptance length (tau) and per-position acceptance, median time to
first token, peak RSS, greedy exact-match rate vs plain (divergences at near-ties counted), the
analytical ceiling (:mod:`tandem.tools.bench_report`). Ratios: best spec / plain, served /
in-process per spec, tandem plain / transformers. Then the prefix-cache section
(:mod:`tandem.tools.bench_prefix`): TTFT warm / cold, prime rows skipped, tau warm / cold.
The main rows run with the prefix cache off (so a row never reuses another row's prompt).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from pathlib import Path

import typer

from .. import schema

app = typer.Typer(add_completion=False)


def _rss_mb(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def _tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


class TransformersRow:
    """transformers' ``Glm5NextForConditionalGeneration.generate`` (greedy) with tandem's trunk
    weights loaded into its language model and LM head (vision tower unused, minimal size)."""

    def __init__(self, checkpoint: Path, dtype) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
        from transformers.utils import logging as hf_logging

        from ..model.config import TrunkConfig

        hf_logging.set_verbosity_error()
        cfg = TrunkConfig.load(checkpoint)
        text = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 32,
            "out_hidden_size": cfg.hidden_size,
            "projection_intermediate_size": 32,
        }
        hcfg = Glm5NextConfig(text_config=text, vision_config=vision)
        model = Glm5NextForConditionalGeneration(hcfg)
        sd = load_file(str(checkpoint / "model.safetensors"))
        n = cfg.num_hidden_layers
        mapped = {
            ("lm_head.weight" if k == "lm_head.weight" else f"model.language_model.{k}"): v
            for k, v in sd.items()
            if not k.startswith(f"layers.{n}.")
        }
        missing, unexpected = model.load_state_dict(mapped, strict=False)
        bad = [k for k in missing if not k.startswith("model.visual")]
        if bad or unexpected:
            raise KeyError(f"transformers row: missing {bad[:4]} unexpected {unexpected[:4]}")
        self.model = model.to(dtype).eval()
        self.eos = cfg.eos_token_id
        self.torch = torch

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        torch = self.torch
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=0,
            )
        el = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        return {
            "token_ids": new,
            "elapsed_s": el,
            "tokens_per_s": len(new) / el,
            "ttft_s": None,
            "rounds": len(new),
            "accepted": 0,
            "accepted_at": [],
        }


def parse_spec(given: str) -> tuple[str, str, int | None]:
    """``"mtp:3"`` -> ``("mtp d=3", "mtp", 3)``; ``"dflash"`` -> ``("dflash", "dflash", None)`` (the whole
    block); ``"dflash2:4"`` -> ``("dflash2 d=4", "dflash2", 4)``; ``"off"`` -> ``("plain", "off", None)``.
    Raises ``typer.BadParameter``."""

    spec, _, d = given.strip().partition(":")
    if spec not in schema.SPECS:
        raise typer.BadParameter(f"spec must be one of {schema.SPECS} (optionally :drafts), got {given!r}")
    if spec == schema.OFF:
        return "plain", spec, None
    k = int(d) if d else (schema.DEFAULTS.num_draft_tokens if spec == schema.MTP else None)
    return (f"{spec} d={k}" if k is not None else spec), spec, k


@app.command()
def main(
    prompts: int = typer.Option(8, help="ShareGPT prompts"),
    humaneval: int = typer.Option(4, help="HumanEval prompts"),
    max_tokens: int = typer.Option(128, help="new tokens per prompt"),
    reps: int = typer.Option(
        2, help="runs of each prompt on each row (transformers': one), each rep in a fresh row order"
    ),
    specs: str = typer.Option(
        "mtp:1,mtp:3,dflash,dflash2",
        help="in-process speculative methods (spec[:drafts], comma list; DFlash specs the checkpoint lacks are skipped)",
    ),
    served_specs: str = typer.Option("off,mtp:1,dflash,dflash2", help="served rows (same form)"),
    prefix_pairs: int = typer.Option(4, help="question pairs of the prefix-cache section (0: skip it)"),
    structured: int = typer.Option(
        10, help="JSON-schema prompts of the structured-output section, at most 20 (0: skip it)", max=20, min=0
    ),
    concurrency: int = typer.Option(
        8, help="sessions of the concurrency section (plain and the best spec, in-process; 0: skip)"
    ),
    dtype: str = typer.Option(
        schema.DEFAULTS.dtype, help="auto | bf16 | fp32 (default: the serving default; auto is fp32 on the CPU)"
    ),
    seed: int = typer.Option(0, help="prompt sample seed"),
    threads: int = typer.Option(1, help="torch threads in-process (the served models use 1 each)"),
    amx: bool = typer.Option(
        schema.DEFAULTS.amx,
        "--amx/--no-amx",
        help="bf16 GEMMs on AMX tiles where the CPU has them, in-process and served (the serving parameter amx)",
    ),
    served: bool = typer.Option(True, help="include the served rows (starts a tritonserver, or uses --url)"),
    url: str = typer.Option(
        "",
        "--url",
        help="gRPC host:port of a running server for the served rows instead of starting one; its own settings "
        "apply (the server started here has the prefix cache off), and its RSS is not measured",
    ),
    hf: bool = typer.Option(True, "--transformers/--no-transformers", help="include transformers generate"),
    quick: bool = typer.Option(
        False, help="SMOKE RUN (3 prompts x 32 tokens): checks the bench runs; its figures mean nothing"
    ),
    checkpoint: Path = typer.Option(None, help="checkpoint folder (default: the shipped one)"),
    json_out: Path = typer.Option(None, "--json", help="write all figures (and every per-prompt run) here"),
) -> None:
    """Benchmark plain vs speculative decoding, in-process and served, and transformers."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from ..engine.inprocess import Engine
    from ..model.checkpoint import DEFAULT_CHECKPOINT, dflash_specs, parse_dtype
    from ..ops.cpu.amx import HW_AMX, gemm_tiles
    from ..ops.cpu.tile import HW_BF16
    from .bench_limits import limits, print_limits
    from .bench_load import (
        print_long_prompt,
        print_mixed,
        print_poor,
        print_scaling,
        run_long_prompt,
        run_mixed,
        run_poor,
        run_scaling,
    )
    from .bench_prefix import run_prefix_section
    from .bench_structured import CASES, print_structured, run_structured
    from .bench_report import ceilings, print_report, speedup_ratios, summarize
    from .data import humaneval_prompts, sharegpt_prompts
    from .distill import used_sharegpt_turns

    console = Console(width=200)
    if quick:
        prompts, humaneval, max_tokens, prefix_pairs, concurrency, reps = (
            2,
            0,
            16,
            min(prefix_pairs, 1),
            min(concurrency, 2),
            1,
        )
        console.print("[bold yellow]QUICK: a smoke run; its figures are too few to mean anything[/]")
    checkpoint = Path(checkpoint or DEFAULT_CHECKPOINT)
    torch.set_num_threads(threads)
    dt = parse_dtype(dtype)
    have = set(dflash_specs(checkpoint)) | {schema.MTP, schema.OFF}
    spec_list = [a for a in map(parse_spec, specs.split(",")) if a[1] in have and a[1] != schema.OFF]
    served_list = [a for a in map(parse_spec, served_specs.split(",")) if a[1] in have] if served else []
    skipped = sorted({parse_spec(x)[1] for x in (specs + "," + served_specs).split(",")} - have)
    if skipped:
        console.print(f"[yellow]skipping {skipped}: the checkpoint has no such drafter (`make drafter`)[/]")
    seen = used_sharegpt_turns(checkpoint)  # the drafters' distillation prompts: never benchmarked
    texts = sharegpt_prompts(prompts, seed=seed, exclude=seen) + (
        humaneval_prompts(humaneval, seed=seed) if humaneval else []
    )
    plain_eng = Engine(checkpoint, dtype=dt, prefix_cache_mb=0, amx=amx)
    share = {
        "model": plain_eng.model,
        "tokenizer": plain_eng.tokenizer,
        "prefix_cache_mb": 0,
        "amx": amx,
    }  # (amx: every Engine's)
    if any(a in schema.DFLASH_SPECS for _, a, _ in spec_list):
        share["dflash"] = {a: plain_eng.drafters[a].drafters[a] for a in dflash_specs(checkpoint)}
    engs = {label: Engine(**share, **({"num_draft_tokens": k} if k else {})) for label, spec, k in spec_list}
    tok = plain_eng.tokenizer
    prompt_ids = [tok.chat_prompt(t) if i < prompts else tok.encode(t) for i, t in enumerate(texts)]
    rss_inproc = _rss_mb([os.getpid()])

    runners = {"plain (in-process)": lambda ids, n=max_tokens: plain_eng.generate(ids, n, spec="off")}
    for label, spec, k in spec_list:
        runners[f"{label} (in-process)"] = lambda ids, n=max_tokens, e=engs[label], a=spec, k=k: e.generate(
            ids, n, spec=a, num_draft_tokens=k
        )
    server_ctx = server_log = server = None
    if served_list:
        import tempfile

        from tandem_client.client import generate as served_generate

        from ..launch.serve import running_server

        served_url = url
        if not served_url:
            env = {
                "TANDEM_CHECKPOINT": str(checkpoint),
                "TANDEM_DTYPE": dtype,
                "TANDEM_PREFIX_CACHE_MB": "0",
                "TANDEM_AMX": str(amx),
            }
            console.print("starting tritonserver for the served rows ...")
            server_log = Path(tempfile.mkstemp(prefix="bench-tritonserver-", suffix=".log")[1])
            server_ctx = running_server(env=env, log_path=server_log)
            server = server_ctx.__enter__()
            served_url = server.grpc_url
        else:
            console.print(f"served rows: the running server at {served_url}")
        for label, spec, k in served_list:
            runners[f"{label} (served)"] = lambda ids, n=max_tokens, a=spec, k=k: served_generate(
                ids, n, url=served_url, spec=a, num_draft_tokens=k
            )
    if hf:
        console.print("loading transformers Glm5NextForConditionalGeneration ...")
        hf_row = TransformersRow(checkpoint, dt)
        runners["transformers generate"] = lambda ids: hf_row.generate(ids, max_tokens)
    names = list(runners)
    raw: dict[str, list[dict]] = {n: [] for n in names}
    prefix = None
    try:
        for n in names:  # warm-up: one short run per row (first calls pay allocation and import costs)
            runners[n](prompt_ids[0][:32])
        for (
            ids
        ) in prompt_ids:  # and every prompt on every row but transformers', so no timed row is the first to meet it
            for n in names:  # (in-process and in the server's processes: a prime of a new length pays a one-time cost)
                if "transformers" not in n:
                    runners[n](ids, 2)
        for e in [plain_eng, *engs.values()]:
            e.sched.timing.update(dict.fromkeys(e.sched.timing, 0.0))
        order = random.Random(seed)
        with Progress(console=console) as prog:
            task = prog.add_task(
                "bench (interleaved rows)", total=len(prompt_ids) * (reps * len(names) - (reps - 1) * hf)
            )
            for rep in range(reps):
                for i, ids in enumerate(prompt_ids):
                    for n in order.sample(names, len(names)):  # a fresh random row order for every prompt and rep
                        if rep and "transformers" in n:  # ~30x slower: one run a prompt
                            continue
                        r = runners[n](ids)
                        raw[n].append(
                            {
                                "prompt": i,
                                "rep": rep,
                                **{k: r.get(k) for k in ("token_ids", "tokens_per_s", "ttft_s", "top2_gaps")},
                                "rounds": r.get("rounds", 0),
                                "spec_rounds": r.get("spec_rounds"),
                                "accepted": r.get("accepted", 0),
                                "drafted": r.get("drafted", 0),
                                "accepted_at": r.get("accepted_at", []),
                            }
                        )
                        prog.advance(task)
        rss_server = _rss_mb(_tree_pids(server.proc.pid)) if server is not None else None
        pre_spec = next((a for _, a, _ in spec_list if a in schema.DFLASH_SPECS), None)
        if prefix_pairs and pre_spec:
            peng = Engine(model=plain_eng.model, tokenizer=tok, dflash=share.get("dflash"), amx=amx)
            qs = sharegpt_prompts(2 * prefix_pairs, seed=seed + 1, exclude=seen, max_chars=400)
            with Progress(console=console) as prog:
                task = prog.add_task(f"prefix cache warm vs cold ({pre_spec})", total=4 * prefix_pairs)
                prefix = run_prefix_section(peng, tok, qs, max_tokens, pre_spec, on_step=lambda: prog.advance(task))
    finally:
        if server_ctx is not None:
            server_ctx.__exit__(None, None, None)
    rss_after = _rss_mb([os.getpid()])
    plain_ref = {r["prompt"]: r for r in raw["plain (in-process)"] if not r["rep"]}
    n_pos = {
        f"{label} ({w})": (k or schema.DEFAULTS.block_size - 1)
        for label, a, k in spec_list + served_list
        if a != schema.OFF
        for w in ("in-process", "served")
    }
    out_rows = [
        summarize(
            n,
            raw[n],
            plain_ref,
            n_pos.get(n, 0),
            rss_server if "served" in n else (None if "transformers" in n else max(rss_inproc, rss_after)),
        )
        for n in names
    ]
    by = {r["name"]: r for r in out_rows}
    ratios = speedup_ratios(by, raw, [label for label, _, _ in spec_list], [label for label, _, _ in served_list], hf)
    profile = {
        "ceilings": ceilings(by, {label: engs[label].sched.timing for label, _, _ in spec_list}, plain_eng.sched.timing)
    }
    if server_log is not None and server_log.exists():
        server_log.unlink()
    if prefix is not None:
        profile["prefix"] = prefix
    # after the ceilings: these runs must not enter the engines' stage timings
    console.print("weight-streaming limit and ops per token ...")
    lim = limits(plain_eng.model, plain_eng, raw["plain (in-process)"], prompt_ids[0], ops_tokens=4 if quick else 32)
    scaling = []
    if concurrency > 1:
        conc_ids = [tok.chat_prompt(t) for t in sharegpt_prompts(concurrency, seed=seed + 2, exclude=seen)]
        best = next((a for a in spec_list if a[0] == ratios.get("best_spec")), None)
        for label, spec, k in [("plain", schema.OFF, None)] + ([best] if best else []):
            console.print(f"concurrency: {concurrency} sessions vs one at a time ({label}) ...")
            eng = plain_eng if spec == schema.OFF else engs[label]
            scaling.append({**run_scaling(eng, conc_ids, max_tokens, spec), "label": label})
    if concurrency > 1:  # 8 long prompts waiting while 4 sessions stream, and a 2-token prompt arriving behind them
        import inspect
        import json as json_mod

        console.print("long prompts waiting while sessions stream ...")
        n_long = 256 if quick else 3000
        texts = [
            tok.chat_prompt(f"Request {i}. Explain this code:\n" + inspect.getsource(json_mod.decoder) * 5)
            for i in range(8)
        ]  # (each its own first block: no prefix-cache hits between them)
        longs = [ids[: n_long - 2] + ids[-2:] for ids in texts]
        streams = [tok.chat_prompt(t) for t in sharegpt_prompts(4, seed=seed + 3, exclude=seen)]
        shorts_at = [0.02, 0.05, 0.08] if quick else [0.1 + 0.4 * i for i in range(7)]
        serving = Engine(model=plain_eng.model, tokenizer=tok, amx=amx)  # the serving defaults: prefix cache on
        profile["long_prompt"] = run_long_prompt(
            serving, streams, longs, streams[0][:2], schema.OFF, shorts_at, 0.3 if quick else 3.0
        )
    if structured:  # what a JSON schema costs plain decoding and the best arm
        best = next((a for a in spec_list if a[0] == ratios.get("best_spec")), None)
        label, spec = (best[0], best[1]) if best else ("plain", schema.OFF)
        cases = CASES[:2] if quick else CASES[:structured]
        with Progress(console=console) as prog:
            task = prog.add_task(f"structured output ({label})", total=4 * len(cases))
            profile["structured"] = run_structured(
                plain_eng,
                engs[label] if best else plain_eng,
                spec,
                tok,
                cases,
                max_tokens,
                on_step=lambda: prog.advance(task),
            )
    if concurrency > 1:  # plain sessions beside one session of the best spec, and prompts it drafts poorly for
        mixed_eng = Engine(model=plain_eng.model, tokenizer=tok, dflash=share.get("dflash"), prefix_cache_mb=0, amx=amx)
        best_spec = next((a for label, a, _ in spec_list if label == ratios.get("best_spec")), schema.DEFAULTS.spec)
        console.print(f"mixed batch: {concurrency - 1} plain sessions beside one {best_spec} session ...")
        profile["mixed"] = run_mixed(mixed_eng, conc_ids, max_tokens, best_spec, reps=1 if quick else 3)
        console.print("prompts of random tokens (poor drafts) ...")
        rnd = random.Random(seed + 4)
        vocab = plain_eng.model.cfg.vocab_size
        poor = [[rnd.randrange(1, vocab) for _ in range(64)] for _ in range(2 if quick else 4)]
        profile["poor"] = run_poor(mixed_eng, poor, 2 * max_tokens, best_spec, reps=1 if quick else 2)
    profile["limits"], profile["scaling"] = lim, scaling
    print_report(
        console,
        out_rows,
        ratios,
        profile,
        f"tandem bench - {len(prompt_ids)} prompts x {max_tokens} new tokens x {reps} reps, {dtype}, {threads} thread(s), "
        f"{gemm_tiles(amx)} GEMM tiles, interleaved, random row order"
        + (" - QUICK SMOKE RUN: figures mean nothing" if quick else ""),
    )
    print_limits(console, lim)
    print_scaling(console, scaling)
    if len(scaling) > 1:
        console.print(
            f"{f'{concurrency} sessions, best spec / plain':>30}: [bold]"
            f"{scaling[1]['many_tokens_per_s'] / scaling[0]['many_tokens_per_s']:.2f}x[/] (aggregate tokens/s)"
        )
    if "mixed" in profile:
        print_mixed(console, profile["mixed"])
        print_poor(console, profile["poor"])
    if "long_prompt" in profile:
        print_long_prompt(console, profile["long_prompt"])
    if "structured" in profile:
        print_structured(console, profile["structured"])
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": threads,
            "amx": HW_AMX,
            "avx512_bf16": HW_BF16,
        },
        "settings": {
            "prompts": len(prompt_ids),
            "sharegpt": prompts,
            "humaneval": humaneval,
            "quick": quick,
            "max_tokens": max_tokens,
            "reps": reps,
            "specs": specs,
            "structured": structured,
            "served_specs": served_specs,
            "url": url,
            "dtype": dtype,
            "amx": amx,
            "seed": seed,
            "checkpoint": str(checkpoint),
        },
        "rows": out_rows,
        "ratios": ratios,
        "profile": profile,
        "runs": raw,
    }
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {json_out}")


if __name__ == "__main__":
    app()
