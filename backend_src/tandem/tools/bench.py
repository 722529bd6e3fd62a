"""`make bench`: rows measured side by side in one run, interleaved prompt by prompt so machine
drift cancels, on real prompts (seeded ShareGPT first turns + HumanEval).

Rows: plain greedy in-process; the MTP arm in-process; both through a running tritonserver (gRPC
stream); transformers' ``generate`` (greedy) on the same checkpoint. Per row: median tokens/s and
its interquartile spread, mean acceptance length (tau) and per-position acceptance, median time to
first token, peak RSS, greedy exact-match rate vs plain. Ratios: best arm / plain,
served / in-process, tandem plain / transformers. The analytical ceiling of each arm is
``tau * T_plain / (T_draft + T_verify(d+1) + T_accept + T_commit)`` (d = num_draft_tokens) from the measured stage times
(Leviathan et al. 2023, eq. for expected walltime improvement, with measured rather than modelled costs).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


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
        vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": cfg.hidden_size,
                  "projection_intermediate_size": 32}
        hcfg = Glm5NextConfig(text_config=text, vision_config=vision)
        model = Glm5NextForConditionalGeneration(hcfg)
        sd = load_file(str(checkpoint / "model.safetensors"))
        n = cfg.num_hidden_layers
        mapped = {("lm_head.weight" if k == "lm_head.weight" else f"model.language_model.{k}"): v
                  for k, v in sd.items() if not k.startswith(f"layers.{n}.")}
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
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=self.eos, pad_token_id=0)
        el = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        return {"token_ids": new, "elapsed_s": el, "tokens_per_s": len(new) / el, "ttft_s": None,
                "rounds": len(new), "accepted": 0, "accepted_at": []}


def served_profile(log: Path, by: dict, d: int, t_spec: dict) -> dict:
    """Per-round breakdown of the served MTP arm from the ``tandem`` model's BLS call statistics
    (logged at unload: mean ms per ``model.op`` call, compute included) against the in-process
    stage times: BLS/IPC overhead = served call - in-process stage; "other" = the round's wall time
    (tau / tokens_per_s) minus the served calls."""
    import ast
    import re

    text = log.read_text(errors="replace")
    m = re.findall(r"tandem: BLS calls (\{.*\})", text)
    if not m:
        return {}
    calls = ast.literal_eval(m[-1])
    row = by[f"mtp d={d} (served)"]
    rounds = max(t_spec["rounds"], 1)
    stages = {}
    for name, key, ip in (("draft", "drafter_mtp.draft", t_spec["draft_s"]), ("verify", "trunk.verify", t_spec["verify_s"]),
                          ("commit", "trunk.commit", t_spec["commit_s"])):
        if key in calls:
            served_ms = calls[key]["mean_ms"]
            stages[name] = {"served_ms": served_ms, "inprocess_ms": 1e3 * ip / rounds, "bls_ms": served_ms - 1e3 * ip / rounds}
    round_ms = 1e3 * row["mean_acceptance_length"] / row["tokens_per_s"] if row["tokens_per_s"] else 0.0
    other = round_ms - sum(v["served_ms"] for v in stages.values())
    return {"stages": stages, "round_ms": round_ms, "other_ms": other, "bls_calls": calls}


@app.command()
def main(
    prompts: int = typer.Option(8, help="ShareGPT prompts"),
    humaneval: int = typer.Option(4, help="HumanEval prompts"),
    max_tokens: int = typer.Option(128, help="new tokens per prompt"),
    drafts: str = typer.Option("1,3", "--num-draft-tokens", help="MTP drafts per round, one in-process arm per value (comma list); "
                                                "the served arm uses the first"),
    dtype: str = typer.Option("bf16", help="bf16 | fp32"),
    seed: int = typer.Option(0, help="prompt sample seed"),
    threads: int = typer.Option(1, help="torch threads in-process (the served models use 1 each)"),
    served: bool = typer.Option(True, help="include the served rows (starts a tritonserver)"),
    hf: bool = typer.Option(True, "--transformers/--no-transformers", help="include transformers generate"),
    quick: bool = typer.Option(False, help="smoke run: 3 prompts x 32 tokens"),
    checkpoint: Path = typer.Option(None, help="checkpoint folder (default: the shipped one)"),
    json_out: Path = typer.Option(None, "--json", help="write all figures here"),
) -> None:
    """Benchmark plain vs speculative decoding, in-process and served, and transformers."""
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from .data import humaneval_prompts, sharegpt_prompts
    from ..engine.inprocess import Engine
    from ..model.checkpoint import DEFAULT_CHECKPOINT, parse_dtype

    console = Console(width=160)
    if quick:
        prompts, humaneval, max_tokens = 2, 1, 32
    checkpoint = Path(checkpoint or DEFAULT_CHECKPOINT)
    torch.set_num_threads(threads)
    dt = parse_dtype(dtype)
    texts = sharegpt_prompts(prompts, seed=seed) + (humaneval_prompts(humaneval, seed=seed) if humaneval else [])
    d_list = [int(x) for x in drafts.split(",") if x.strip()]
    d0 = d_list[0]
    plain_eng = Engine(checkpoint, dtype=dt)
    spec_engs = {d: Engine(model=plain_eng.model, tokenizer=plain_eng.tokenizer, num_draft_tokens=d) for d in d_list}
    tok = plain_eng.tokenizer
    prompt_ids = [tok.chat_prompt(t) if i < prompts else tok.encode(t) for i, t in enumerate(texts)]
    rss_inproc = _rss_mb([os.getpid()])

    rows: dict[str, dict] = {}
    runners = {
        "plain (in-process)": lambda ids: plain_eng.generate(ids, max_tokens, spec="off"),
    }
    for d, eng in spec_engs.items():
        runners[f"mtp d={d} (in-process)"] = lambda ids, eng=eng: eng.generate(ids, max_tokens, spec="mtp")
    server_ctx = None
    server_log = None
    if served:
        from tandem_client.client import generate as served_generate

        from ..serving.serve import running_server

        env = {"TANDEM_CHECKPOINT": str(checkpoint), "TANDEM_DTYPE": dtype}
        console.print("starting tritonserver for the served rows ...")
        import tempfile

        server_log = Path(tempfile.mkstemp(prefix="bench-tritonserver-", suffix=".log")[1])
        server_ctx = running_server(env=env, log_path=server_log)
        server = server_ctx.__enter__()
        url = server.grpc_url
        runners["plain (served)"] = lambda ids: served_generate(ids, max_tokens, url=url, spec="off")
        runners[f"mtp d={d0} (served)"] = lambda ids: served_generate(ids, max_tokens, url=url, spec="mtp",
                                                                      num_draft_tokens=d0)
    if hf:
        console.print("loading transformers Glm5NextForConditionalGeneration ...")
        hf_row = TransformersRow(checkpoint, dt)
        runners["transformers generate"] = lambda ids: hf_row.generate(ids, max_tokens)
    names = list(runners)
    for n in names:
        rows[n] = {"name": n, "runs": []}
    try:
        # warm-up: one short run per row (first calls pay allocation and import costs)
        for n in names:
            runners[n](prompt_ids[0][:32])
        plain_eng.sched.timing = {key: 0.0 for key in plain_eng.sched.timing}
        for eng in spec_engs.values():
            eng.sched.timing = {key: 0.0 for key in eng.sched.timing}
        with Progress(console=console) as prog:
            task = prog.add_task("bench (interleaved rows)", total=len(prompt_ids) * len(names))
            for i, ids in enumerate(prompt_ids):
                order = names[i % len(names):] + names[: i % len(names)]  # rotate so no row always goes first
                for n in order:
                    r = runners[n](ids)
                    rows[n]["runs"].append({"prompt": i, "token_ids": r["token_ids"], "tokens_per_s": r["tokens_per_s"],
                                            "ttft_s": r.get("ttft_s"), "rounds": r.get("rounds", 0),
                                            "accepted": r.get("accepted", 0), "accepted_at": r.get("accepted_at", [])})
                    prog.advance(task)
        rss_server = _rss_mb(_tree_pids(server.proc.pid)) if served else None
    finally:
        if server_ctx is not None:
            server_ctx.__exit__(None, None, None)
    rss_after = _rss_mb([os.getpid()])

    plain_ref = {r["prompt"]: r["token_ids"] for r in rows["plain (in-process)"]["runs"]}
    out_rows = []
    for n in names:
        runs = rows[n]["runs"]
        q1, med, q3 = _quantiles([r["tokens_per_s"] for r in runs])
        rounds = sum(r["rounds"] for r in runs)
        acc = sum(r["accepted"] for r in runs)
        spec_row = "mtp" in n
        per_pos = []
        if spec_row:
            per_pos = [sum(r["accepted_at"][j] for r in runs if j < len(r["accepted_at"])) / rounds for j in range(int(n.split("d=")[1].split()[0]))] \
                if any(r["accepted_at"] for r in runs) else []
        ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
        exact = sum(r["token_ids"] == plain_ref[r["prompt"]] for r in runs) / len(runs)
        out_rows.append({
            "name": n, "tokens_per_s": med, "tokens_per_s_q1": q1, "tokens_per_s_q3": q3,
            "mean_acceptance_length": (1 + acc / rounds) if spec_row and rounds else None,
            "acceptance_per_position": per_pos, "ttft_s": statistics.median(ttfts) if ttfts else None,
            "peak_rss_mb": rss_server if "served" in n else max(rss_inproc, rss_after),
            "exact_match_rate": exact, "new_tokens": sum(len(r["token_ids"]) for r in runs),
        })
    by = {r["name"]: r for r in out_rows}
    plain_ip = by["plain (in-process)"]["tokens_per_s"]
    best_d = max(d_list, key=lambda d: by[f"mtp d={d} (in-process)"]["tokens_per_s"])
    arm_ip = by[f"mtp d={best_d} (in-process)"]["tokens_per_s"]
    ratios = {"best_arm_vs_plain": arm_ip / plain_ip, "best_arm": f"mtp d={best_d}"}
    if served:
        ratios["served_vs_inprocess"] = by[f"mtp d={d0} (served)"]["tokens_per_s"] / by[f"mtp d={d0} (in-process)"]["tokens_per_s"]
        ratios["served_vs_inprocess_plain"] = by["plain (served)"]["tokens_per_s"] / plain_ip
    if hf:
        ratios["plain_vs_transformers"] = plain_ip / by["transformers generate"]["tokens_per_s"]

    # analytical ceiling per arm from measured stage times (in-process)
    tp = plain_eng.sched.timing
    t_plain = sum(tp[x] for x in ("draft_s", "verify_s", "accept_s", "commit_s")) / max(tp["rounds"], 1)
    profile = {"plain_round_s": t_plain, "arms": {}}
    for d, eng in spec_engs.items():
        ts = eng.sched.timing
        t_round = {x: ts[x] / max(ts["rounds"], 1) for x in ("draft_s", "verify_s", "accept_s", "commit_s")}
        row = by[f"mtp d={d} (in-process)"]
        tau = row["mean_acceptance_length"]
        ceiling = tau * t_plain / sum(t_round.values()) if sum(t_round.values()) else None
        row["ceiling_speedup"] = ceiling
        profile["arms"][f"mtp d={d}"] = {"round_s": t_round, "rounds": ts["rounds"], "tau": tau,
                                          "ceiling_speedup": ceiling,
                                          "measured_speedup": row["tokens_per_s"] / plain_ip}

    if served and server_log is not None and server_log.exists():
        profile["served"] = served_profile(server_log, by, d0, spec_engs[d0].sched.timing)
        server_log.unlink()

    table = Table(title=f"tandem bench — {len(prompt_ids)} prompts x {max_tokens} new tokens, {dtype}, "
                        f"{threads} thread(s), interleaved")
    for c in ("row", "tok/s (median)", "IQR", "tau", "accept/pos", "TTFT ms", "RSS MB", "exact vs plain"):
        table.add_column(c, justify="right" if c != "row" else "left", no_wrap=True)
    for r in out_rows:
        table.add_row(r["name"], f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s_q1']:.1f}-{r['tokens_per_s_q3']:.1f}",
                      "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
                      " ".join(f"{p:.2f}" for p in r["acceptance_per_position"]),
                      "" if r["ttft_s"] is None else f"{r['ttft_s'] * 1e3:.0f}",
                      f"{r['peak_rss_mb']:.0f}", f"{r['exact_match_rate']:.0%}")
    console.print(table)
    for key, v in ratios.items():
        console.print(f"{key:>28}: " + (f"{v:.2f}x" if isinstance(v, float) else str(v)))
    for name, a in profile["arms"].items():
        console.print(f"{'ceiling ' + name:>28}: {a['ceiling_speedup']:.2f}x  measured {a['measured_speedup']:.2f}x "
                      f"(tau {a['tau']:.2f}; per round: "
                      + ", ".join(f"{k_[:-2]} {v * 1e3:.1f} ms" for k_, v in a["round_s"].items())
                      + f"; plain round {t_plain * 1e3:.1f} ms)")
    sp = profile.get("served")
    if sp:
        console.print(f"{'served round (mtp d=' + str(d0) + ')':>28}: " + ", ".join(
            f"{name} {v['served_ms']:.1f} ms (compute {v['inprocess_ms']:.1f} + BLS/IPC {v['bls_ms']:.1f})"
            for name, v in sp["stages"].items()) + f"; other Python/stream {sp['other_ms']:.1f} ms of {sp['round_ms']:.1f} ms")
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "threads": threads},
              "settings": {"prompts": len(prompt_ids), "sharegpt": prompts, "humaneval": humaneval,
                           "max_tokens": max_tokens, "num_draft_tokens": d_list, "dtype": dtype, "seed": seed, "checkpoint": str(checkpoint)},
              "rows": out_rows, "ratios": ratios, "profile": profile}
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {json_out}")


if __name__ == "__main__":
    app()
