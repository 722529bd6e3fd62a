"""``make loadtest``: a headless Locust ramp against tandem, with reports and plots.

Steps: start ``tritonserver`` on free 127.0.0.1 ports (:func:`tandem.launch.serve.running_server`)
unless ``--url`` is given; check the model (ready, metadata, context limit; sampled requests only
when it has a ``TEMPERATURE`` input); build the ShareGPT workload; run ``loadtest/locustfile.py``
headless in a subprocess (1 -> ``--users`` users in steps) with Locust's ``--csv`` and ``--html``;
then write ``summary.csv`` / ``summary.json`` / ``summary.md`` and the PNG plots and print the
summary table. Everything lands in ``--report-dir`` (default ``reports/loadtest-<UTC timestamp>/``).

Exit status: 0 when every request succeeded, 1 when some failed (or Locust did not finish), 2 on
bad arguments or a refused configuration.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from loadtest import report  # noqa: E402
from loadtest.common import TEMPERATURE_INPUT, model_max_ctx, ramp_levels, sampling_input, parse_specs, split_host  # noqa: E402
from loadtest.workload import build_sessions, describe, save_workload  # noqa: E402
from tandem import schema  # noqa: E402

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
MODEL = schema.TANDEM.name
#: Seconds allowed beyond the ramp for Locust's start-up and shutdown before it is killed.
LOCUST_GRACE_S = 90.0

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


class Refused(Exception):
    """The run cannot go ahead as asked (message says why); exit status 2."""


def default_checkpoint() -> Path:
    """``$TANDEM_CHECKPOINT`` if set, else ``model_repository/weights/tandem-tiny``."""
    env = os.environ.get("TANDEM_CHECKPOINT")
    return Path(env) if env else REPO_ROOT / "model_repository" / "weights" / "tandem-tiny"


def default_report_dir() -> Path:
    """``reports/loadtest-<UTC YYYYmmdd-HHMMSS>`` under the repository root."""
    return REPO_ROOT / "reports" / f"loadtest-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"


def preflight(url: str, sampled: bool, timeout_s: float = 30.0) -> dict:
    """Ask the server at ``url`` (gRPC ``host:port``) whether model ``tandem`` is ready and what it
    takes. Returns ``{"max_ctx": tokens, "sampling": TEMPERATURE input or None}``.

    Raises :class:`Refused` when the server or model is not ready, or when ``sampled`` is True and
    the model has no ``TEMPERATURE`` input (the server decodes greedily only).
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    c = grpcclient.InferenceServerClient(url)
    try:
        try:
            if not c.is_model_ready(MODEL, client_timeout=timeout_s):
                raise Refused(f"model {MODEL!r} is not ready at {url}")
            meta = c.get_model_metadata(MODEL, as_json=True, client_timeout=timeout_s)
            cfg = c.get_model_config(MODEL, as_json=True, client_timeout=timeout_s)
        except InferenceServerException as e:
            raise Refused(f"cannot query {MODEL!r} at {url}: {e.message() or e}") from None
    finally:
        c.close()
    sampling = sampling_input(meta)
    if sampled and sampling is None:
        raise Refused(
            f"--sampled-share > 0 asks for sampled requests, but model {MODEL!r} at {url} has no "
            f"{TEMPERATURE_INPUT} input (this server decodes greedily only). Use --sampled-share 0."
        )
    return {"max_ctx": model_max_ctx(cfg), "sampling": sampling}


def _local_model_takes_temperature() -> bool:
    return TEMPERATURE_INPUT in schema.TANDEM.input_names


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL it if it is still alive after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_locust(argv: list[str], log_path: Path, limit_s: float, echo: bool = True) -> int:
    """Run Locust (``argv``) with its output copied to ``log_path`` (and stdout when ``echo``);
    SIGTERM after ``limit_s`` seconds, SIGKILL 20 s later. Returns its exit status (-9 / -15 when
    stopped)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    old_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + old_path)
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )

        def pump():
            for line in proc.stdout:
                logf.write(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            print(f"loadtest: Locust still running after {limit_s:.0f} s; stopping it", file=sys.stderr)
            _stop_group(proc)
        except BaseException:  # Ctrl-C / SIGTERM: let Locust shut down (it ends its users' streams)
            print("loadtest: interrupted; stopping Locust", file=sys.stderr, flush=True)
            _stop_group(proc)
            raise
        t.join(timeout=10)
    return proc.returncode


def print_table(summary: dict) -> None:
    """Print the per-level summary table (rich when available)."""
    try:
        from rich.console import Console
        from rich.table import Table

        tb = Table(title="tandem load test (latencies in ms, throughput in output tokens/s, tau = 1 + accepted/rounds)")
        for h in report.TABLE_HEADER:
            tb.add_column(h, justify="right")
        rows = report.table_rows(summary)
        for i, r in enumerate(rows):
            tb.add_row(*r, end_section=(i == len(rows) - 2))
        Console(width=max(140, os.get_terminal_size(0).columns if sys.stdout.isatty() else 140)).print(tb)
    except ImportError:
        print(report.markdown_table(summary))


@app.command()
def main(
    users: int = typer.Option(8, "--users", "-u", min=1, help="users at the last ramp step (ramp: 1 -> USERS)"),
    step_users: int = typer.Option(1, "--step-users", min=1, help="users added per ramp step"),
    start_users: int = typer.Option(1, "--start-users", min=1, help="users at the first ramp step (USERS: no ramp)"),
    step_seconds: float = typer.Option(30.0, "--step-seconds", min=1.0, help="seconds each ramp step lasts"),
    max_tokens: int = typer.Option(
        128,
        "--max-tokens",
        "--max-output-tokens",
        min=1,
        help="cap on each turn's output tokens (ShareGPT reply lengths are cut to it)",
    ),
    url: str = typer.Option("", "--url", help="gRPC host:port of a running server (default: start one here)"),
    checkpoint: Optional[Path] = typer.Option(
        None,
        "--checkpoint",
        help="checkpoint folder (tokenizer; weights for the server started "
        "here) [default: $TANDEM_CHECKPOINT or "
        "model_repository/weights/tandem-tiny]",
    ),
    report_dir: Optional[Path] = typer.Option(None, "--report-dir", help="[default: reports/loadtest-<UTC time>]"),
    sampled_share: float = typer.Option(
        0.0,
        "--sampled-share",
        min=0.0,
        max=1.0,
        help="share of sessions sent as sampled requests (needs a TEMPERATURE input)",
    ),
    temperature: float = typer.Option(1.0, "--temperature", help="temperature of sampled requests"),
    multi_turn_share: float = typer.Option(
        0.5, "--multi-turn-share", min=0.0, max=1.0, help="share of multi-turn sessions"
    ),
    max_turns: int = typer.Option(4, "--max-turns", min=1, help="turns per multi-turn session at most"),
    max_prompt_tokens: int = typer.Option(1024, "--max-prompt-tokens", min=8, help="cap on each turn's prompt tokens"),
    sessions: int = typer.Option(256, "--sessions", min=1, help="sessions drawn from ShareGPT"),
    seed: int = typer.Option(0, "--seed", help="workload and per-user seed"),
    spec: str = typer.Option(
        schema.DEFAULTS.spec,
        "--spec",
        help="speculation method, or a comma list of specs that sessions pick from at random: "
        + ", ".join(schema.SPECS),
    ),
    num_draft_tokens: int = typer.Option(0, "--num-draft-tokens", min=0, help="drafts per round (0: server default)"),
    response_timeout: float = typer.Option(
        120.0, "--response-timeout", min=1.0, help="seconds a user waits for each streamed response"
    ),
    stop_timeout: float = typer.Option(
        30.0, "--stop-timeout", min=0.0, help="seconds users get to finish their turn when the ramp ends"
    ),
    ready_timeout: float = typer.Option(300.0, "--ready-timeout", help="seconds to wait for the server started here"),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="allow a non-loopback --url"),
    locust_args: str = typer.Option("", "--locust-args", help="extra Locust arguments (one string)"),
    quiet: bool = typer.Option(False, "--quiet", help="do not echo Locust's output (it is still in locust.log)"),
) -> None:
    """Ramp 1 -> USERS users against the tandem model and report TTFT, ITL, throughput and tau."""
    # SIGTERM unwinds like Ctrl-C, so the server started here and Locust are always stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        parse_specs(spec)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    try:
        target = split_host(url, allow_remote=allow_remote) if url else ""
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    ckpt = (checkpoint or default_checkpoint()).resolve()
    if not (ckpt / "tokenizer.json").exists():
        typer.echo(f"error: no tokenizer.json in {ckpt} (pass --checkpoint DIR or set TANDEM_CHECKPOINT)", err=True)
        raise typer.Exit(2)
    if not url:
        if not (ckpt / "model.safetensors").exists():
            typer.echo(
                f"error: {ckpt} has no model.safetensors to serve (train it with `make model`, pass "
                f"--checkpoint DIR, or point --url at a running server)",
                err=True,
            )
            raise typer.Exit(2)
        if sampled_share > 0 and not _local_model_takes_temperature():
            typer.echo(
                f"error: --sampled-share > 0 asks for sampled requests, but model {MODEL!r} in "
                f"model_repository has no {TEMPERATURE_INPUT} input (the server decodes greedily only). "
                f"Use --sampled-share 0.",
                err=True,
            )
            raise typer.Exit(2)
    try:
        levels = ramp_levels(users, step_users, start_users)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    out = (report_dir or default_report_dir()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"loadtest: report folder {out}")
    print(
        f"loadtest: ramp {' -> '.join(map(str, levels))} users, {step_seconds:g} s per step "
        f"({len(levels) * step_seconds:g} s), max {max_tokens} output tokens per turn, checkpoint {ckpt}"
    )

    from tandem.model.tokenizer import ChatTokenizer
    from tandem.launch.serve import ServerError, running_server

    rc = 0
    with contextlib.ExitStack() as stack:
        if not target:
            print("loadtest: starting tritonserver on free 127.0.0.1 ports ...", flush=True)
            t = time.monotonic()
            try:
                srv = stack.enter_context(
                    running_server(
                        env={"TANDEM_CHECKPOINT": str(ckpt)},
                        ready_timeout_s=ready_timeout,
                        log_path=out / "tritonserver.log",
                    )
                )
            except ServerError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(1)
            target = srv.grpc_url
            print(f"loadtest: server ready at {target} in {time.monotonic() - t:.1f} s", flush=True)
        try:
            info = preflight(target, sampled=sampled_share > 0)
        except Refused as e:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when still empty (a started server's log stays)
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        tok = ChatTokenizer(ckpt / "tokenizer.json")
        sess = build_sessions(
            tok,
            sessions,
            max_tokens,
            max_prompt_tokens,
            multi_turn_share,
            max_turns,
            sampled_share,
            info["max_ctx"],
            seed,
        )
        shape = describe(sess)
        save_workload(out / "workload.json", sess, meta={"shape": shape, "max_ctx": info["max_ctx"], "seed": seed})
        print(
            f"loadtest: workload {shape['sessions']} sessions ({shape['multi_turn_share']:.0%} multi-turn, "
            f"{shape['turns']} turns, {shape['sampled_share']:.0%} sampled), prompt tokens mean "
            f"{shape['prompt_tokens']['mean']:.0f} / p90 {shape['prompt_tokens']['p90']}, output cap mean "
            f"{shape['max_tokens']['mean']:.0f} / p90 {shape['max_tokens']['p90']}",
            flush=True,
        )
        raw = out / "raw.jsonl"
        raw.unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "--only-summary",
            "--host",
            target,
            "--csv",
            str(out / "locust"),
            "--html",
            str(out / "locust.html"),
            "--stop-timeout",
            f"{stop_timeout:g}",
            "--loglevel",
            "INFO",
            "--ramp-max-users",
            str(users),
            "--ramp-step-users",
            str(step_users),
            "--ramp-start-users",
            str(start_users),
            "--ramp-step-seconds",
            f"{step_seconds:g}",
            "--tandem-workload",
            str(out / "workload.json"),
            "--tandem-raw",
            str(raw),
            "--tandem-model",
            MODEL,
            "--max-output-tokens",
            str(max_tokens),
            "--seed",
            str(seed),
            "--spec",
            spec,
            "--num-draft-tokens",
            str(num_draft_tokens),
            "--temperature",
            str(temperature),
            "--response-timeout",
            f"{response_timeout:g}",
        ]
        if allow_remote:
            argv.append("--allow-remote")
        argv += shlex.split(locust_args)
        limit = len(levels) * step_seconds + stop_timeout + LOCUST_GRACE_S
        print(f"loadtest: running Locust (at most {limit:.0f} s) ...", flush=True)
        rc = run_locust(argv, out / "locust.log", limit, echo=not quiet)

    if not raw.exists():
        typer.echo(f"error: Locust wrote no records (exit status {rc}); see {out / 'locust.log'}", err=True)
        raise typer.Exit(1)
    summary = report.summarize(raw)
    summary["config"] = {
        "users": users,
        "step_users": step_users,
        "step_seconds": step_seconds,
        "max_tokens": max_tokens,
        "spec": spec,
        "sampled_share": sampled_share,
        "checkpoint": str(ckpt),
        "url": url or "(started by the runner)",
        "workload": shape,
    }
    report.write_summary(summary, out)
    title = f"{ckpt.name}, spec {spec}, max {max_tokens} output tokens, {step_seconds:g} s per step"
    pngs = report.plot_all(summary, raw, out, title_suffix=title)
    (out / "summary.md").write_text(f"# tandem load test\n\n{title}\n\n" + report.markdown_table(summary))
    print()
    print_table(summary)
    bs = summary["by_sampling"]
    print(
        "loadtest: tau "
        + ", ".join(
            f"{k} {report._fmt(r['tau'], 2)} ({r['requests']} turns, {r['failures']} failed)" for k, r in bs.items()
        )
    )
    failures = summary["all"]["failures"]
    print(f"loadtest: reports in {out}: locust.html, locust_stats.csv, summary.csv, " + ", ".join(p.name for p in pngs))
    if failures or rc != 0:
        why = f"{failures} failed requests" if failures else f"Locust exit status {rc}"
        typer.echo(f"loadtest: FAILED ({why}); see {out / 'locust_failures.csv'} and {out / 'locust.log'}", err=True)
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
