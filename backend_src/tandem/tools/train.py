"""`make model`: train tokenizer, trunk and MTP layer (jointly, MTP on the t+2 target) from a fixed
seed on real text (ShareGPT conversations + CPython stdlib source), within a time budget.

Loss = CE(trunk, t+1) + ``mtp_weight`` * CE(MTP, t+2) + ``kl_weight`` * DSA-indexer KL (warm-up
loss of DeepSeek-V3.2). MoE balance uses the aux-loss-free bias update (DeepSeek-V3, §2.1.2).
The learning rate follows linear warm-up then cosine decay over the *time* budget.
Outputs in ``--out``: ``config.json``, ``model.safetensors`` (bf16), ``tokenizer.json``,
``train_log.jsonl``, ``loss_curve.png``, ``train_report.json``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import typer

from ..model.checkpoint import DEFAULT_CHECKPOINT, init_weights, load_trunk, save_trunk
from ..model.config import TrunkConfig
from ..model.layers import MoE
from ..model.mla import MLAttention
from ..model.tokenizer import ChatTokenizer, train_tokenizer, write_tokenizer_config
from ..model.trunk import Trunk
from .data import sharegpt_conversations, stdlib_sources
from .plots import save_curves

app = typer.Typer(add_completion=False)


def grow_trunk(src: Trunk, n_layers: int, seed: int = 0, comb_logit: float = 4.0) -> Trunk:
    """Function-preserving growth of a trained trunk to ``n_layers`` (progressive stacking, Gong et
    al. 2019, with zero-initialised outputs): layers ``0..n_old-1`` and the MTP layer are copied;
    each new layer ``i`` copies old layer ``i % 4`` (same layer type in the default 3:1 pattern;
    parameters whose shape differs keep a fresh init) with its attention and MLP output
    projections zeroed and its mHC ``comb`` pinned near the identity (``base = +-comb_logit``), so
    the grown model's logits equal the source's to ~1e-5 and training starts from its quality.
    """
    old = src.cfg
    period = 4
    cfg = dataclasses.replace(
        old, num_hidden_layers=n_layers, layer_types=None, mlp_layer_types=None, indexer_types=None
    )
    dst = init_weights(Trunk(cfg), seed=seed)
    sd_src = src.state_dict()
    sd = dst.state_dict()
    n_old = old.num_hidden_layers
    new = {}
    for k, v in sd.items():
        if not k.startswith("layers."):
            new[k] = sd_src[k].clone()
            continue
        i = int(k.split(".")[1])
        rest = k.split(".", 2)[2]
        if i == n_layers:  # MTP
            new[k] = sd_src[f"layers.{n_old}.{rest}"].clone()
            continue
        j = i if i < n_old else i % period
        sk = f"layers.{j}.{rest}"
        if sk in sd_src and sd_src[sk].shape == v.shape:
            new[k] = sd_src[sk].clone()
        else:
            new[k] = v.clone()
    n = cfg.hc_mult
    for i in range(n_old, n_layers):
        p = f"layers.{i}."
        for k in list(new):
            if not k.startswith(p):
                continue
            if k.endswith(
                (
                    "self_attn.o_proj.weight",
                    "mlp.down_proj.weight",
                    "mlp.experts.down_proj",
                    "mlp.shared_experts.down_proj.weight",
                )
            ):
                new[k].zero_()
        for hc in ("attn_hc", "ffn_hc"):
            fn = new[p + hc + ".fn"]
            fn[2 * n :].zero_()
            base = new[p + hc + ".base"]
            eye = torch.eye(n).flatten()
            base[2 * n :] = comb_logit * (2 * eye - 1)
    dst.load_state_dict(new)
    return dst


def build_corpus(tok: ChatTokenizer, max_tokens: int, code_share: float, seed: int) -> np.ndarray:
    """Tokenise shuffled ShareGPT conversations and stdlib files into one uint16 stream of at most
    ``max_tokens`` tokens, ``code_share`` of it Python source."""
    from tqdm import tqdm

    rng = random.Random(seed)
    convs = list(sharegpt_conversations())
    rng.shuffle(convs)
    code = list(stdlib_sources())
    rng.shuffle(code)
    want_code = int(max_tokens * code_share)
    out: list[np.ndarray] = []
    n_code = 0
    bar = tqdm(total=max_tokens, desc="tokenise", unit="tok", unit_scale=True)
    for i in range(0, len(code), 64):
        if n_code >= want_code:
            break
        for enc in tok.tok.encode_batch(code[i : i + 64]):
            ids = enc.ids + [tok.eos_id]
            out.append(np.asarray(ids, dtype=np.uint16))
            n_code += len(ids)
            bar.update(len(ids))
    n_chat = 0
    for conv in convs:
        if n_code + n_chat >= max_tokens:
            break
        ids = tok.conversation(conv)
        out.append(np.asarray(ids, dtype=np.uint16))
        n_chat += len(ids)
        bar.update(len(ids))
    bar.close()
    rng.shuffle(out)
    return np.concatenate(out)[:max_tokens]


def lr_at(frac: float, step: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` to ``peak/10`` over time."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def losses(model: Trunk, ids: torch.Tensor, kl_weight: float) -> dict[str, torch.Tensor]:
    """Trunk CE (t+1), MTP CE (t+2) and the indexer KL for a batch ``ids [B, T]``."""
    V = model.cfg.vocab_size
    h = model.hidden(ids)
    ce = F.cross_entropy(model.lm_head(h[:, :-1]).float().reshape(-1, V), ids[:, 1:].reshape(-1))
    hm = model.mtp(model.embed_tokens(ids[:, 1:]), h[:, :-1])
    mtp = F.cross_entropy(model.mtp.shared_head.head(hm[:, :-1]).float().reshape(-1, V), ids[:, 2:].reshape(-1))
    kls = [m.last_aux_loss for m in model.modules() if isinstance(m, MLAttention) and m.last_aux_loss is not None]
    kl = torch.stack(kls).mean() if kls else ce.new_zeros(())
    return {"ce": ce, "mtp": mtp, "kl": kl}


def plot_curve(log: list[dict], path: Path) -> None:
    """Trunk and MTP training loss over tokens seen."""
    toks = [r["tokens"] / 1e6 for r in log]
    save_curves(
        {"trunk CE (t+1)": (toks, [r["ce"] for r in log]), "MTP CE (t+2)": (toks, [r["mtp"] for r in log])},
        "training tokens (millions)",
        "cross-entropy (nats/token)",
        "tandem trunk + MTP training loss",
        path,
    )


@app.command()
def main(
    out: Path = typer.Option(DEFAULT_CHECKPOINT, help="checkpoint folder"),
    minutes: float = typer.Option(90.0, help="training time budget (minutes, excluding data prep)"),
    seed: int = typer.Option(0, help="random seed"),
    seq_len: int = typer.Option(256, help="training sequence length (tokens)"),
    batch: int = typer.Option(16, help="sequences per step"),
    lr: float = typer.Option(2e-3, help="peak learning rate"),
    max_tokens: int = typer.Option(16_000_000, help="corpus size (tokens)"),
    code_share: float = typer.Option(0.2, help="share of stdlib Python in the corpus"),
    mtp_weight: float = typer.Option(0.5, help="weight of the MTP (t+2) loss"),
    kl_weight: float = typer.Option(0.1, help="weight of the DSA indexer KL loss"),
    threads: int = typer.Option(2, help="torch threads"),
    bf16: bool = typer.Option(True, help="bf16 autocast for matmuls"),
    resume: bool = typer.Option(False, help="continue from the checkpoint and tokenizer already in OUT"),
    layers: int = typer.Option(4, help="trunk layers (num_hidden_layers) of a fresh or grown model"),
    grow_from: Path = typer.Option(
        None,
        help="start from this trained checkpoint, grown to --layers (function-preserving; its tokenizer is reused)",
    ),
) -> None:
    """Train the tokenizer, trunk and MTP layer; write the checkpoint to OUT."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    tok_path = out / "tokenizer.json"
    if grow_from is not None:
        if grow_from.resolve() != out.resolve():
            shutil.copy(grow_from / "tokenizer.json", tok_path)
        print(f"[1/4] tokenizer: reusing {grow_from / 'tokenizer.json'}")
    elif resume:
        print(f"[1/4] tokenizer: reusing {tok_path}")
    else:
        print(f"[1/4] tokenizer -> {tok_path}")
        rng = random.Random(seed)
        convs = list(sharegpt_conversations(limit=6000))
        sample = ["".join(t.get("value", "") for t in c) for c in convs]
        sample += list(stdlib_sources(max_files=400))
        rng.shuffle(sample)
        train_tokenizer(sample, vocab_size=8192).save(str(tok_path))
    if not (out / "tokenizer_config.json").exists():  # the chat template and stop ids travel with the checkpoint
        write_tokenizer_config(out, [0, 2])  # train_tokenizer gives <|endoftext|> id 0, <|user|> id 2
    tok = ChatTokenizer(tok_path)

    print(f"[2/4] corpus ({max_tokens / 1e6:.0f}M tokens max)")
    data = build_corpus(tok, max_tokens, code_share, seed)
    val = torch.from_numpy(data[-200_000:].astype(np.int64))
    train = torch.from_numpy(data[:-200_000].astype(np.int64))
    print(f"      {len(train) / 1e6:.2f}M train tokens, {len(val) / 1e3:.0f}k validation tokens")

    cfg = TrunkConfig(
        vocab_size=tok.vocab_size,
        eos_token_id=list(tok.stop_ids),
        bos_token_id=None,
        pad_token_id=tok.eos_id,
        num_hidden_layers=layers,
    )
    model = init_weights(Trunk(cfg), seed=seed).train()
    if grow_from is not None:
        model = grow_trunk(load_trunk(grow_from, torch.float32), layers, seed=seed).train()
        print(f"      grown from {grow_from} to {layers} layers (function-preserving)")
    prev_report = None
    if resume:
        from safetensors.torch import load_file

        sd = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
        model.load_state_dict(sd)
        if (out / "train_report.json").exists():
            prev_report = json.loads((out / "train_report.json").read_text())
        torch.manual_seed(seed + 1)
        print(f"      resumed from {out / 'model.safetensors'}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[3/4] model: {n_params / 1e6:.2f}M parameters; training for {minutes:.0f} min")
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n or n.endswith(("base", "scale")) else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    # a resumed or grown run draws other batches than the run it continues
    gen = torch.Generator().manual_seed(seed + (1 if resume else 0) + (2 if grow_from is not None else 0))
    log: list[dict] = []
    tokens0 = prev_report["train_tokens_seen"] if prev_report else 0
    if resume and (out / "train_log.jsonl").exists():
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    log_f = open(out / "train_log.jsonl", "a" if resume else "w")
    budget = minutes * 60.0
    t0 = time.time()
    step, tokens = 0, 0
    from tqdm import tqdm

    bar = tqdm(total=int(budget), desc="train", unit="s")
    last_save = t0
    while True:
        el = time.time() - t0
        if el >= budget:
            break
        cur_lr = lr_at(el / budget, step, lr, warmup=100)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        starts = torch.randint(0, len(train) - seq_len - 1, (batch,), generator=gen)
        ids = torch.stack([train[s : s + seq_len] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ls = losses(model, ids, kl_weight)
        loss = ls["ce"] + mtp_weight * ls["mtp"] + kl_weight * ls["kl"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for m in moes:
                if m.last_load is not None:
                    m.gate.e_score_correction_bias -= 1e-3 * torch.sign(m.last_load - m.last_load.mean())
        step += 1
        tokens += ids.numel()
        if step % 10 == 0:
            el2 = time.time() - t0
            rec = {
                "step": step,
                "tokens": tokens0 + tokens,
                "seconds": round(el2, 1),
                "lr": cur_lr,
                "ce": ls["ce"].item(),
                "mtp": ls["mtp"].item(),
                "kl": ls["kl"].item(),
                "tokens_per_s": round(tokens / el2, 1),
            }
            log.append(rec)
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            bar.n = int(el2)
            bar.set_postfix(
                ce=f"{rec['ce']:.3f}",
                mtp=f"{rec['mtp']:.3f}",
                tok_s=f"{rec['tokens_per_s']:.0f}",
                Mtok=f"{tokens / 1e6:.2f}",
            )
            bar.refresh()
        if time.time() - last_save > 600:
            model.eval()
            save_trunk(model, out)
            model.train()
            last_save = time.time()
    bar.close()
    train_s = time.time() - t0
    model.eval()
    print("[4/4] validation + save")
    with torch.no_grad():
        vl = []
        for i in range(0, len(val) - seq_len, seq_len * 4)[:40]:
            v = val[i : i + seq_len].unsqueeze(0)
            ls = losses(model, v, 0.0)
            vl.append((ls["ce"].item(), ls["mtp"].item()))
    save_trunk(model, out)
    plot_curve(log, out / "loss_curve.png")
    report = {
        "seed": seed,
        "parameters": n_params,
        "train_tokens_seen": tokens0 + tokens,
        "steps": step,
        "stages": (prev_report.get("stages", [prev_report]) if prev_report else [])
        + [{"tokens": tokens, "seconds": round(train_s, 1), "resumed": resume}],
        "train_seconds": round(train_s, 1),
        "tokens_per_s": round(tokens / max(train_s, 1e-9), 1),
        "val_ce": float(np.mean([a for a, _ in vl])),
        "val_mtp_ce": float(np.mean([b for _, b in vl])),
        "total_seconds": round(time.time() - t_start, 1),
        "seq_len": seq_len,
        "batch": batch,
        "layers": layers,
    }
    if grow_from is not None and (grow_from / "train_report.json").exists():
        report["grown_from"] = {
            "checkpoint": grow_from.name,
            **json.loads((grow_from / "train_report.json").read_text()),
        }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    app()
