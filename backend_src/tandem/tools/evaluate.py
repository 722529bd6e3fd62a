"""Acceptance and exactness report: greedy speculative vs plain decoding on real prompts.

``python -m tandem.tools.evaluate --prompts 20 --max-tokens 128 --dtype bf16`` prints per prompt the
acceptance length (tau) and whether the speculative output equals plain decoding; every
divergence is located and its top-2 logit gap (from both runs' trunk logits at that position) is
compared with ``--tie-bound`` to show it is a bf16 near-tie.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import typer

from .. import schema

from ..engine.inprocess import Engine
from ..model.checkpoint import DEFAULT_CHECKPOINT
from .data import sharegpt_prompts

app = typer.Typer(add_completion=False)


def compare(spec: dict, plain: dict) -> dict:
    """First divergence of two generations (None if equal) and the top-2 gaps there."""
    a, b = spec["token_ids"], plain["token_ids"]
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None and len(a) != len(b):
        j = min(len(a), len(b))
    if j is None:
        return {"equal": True}
    gaps = [g[j] for g in (spec["top2_gaps"], plain["top2_gaps"]) if j < len(g)]
    return {"equal": False, "position": j, "top2_gap": max(gaps) if gaps else None}


@app.command()
def main(
    checkpoint: Path = typer.Option(DEFAULT_CHECKPOINT, help="checkpoint folder"),
    prompts: int = typer.Option(20, help="number of ShareGPT prompts"),
    max_tokens: int = typer.Option(128, help="new tokens per prompt"),
    dtype: str = typer.Option(
        schema.DEFAULTS.dtype, help="auto | bf16 | fp32 (default: the serving default; auto is fp32 on the CPU)"
    ),
    num_draft_tokens: int = typer.Option(3, "--num-draft-tokens", help="MTP draft tokens per round"),
    seed: int = typer.Option(0, help="prompt sample seed"),
    tie_bound: float = typer.Option(0.125, help="top-2 logit gap below which a divergence is a near-tie"),
    json_out: Path = typer.Option(None, "--json", help="write the report here"),
    threads: int = typer.Option(2, help="torch threads"),
) -> None:
    """Run spec (MTP) and plain greedy decoding side by side and report tau and exactness."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(threads)
    eng = Engine(checkpoint, dtype=dtype, num_draft_tokens=num_draft_tokens)
    ps = sharegpt_prompts(prompts, seed=seed)
    rows = []
    for p in tqdm(ps, desc="prompts"):
        ids = eng.tokenizer.chat_prompt(p)
        s = eng.generate(ids, max_tokens, spec="mtp")
        pl = eng.generate(ids, max_tokens, spec="off")
        c = compare(s, pl)
        rows.append(
            {
                "prompt_tokens": len(ids),
                "new_tokens": len(s["token_ids"]),
                "tau": s["mean_acceptance_length"],
                "rounds": s["rounds"],
                "accepted": s["accepted"],
                "accepted_at": s["accepted_at"],
                "spec_tokens_per_s": s["tokens_per_s"],
                "plain_tokens_per_s": pl["tokens_per_s"],
                **c,
            }
        )
    rounds = sum(r["rounds"] for r in rows)
    acc = sum(r["accepted"] for r in rows)
    per_pos = [
        sum(r["accepted_at"][i] for r in rows if i < len(r["accepted_at"])) / rounds for i in range(num_draft_tokens)
    ]
    div = [r for r in rows if not r["equal"]]
    report = {
        "checkpoint": str(checkpoint),
        "dtype": dtype,
        "num_draft_tokens": num_draft_tokens,
        "prompts": len(rows),
        "max_tokens": max_tokens,
        "mean_acceptance_length": 1 + acc / rounds if rounds else None,
        "acceptance_per_position": per_pos,
        "exact_match": len(rows) - len(div),
        "divergences": len(div),
        "divergence_gaps": [r["top2_gap"] for r in div],
        "tie_bound": tie_bound,
        "all_divergences_near_ties": all(r["top2_gap"] is not None and r["top2_gap"] < tie_bound for r in div),
        "median_speedup": statistics.median(r["spec_tokens_per_s"] / r["plain_tokens_per_s"] for r in rows),
        "rows": rows,
    }
    print(f"{'#':>3} {'tau':>5} {'equal':>6} {'div@':>5} {'gap':>7}")
    for i, r in enumerate(rows):
        print(
            f"{i:>3} {r['tau']:5.2f} {str(r['equal']):>6} {r.get('position', ''):>5} "
            f"{'' if r['equal'] else format(r['top2_gap'], '.4f'):>7}"
        )
    print(
        f"mean acceptance length tau = {report['mean_acceptance_length']:.3f} (num_draft_tokens={num_draft_tokens}, {dtype}); "
        f"per-position acceptance {[round(x, 3) for x in per_pos]}"
    )
    print(
        f"exact match {report['exact_match']}/{len(rows)}; divergences {len(div)} "
        f"(all near-ties below {tie_bound}: {report['all_divergences_near_ties']}); "
        f"median spec/plain tokens/s {report['median_speedup']:.2f}x"
    )
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    app()
