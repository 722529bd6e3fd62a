"""The ``tandem`` command: talk to a running tandem Triton server.

``tandem generate "PROMPT" --max-tokens N [--spec mtp|off] [--url HOST:PORT] [--json] [--checkpoint DIR]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .client import DEFAULT_URL, IncrementalDecoder, ServerUnreachable, TandemClientError, default_checkpoint, generate

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="tandem: speculative decoding sessions served from Triton.")


def _tokenizer(checkpoint: Path):
    from tandem.tokenizer import ChatTokenizer

    try:
        return ChatTokenizer(checkpoint / "tokenizer.json")
    except FileNotFoundError as e:
        typer.echo(f"error: {e} (pass --checkpoint DIR or set TANDEM_CHECKPOINT)", err=True)
        raise typer.Exit(2)


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="user message; wrapped in the chat template"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", min=1, help="tokens to generate at most"),
    spec: str = typer.Option("mtp", "--spec", help="speculation: mtp (native MTP drafter) or off"),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", "-k", help="drafts per round"),
    url: str = typer.Option(DEFAULT_URL, "--url", help="Triton gRPC endpoint host:port"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="folder with tokenizer.json "
                                              "[default: $TANDEM_CHECKPOINT or model_repository/weights/tandem-tiny]"),
    system: Optional[str] = typer.Option(None, "--system", help="optional system message"),
    timeout_s: float = typer.Option(300.0, "--timeout", help="seconds to wait between responses"),
) -> None:
    """Generate a reply to PROMPT, streaming text as each burst arrives, then a stats line on stderr."""
    if spec not in ("mtp", "off"):
        typer.echo(f"error: --spec must be mtp or off, got {spec!r}", err=True)
        raise typer.Exit(2)
    tok = _tokenizer(checkpoint or default_checkpoint())
    ids = tok.chat_prompt(prompt, system=system)
    dec = IncrementalDecoder(tok.decode)

    def on_tokens(new_ids):
        piece = dec.push(new_ids)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        res = generate(ids, max_tokens=max_tokens, url=url, spec=spec, num_draft_tokens=num_draft_tokens,
                       on_tokens=None if as_json else on_tokens, timeout_s=timeout_s)
    except ServerUnreachable as e:
        typer.echo(f"\nerror: {e}" if dec.ids else f"error: {e}", err=True)
        raise typer.Exit(2)
    except TandemClientError as e:
        typer.echo(f"\nerror: {e}" if dec.ids else f"error: {e}", err=True)
        raise typer.Exit(1)
    text = tok.decode(res["token_ids"])
    if as_json:
        keys = ("token_ids", "rounds", "drafted", "accepted", "mean_acceptance_length", "finish_reason", "tokens_per_s")
        obj = {k: res[k] for k in keys}
        obj["text"] = text
        obj["ttft_s"] = res["ttft_s"]
        print(json.dumps(obj, ensure_ascii=False))
        return
    sys.stdout.write(dec.flush() + "\n")
    sys.stdout.flush()
    tau = res["mean_acceptance_length"]
    typer.echo(f"[{len(res['token_ids'])} tokens, {res['rounds']} rounds, tau {tau:.2f} "
               f"({res['accepted']}/{res['drafted']} drafts accepted), {res['tokens_per_s']:.1f} tokens/s, "
               f"finish {res['finish_reason']}]", err=True)


@app.command("health")
def health_cmd(url: str = typer.Option(DEFAULT_URL, "--url", help="Triton gRPC endpoint host:port")) -> None:
    """Check that the server is live and the tandem models are ready."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    c = grpcclient.InferenceServerClient(url)
    try:
        states = {m: c.is_model_ready(m, client_timeout=5) for m in ("trunk", "drafter_mtp", "tandem")}
    except InferenceServerException as e:
        typer.echo(f"error: cannot reach a Triton server at {url} ({e.message() or e})", err=True)
        raise typer.Exit(2)
    finally:
        c.close()
    for m, ok in states.items():
        typer.echo(f"{m}: {'READY' if ok else 'NOT READY'}")
    if not all(states.values()):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
