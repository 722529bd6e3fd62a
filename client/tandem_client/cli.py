"""The ``tandem`` command: ``generate`` (one turn, streamed as text), ``chat`` (a REPL keeping one
sequence across turns) and ``health``. Flags are checked here, against the limits of
:mod:`tandem.schema`, with errors that name the flag; the server checks them again."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from tandem import schema, schema_text

from .client import (
    DEFAULT_URL,
    IncrementalDecoder,
    ServerUnreachable,
    TandemClientError,
    check_url,
    turn_text,
    default_checkpoint,
    generate,
    new_sequence_id,
    stage_health,
)

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="tandem: speculative decoding sessions served from Triton."
)

#: command-line flag of each checked wire field
FLAGS = {
    schema.MAX_TOKENS: "--max-tokens (-n)",
    schema.NUM_DRAFT_TOKENS: "--num-draft-tokens (-k)",
    schema.TEMPERATURE: "--temperature",
    schema.TOP_K: "--top-k",
    schema.TOP_P: "--top-p",
    schema.SEED: "--seed",
}


def spec_flag(spec: str | None) -> str | None:
    """``--spec`` as the wire reads ``SPEC`` (surrounding spaces dropped, any case: ``OFF`` is ``off``)."""
    return None if spec is None else spec.strip().lower()


def check_flags(max_tokens: int, spec: str | None, num_draft_tokens: int | None, sampling: dict) -> None:
    """Raise ``ValueError`` naming the flag for values the server would refuse: ranges from :data:`tandem.schema.TANDEM`, ``-k`` with ``--spec off``,
    an unknown spec or sampling mode (``spec`` as :func:`spec_flag` gives it)."""
    if spec is not None and spec not in schema.SPECS:
        raise ValueError(f"--spec must be one of {schema.SPECS}, got {spec!r}")
    if num_draft_tokens is not None and spec == schema.OFF:
        raise ValueError("--num-draft-tokens (-k) drafts per round; --spec off decodes plain and takes none")
    mode = sampling.get(schema.SAMPLING)
    if mode is not None and mode not in schema.SAMPLING_MODES:
        raise ValueError(f"--sampling must be one of {schema.SAMPLING_MODES}, got {mode!r}")
    values = {
        schema.MAX_TOKENS: max_tokens,
        schema.NUM_DRAFT_TOKENS: num_draft_tokens,
        **{k: v for k, v in sampling.items() if k != schema.SAMPLING},
    }
    for name, v in values.items():
        if v is None:
            continue
        spec_t = schema.TANDEM.input(name)
        hi = schema.DEFAULTS.block_size - 1 if name == schema.NUM_DRAFT_TOKENS and spec in schema.DFLASH_SPECS else None
        try:
            schema.check_range(spec_t, v, hi=hi)
        except schema.WireError as e:
            raise ValueError(str(e).replace(name, FLAGS[name], 1)) from None


def read_response_format(value: str | None) -> str | None:
    """``--response-format``: its JSON text (read from the file after ``@``), checked to be a JSON object;
    the server checks the rest. Raises ``ValueError`` naming the flag."""
    if not value:
        return None
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--response-format: cannot read {value[1:]}: {e}") from None
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--response-format must be a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--response-format must be a JSON object, got {type(obj).__name__}")
    return value


def read_prompt(prompt: str | None, file: Path | None) -> str:
    """The prompt: the argument, stdin when it is ``-``, or ``--file``'s text (UTF-8 both). Raises
    ``ValueError`` naming the flag (and the path) for an unreadable or non-UTF-8 file or stdin."""
    if file is not None:
        if prompt is not None:
            raise ValueError("give the prompt as an argument or with --file, not both")
        try:
            return file.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--file: cannot read {file}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--file: {file} is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); save it as UTF-8"
            ) from None
    if prompt is None:
        raise ValueError("no prompt: pass it as an argument, - to read stdin, or --file PATH")
    if prompt != "-":
        return prompt
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"-: stdin is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x})") from None


def _tokenizer(checkpoint: Path):
    from tandem.model.tokenizer import ChatTokenizer

    try:
        return ChatTokenizer(checkpoint / "tokenizer.json")
    except FileNotFoundError as e:
        typer.echo(f"error: {e} (pass --checkpoint DIR or set TANDEM_CHECKPOINT)", err=True)
        raise typer.Exit(2)


def _fail(msg: str, code: int) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _stats(res: dict) -> str:
    tau = res["mean_acceptance_length"]
    return (
        f"[{len(res['token_ids'])} tokens, {res['rounds']} rounds, tau {'-' if tau is None else f'{tau:.2f}'} "
        f"({res['accepted']}/{res['drafted']} drafts accepted), {res['tokens_per_s']:.1f} tokens/s, "
        f"finish {res['finish_reason']}]"
    )


_SPEC_HELP = (
    "speculation: "
    + " | ".join(schema.SPECS)
    + f" [default: the server's, {schema.DEFAULTS.spec} when its drafter is loaded]"
)
_SAMPLING_HELP = (
    "speculative sampling: "
    + " | ".join(schema.SAMPLING_MODES)
    + f" [default: {schema.REJECTION}; {schema.COUPLED} equals --spec off token for token]"
)


_SALT_HELP = (
    f"prefix-cache namespace (at most {schema.MAX_CACHE_SALT_BYTES} UTF-8 bytes): only requests with the "
    "same salt share cached prompt blocks [default: the shared namespace]"
)


def check_salt(salt: str | None) -> None:
    """Raises ``ValueError`` for a ``--cache-salt`` over :data:`tandem.schema.MAX_CACHE_SALT_BYTES` bytes."""
    if salt is not None and len(salt.encode()) > schema.MAX_CACHE_SALT_BYTES:
        raise ValueError(f"--cache-salt: at most {schema.MAX_CACHE_SALT_BYTES} bytes, got {len(salt.encode())}")


@app.command("generate")
def generate_cmd(
    prompt: Optional[str] = typer.Argument(None, help="user message (wrapped in the chat template); - reads stdin"),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="read the user message from this file"),
    max_tokens: int = typer.Option(
        schema_text.DEFAULT_MAX_TOKENS, "--max-tokens", "-n", help="tokens to generate at most"
    ),
    spec: Optional[str] = typer.Option(None, "--spec", help=_SPEC_HELP),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", "-k", help="drafts per round"),
    url: str = typer.Option(DEFAULT_URL, "--url", help="Triton gRPC endpoint host:port"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    checkpoint: Optional[Path] = typer.Option(
        None, "--checkpoint", help="folder with tokenizer.json [default: $TANDEM_CHECKPOINT or the shipped checkpoint]"
    ),
    system: Optional[str] = typer.Option(None, "--system", help="optional system message"),
    timeout_s: float = typer.Option(300.0, "--timeout", help="seconds to wait between responses"),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="softmax temperature [default: 0, greedy]"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="sample from the k most likely tokens [default: 0, all]"),
    top_p: Optional[float] = typer.Option(
        None, "--top-p", help="sample from the top-p probability mass [default: 1, all]"
    ),
    seed: Optional[int] = typer.Option(
        None, "--seed", help="noise seed of a sampled turn [default: a fresh random one]"
    ),
    sampling: Optional[str] = typer.Option(None, "--sampling", help=_SAMPLING_HELP),
    stop_token_id: list[int] = typer.Option(
        [],
        "--stop-token-id",
        help=f"a token id that also ends the reply (repeatable, at most {schema.MAX_STOP_TOKEN_IDS})",
    ),
    stop: list[str] = typer.Option(
        [],
        "--stop",
        help="a string that ends the reply (not printed; repeatable, at most "
        f"{schema.MAX_STOPS} of 1-{schema.MAX_STOP_CHARS} characters)",
    ),
    cache_salt: Optional[str] = typer.Option(None, "--cache-salt", help=_SALT_HELP),
    response_format: Optional[str] = typer.Option(
        None,
        "--response-format",
        help="structured output: a JSON object as OpenAI's response_format, or @FILE holding one, e.g. "
        '\'{"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}\', \'{"type": "json_object"}\', '
        '\'{"type": "regex", "regex": "[0-9]+"}\'',
    ),
) -> None:
    """Generate a reply to PROMPT, streaming text as each burst arrives, then a stats line on stderr."""
    smp = {
        schema.TEMPERATURE: temperature,
        schema.TOP_K: top_k,
        schema.TOP_P: top_p,
        schema.SEED: seed,
        schema.SAMPLING: sampling,
    }
    spec = spec_flag(spec)
    try:
        check_flags(max_tokens, spec, num_draft_tokens, smp)
        check_url(url)
        if len(stop_token_id) > schema.MAX_STOP_TOKEN_IDS:
            raise ValueError(f"--stop-token-id: at most {schema.MAX_STOP_TOKEN_IDS}, got {len(stop_token_id)}")
        if any(x < 0 for x in stop_token_id):
            raise ValueError(f"--stop-token-id must be >= 0, got {min(stop_token_id)}")
        check_salt(cache_salt)
        if len(stop) > schema.MAX_STOPS:
            raise ValueError(f"--stop: at most {schema.MAX_STOPS} stop strings, got {len(stop)}")
        bad = next((x for x in stop if not 1 <= len(x) <= schema.MAX_STOP_CHARS), None)
        if bad is not None:
            raise ValueError(
                f"--stop: each stop string must have 1 to {schema.MAX_STOP_CHARS} characters, got {len(bad)}"
            )
        text_in = read_prompt(prompt, file)
        fmt = read_response_format(response_format)
    except (ValueError, TandemClientError) as e:
        _fail(str(e), 2)
    tok = _tokenizer(checkpoint or default_checkpoint())
    ids = tok.chat_prompt(text_in, system=system)
    dec = IncrementalDecoder(tok.decode, tuple(stop))

    def on_tokens(new_ids):
        piece = dec.push(new_ids)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        res = generate(
            ids,
            max_tokens=max_tokens,
            url=url,
            spec=spec,
            num_draft_tokens=num_draft_tokens,
            on_tokens=None if as_json else on_tokens,
            timeout_s=timeout_s,
            sampling=smp,
            stop_token_ids=stop_token_id or None,
            stop=stop or None,
            cache_salt=cache_salt,
            response_format=fmt,
        )
    except TandemClientError as e:
        typer.echo(f"\nerror: {e}" if dec.ids else f"error: {e}", err=True)
        raise typer.Exit(2 if isinstance(e, ServerUnreachable) else 1)
    if as_json:
        keys = (
            "token_ids",
            "rounds",
            "drafted",
            "accepted",
            "mean_acceptance_length",
            "finish_reason",
            "tokens_per_s",
            "stop_string",
            "usage",
        )
        print(
            json.dumps(
                {
                    **{k: res[k] for k in keys},
                    "text": turn_text(tok.decode, res["token_ids"], res["stop_string"]),
                    "ttft_s": res["ttft_s"],
                },
                ensure_ascii=False,
            )
        )
        return
    sys.stdout.write(dec.flush() + "\n")
    sys.stdout.flush()
    typer.echo(_stats(res), err=True)


@app.command("chat")
def chat_cmd(
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="tokens per reply at most"),
    spec: Optional[str] = typer.Option(None, "--spec", help=_SPEC_HELP),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", "-k", help="drafts per round"),
    url: str = typer.Option(DEFAULT_URL, "--url", help="Triton gRPC endpoint host:port"),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="folder with tokenizer.json"),
    system: Optional[str] = typer.Option(None, "--system", help="optional system message (first turn)"),
    timeout_s: float = typer.Option(300.0, "--timeout", help="seconds to wait between responses"),
    stats: bool = typer.Option(False, "--stats", help="print each reply's stats line on stderr"),
    cache_salt: Optional[str] = typer.Option(None, "--cache-salt", help=_SALT_HELP),
) -> None:
    """A conversation on one sequence: each line you type is a turn; the server keeps the context.
    An empty line or end of input (Ctrl-D) ends the session. With input piped in, each turn's line is
    echoed as ``> line`` before its reply, so the output reads as a transcript."""
    spec = spec_flag(spec)
    try:
        check_flags(max_tokens, spec, num_draft_tokens, {})
        check_url(url)
        check_salt(cache_salt)
    except (ValueError, TandemClientError) as e:
        _fail(str(e), 2)
    tok = _tokenizer(checkpoint or default_checkpoint())
    sid, first, interactive = new_sequence_id(), True, sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.buffer.readline().decode("utf-8")
        except UnicodeDecodeError as e:
            _fail(f"stdin is not UTF-8 text (byte 0x{e.object[e.start]:02x})", 2)
        if not line.strip():
            break
        text = line.rstrip("\n")
        dec = IncrementalDecoder(tok.decode)
        if interactive:
            sys.stdout.write("tandem> ")
        else:  # piped: mark where each turn starts (a terminal shows what was typed; a pipe does not)
            sys.stdout.write(f"> {text}\n")
            sys.stdout.flush()

        def on_tokens(new_ids, dec=dec):
            piece = dec.push(new_ids)
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()

        try:
            res = generate(
                tok.chat_prompt(text, system=system if first else None, later=not first),
                max_tokens=max_tokens,
                url=url,
                spec=spec if first else None,
                num_draft_tokens=num_draft_tokens,
                sequence_id=sid,
                sequence_start=first,
                sequence_end=False,
                on_tokens=on_tokens,
                timeout_s=timeout_s,
                cache_salt=cache_salt if first else None,
            )
        except TandemClientError as e:
            typer.echo(f"\nerror: {e}" if dec.ids else f"error: {e}", err=True)
            raise typer.Exit(2 if isinstance(e, ServerUnreachable) else 1)
        sys.stdout.write(dec.flush() + "\n")
        sys.stdout.flush()
        if stats:
            typer.echo(_stats(res), err=True)
        first = False
    if not first:  # end the sequence: the server frees its state now, not at the idle timeout
        try:
            generate(
                [], max_tokens=1, url=url, sequence_id=sid, sequence_start=False, sequence_end=True, timeout_s=timeout_s
            )
        except TandemClientError:
            pass


@app.command("health")
def health_cmd(
    url: str = typer.Option(DEFAULT_URL, "--url", help="Triton gRPC endpoint host:port"),
    timeout_s: float = typer.Option(5.0, "--timeout", help="seconds each probe may take"),
) -> None:
    """Check that the server is live, every tandem model is ready and every stage model's process
    answers (exit 1 otherwise, 2 when no server answers)."""
    try:
        states = stage_health(url, timeout_s)
    except TandemClientError as e:
        _fail(str(e), 2)
    for m, state in states.items():
        typer.echo(f"{m}: {state}")
    if any(v != "READY" for v in states.values()):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
