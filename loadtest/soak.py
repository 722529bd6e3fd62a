"""``make soak``: Locust at a constant number of users for minutes, with cancelled turns, multi-turn
sessions and bad requests mixed in, while the server's memory and session gauges are sampled.

Beside Locust's users, one more client (:func:`mixer`) cycles through the edge kinds of turn in
:data:`KINDS`: an empty later turn (no new tokens after a turn that ended), a sequence id reused with
cancels between its sessions, a long prompt cancelled :data:`PREFILL_CANCEL_S` s in (during its
prefill), a long prompt beside a short turn, and ``max_tokens`` 1 turns; each must end as
:func:`run_kind` says.

Passes when there is no unexpected failure (a bad request refused naming its field and a cancelled
turn are expected outcomes), every kind ran and ended as expected, every state gauge (:func:`off_baseline`) is
back at baseline after the run (sessions abandoned between turns are reclaimed by the server's idle timeout,
10 s here), and each process's memory is flat: its median RSS over the last third of the run within
``--rss-tolerance`` of its median over the first third (after ``--warmup-s``). Writes ``memory.jsonl``,
``kinds.jsonl`` (one line per kind run), ``soak.png`` and ``soak.md`` beside the load test's own report
(``reports/soak-<UTC time>/``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])
#: the ``tandem`` model's state gauges judged at baseline (0) beside the stages' sequences (:func:`stage_sequences`):
#: what open sessions and their turns hold
SESSION_GAUGES = ("sessions_open", "turns_running", "turns_waiting", "cache_rows", "state_bytes")
#: the edge kinds of turn :func:`mixer` runs beside Locust's users (:func:`run_kind` says what each checks)
KINDS = ("empty_later_turn", "reused_id_with_cancels", "cancel_in_prefill", "long_beside_short", "max_tokens_1")
#: prompt tokens of a long prompt (with room left for its reply within the 4,096-token context)
LONG_PROMPT_TOKENS = 3000
#: seconds after sending a long prompt that its client cancels it (its prefill still runs then)
PREFILL_CANCEL_S = 0.3
_SHORT = (
    "What is a hash table?",
    "Name three rivers.",
    "Explain recursion.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "Give me a recipe for bread.",
)
_WORDS = (
    "the",
    "river",
    "runs",
    "under",
    "a",
    "stone",
    "bridge",
    "where",
    "old",
    "trains",
    "once",
    "crossed",
    "and",
    "children",
    "count",
    "boats",
    "in",
    "summer",
    "light",
    "while",
    "market",
    "stalls",
    "sell",
    "bread",
    "apples",
    "rope",
    "lamps",
    "maps",
    "of",
    "distant",
    "harbours",
    "to",
    "travellers",
)


class _Walkaway(Exception):
    """Raised from a burst callback: the client cancels its turn after the first burst."""


def long_prompt(tok, tokens: int, seed: int) -> list[int]:
    """A chat prompt (token ids) of about ``tokens`` ids: seeded random words, so two seeds share no cached
    prefix beyond the template and each prime does its full work."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(tokens))
    return tok.chat_prompt(tok.decode(tok.encode(text)[:tokens]))


def run_kind(kind: str, url: str, tok, rng: random.Random) -> dict:
    """Run one ``kind`` of :data:`KINDS` against the ``tandem`` model at ``url``; returns ``{"kind", "ok",
    "error", "s"}`` (``error``: what ended otherwise than expected; ``s``: seconds it took).

    - ``empty_later_turn``: a turn that ends, then a later turn with no new tokens: completes.
    - ``reused_id_with_cancels``: one sequence id for a first turn cancelled after its first burst, a new
      first turn (completes), a later turn cancelled, and one more new first turn (completes).
    - ``cancel_in_prefill``: a long prompt whose client cancels it after :data:`PREFILL_CANCEL_S` s:
      no response before that or a completed turn; any error from the server is unexpected.
    - ``long_beside_short``: a long prompt and a short turn at once: both complete.
    - ``max_tokens_1``: a first and a later turn with ``max_tokens`` 1: one token each.
    """
    from tandem_client.client import TandemClientError, generate, new_sequence_id

    def short() -> list[int]:
        return tok.chat_prompt(rng.choice(_SHORT))

    def completes(ids, n, **kw) -> dict:
        res = generate(ids, n, url=url, **kw)
        if res["finish_reason"] not in ("length", "stop") or not 1 <= len(res["token_ids"]) <= n:
            raise TandemClientError(
                f"turn ended {res['finish_reason']!r} with {len(res['token_ids'])} tokens (max_tokens {n})"
            )
        return res

    def walk_away(ids, **kw) -> None:
        def on_tokens(_ids):
            raise _Walkaway

        try:
            generate(ids, 64, url=url, on_tokens=on_tokens, **kw)
        except _Walkaway:
            pass

    t0, error = time.monotonic(), None
    try:
        if kind == "empty_later_turn":
            sid = new_sequence_id()
            completes(short(), 8, sequence_id=sid, sequence_end=False)
            completes([], 8, sequence_id=sid, sequence_start=False)
        elif kind == "reused_id_with_cancels":
            sid = new_sequence_id()
            walk_away(short(), sequence_id=sid, sequence_end=False)
            completes(short(), 4, sequence_id=sid, sequence_end=False)
            walk_away(
                tok.chat_prompt("Tell me more.", later=True), sequence_id=sid, sequence_start=False, sequence_end=False
            )
            completes(short(), 4, sequence_id=sid)
        elif kind == "cancel_in_prefill":
            try:
                completes(long_prompt(tok, LONG_PROMPT_TOKENS, rng.getrandbits(32)), 16, timeout_s=PREFILL_CANCEL_S)
            except TandemClientError as e:
                if not str(e).startswith("no response from"):  # the client's own walk-away is expected
                    raise
        elif kind == "long_beside_short":
            box: dict = {}

            def long_turn() -> None:
                try:
                    completes(long_prompt(tok, LONG_PROMPT_TOKENS, rng.getrandbits(32)), 16)
                except TandemClientError as e:
                    box["error"] = f"the long prompt: {e}"

            th = threading.Thread(target=long_turn)
            th.start()
            time.sleep(0.1)
            completes(short(), 8)
            th.join()
            if "error" in box:
                raise TandemClientError(box["error"])
        elif kind == "max_tokens_1":
            sid = new_sequence_id()
            completes(short(), 1, sequence_id=sid, sequence_end=False)
            completes(tok.chat_prompt("And then?", later=True), 1, sequence_id=sid, sequence_start=False)
        else:
            raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    except TandemClientError as e:
        error = str(e)
    return {"kind": kind, "ok": error is None, "error": error, "s": round(time.monotonic() - t0, 3)}


def mixer(
    url: str,
    tok,
    stop: threading.Event,
    records: list[dict],
    kinds: tuple[str, ...] = KINDS,
    seed: int = 0,
    pause_s: float = 0.5,
) -> None:
    """Run ``kinds`` (of :data:`KINDS`) in turn, each round shuffled, against ``url`` until ``stop`` is set,
    appending each :func:`run_kind` record to ``records``."""
    rng = random.Random(seed)
    while kinds and not stop.is_set():
        for kind in rng.sample(kinds, len(kinds)):
            if stop.is_set():
                return
            records.append(run_kind(kind, url, tok, rng))
            stop.wait(pause_s)


def served_drafters(env: dict[str, str]) -> tuple[str, ...]:
    """The drafter models a server started with ``env`` loads (``colocate`` off; none by default, the drafters
    then run in the ``tandem`` model's process)."""
    from tandem.launch.serve import DRAFTER_MODELS, models_to_load

    return tuple(m for m in models_to_load(env) if m in DRAFTER_MODELS)


def stage_sequences(metrics: dict[str, dict[str, float]], drafters: tuple[str, ...]) -> dict[str, float]:
    """Sequences each stage holds, from ``metrics`` (:func:`~tandem.launch.observe.tandem_metrics`): ``trunk``,
    the ``tandem`` model's ``trunk_sequences`` (the engine core runs the trunk), and each served drafter model
    of ``drafters``, its ``stage_sequences``. A gauge missing is NaN: never at baseline."""
    nan = float("nan")
    return {
        "trunk": metrics.get("tandem", {}).get("trunk_sequences", nan),
        **{d: metrics.get(d, {}).get("stage_sequences", nan) for d in drafters},
    }


def off_baseline(s: dict) -> dict[str, float]:
    """The state gauges of sample ``s`` (:func:`sample`) not at baseline (0): each stage's sequences and
    tandem's :data:`SESSION_GAUGES`; a missing gauge counts as off (NaN)."""
    values = {**s["stages"], **{k: s["tandem"].get(k, float("nan")) for k in SESSION_GAUGES}}
    return {k: v for k, v in values.items() if v != 0}


def sample(srv, drafters: tuple[str, ...] = ()) -> dict:
    """One sample: epoch seconds, RSS in MB per process, tandem's gauges and each stage's sequences
    (:func:`stage_sequences`; ``drafters``: the drafter models the server loaded)."""
    from tandem.launch.observe import process_rss, tandem_metrics

    m = tandem_metrics(srv.metrics_port)
    return {
        "t": time.time(),
        "rss_mb": {k: v / 2**20 for k, v in process_rss(srv.proc.pid).items()},
        "tandem": m.get("tandem", {}),
        "stages": stage_sequences(m, drafters),
    }


def memory_verdict(samples: list[dict], warmup_s: float, tolerance: float) -> dict[str, float]:
    """Per process, median RSS of the last third over the first third of the samples after
    ``warmup_s``, minus 1 (0.02 = 2% growth). Raises ``ValueError`` with fewer than 6 such samples."""
    import numpy as np

    t0 = samples[0]["t"]
    kept = [s for s in samples if s["t"] - t0 >= warmup_s]
    if len(kept) < 6:
        raise ValueError(f"{len(kept)} memory samples after the warm-up; run longer or sample more often")
    third = len(kept) // 3
    out = {}
    for name in kept[0]["rss_mb"]:
        first = np.median([s["rss_mb"].get(name, np.nan) for s in kept[:third]])
        last = np.median([s["rss_mb"].get(name, np.nan) for s in kept[-third:]])
        out[name] = float(last / first - 1)
    return out


def plot(samples: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["t"]
    ts = [s["t"] - t0 for s in samples]
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name in samples[0]["rss_mb"]:
        a.plot(ts, [s["rss_mb"].get(name) for s in samples], label=name)
    a.set_ylabel("RSS (MB)")
    a.legend(fontsize=8)
    a.set_title(title)
    for key in ("sessions_open", "turns_running", "session_slots_free"):
        if key != "session_slots_free":
            b.plot(ts, [s["tandem"].get(key, 0) for s in samples], label=key)
    for st in samples[0]["stages"]:
        b.plot(ts, [s["stages"].get(st) for s in samples], "--", label=f"{st} sequences")
    b.set_xlabel("seconds")
    b.set_ylabel("count")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command()
def main(
    minutes: float = typer.Option(5.0, "--minutes", min=0.1, help="how long the users run"),
    users: int = typer.Option(8, "--users", "-u", min=1, help="users (all from the start)"),
    cancel_share: float = typer.Option(0.1, "--cancel-share", min=0.0, max=1.0, help="share of turns cancelled"),
    bad_share: float = typer.Option(0.05, "--bad-share", min=0.0, max=1.0, help="share of bad requests"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="cap on each turn's output tokens"),
    spec: str = typer.Option("mtp,dflash2,off", "--spec", help="specs sessions pick from"),
    sample_s: float = typer.Option(5.0, "--sample-s", min=0.5, help="seconds between memory samples"),
    warmup_s: float = typer.Option(60.0, "--warmup-s", min=0.0, help="seconds of samples left out of the memory check"),
    rss_tolerance: float = typer.Option(0.05, "--rss-tolerance", help="allowed RSS growth, last third vs first"),
    idle_timeout_s: float = typer.Option(
        10.0,
        "--idle-timeout-s",
        min=1.0,
        help="the server's idle timeout: sessions abandoned between turns must be reclaimed within it after the run",
    ),
    prefix_cache_mb: int = typer.Option(
        16,
        "--prefix-cache-mb",
        min=0,
        help="the prefix cache's bound: small, so it "
        "fills during the warm-up (growth up to the bound is the cache, not a leak)",
    ),
    report_dir: Optional[Path] = typer.Option(None, "--report-dir", help="[default: reports/soak-<UTC time>]"),
    kinds_opt: str = typer.Option(
        ",".join(KINDS), "--kinds", help="edge kinds the extra client cycles through, a comma list (empty: none)"
    ),
) -> None:
    """Soak the server: constant USERS for MINUTES with faults mixed in; fail on any unexpected error,
    a state gauge off baseline afterwards, memory that grows, or a server that cannot stop within its
    exit timeout."""
    from loadtest import report
    from tandem.model.checkpoint import DEFAULT_CHECKPOINT
    from tandem.model.tokenizer import ChatTokenizer
    from tandem.launch.serve import running_server

    seconds = minutes * 60
    chosen = tuple(k.strip() for k in kinds_opt.split(",") if k.strip())
    if unknown := [k for k in chosen if k not in KINDS]:
        raise typer.BadParameter(f"unknown kind(s) {unknown}; choose from {','.join(KINDS)}", param_hint="--kinds")
    if seconds < warmup_s + 6 * sample_s:  # memory_verdict needs six samples after the warm-up
        raise typer.BadParameter(
            f"{seconds:g} s leave fewer than 6 memory samples after the {warmup_s:g} s warm-up "
            f"(one every {sample_s:g} s): run at least {(warmup_s + 6 * sample_s) / 60:.2f} "
            "minutes, or lower --warmup-s",
            param_hint="--minutes",
        )
    out = (report_dir or Path("reports") / time.strftime("soak-%Y%m%dT%H%M%SZ", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"soak: {users} users for {seconds:g} s, {cancel_share:.0%} of turns cancelled, {bad_share:.0%} bad "
        f"requests, specs {spec}; report in {out}",
        flush=True,
    )
    samples: list[dict] = []
    kinds: list[dict] = []
    stop, users_done = threading.Event(), threading.Event()
    tok = ChatTokenizer(Path(DEFAULT_CHECKPOINT) / "tokenizer.json")
    env = {
        "TANDEM_CHECKPOINT": str(Path(DEFAULT_CHECKPOINT).resolve()),
        "TANDEM_PREFIX_CACHE_MB": str(prefix_cache_mb),
        "TANDEM_IDLE_TIMEOUT_S": f"{idle_timeout_s:g}",
    }
    drafters = served_drafters(env)
    with running_server(env=env, log_path=out / "tritonserver.log") as srv:

        def sampler():
            while not stop.is_set():
                try:
                    samples.append(sample(srv, drafters))
                except OSError as e:
                    print(f"soak: sample failed: {e}", file=sys.stderr)
                stop.wait(sample_s)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        mix = threading.Thread(target=mixer, args=(srv.grpc_url, tok, users_done, kinds, chosen), daemon=True)
        mix.start()
        cmd = [
            sys.executable,
            "-m",
            "loadtest.run",
            "--url",
            srv.grpc_url,
            "--users",
            str(users),
            "--start-users",
            str(users),
            "--step-seconds",
            f"{seconds:g}",
            "--max-tokens",
            str(max_tokens),
            "--spec",
            spec,
            "--report-dir",
            str(out),
            "--quiet",
            "--locust-args",
            f"--cancel-share {cancel_share} --bad-share {bad_share} --failure-backoff 0.2",
        ]
        rc = subprocess.call(cmd)
        users_done.set()
        mix.join()
        # idle: sessions abandoned between turns (a user stopped without END, a cancel that came after
        # its turn had ended) are reclaimed by the idle timeout; every gauge must then be at baseline
        t_end, settle = time.time(), None
        while time.time() - t_end < idle_timeout_s + 5:
            if not off_baseline(sample(srv, drafters)):
                settle = time.time() - t_end
                break
            time.sleep(0.5)
        stop.set()
        th.join()
        samples.append(sample(srv, drafters))
    (out / "memory.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (out / "kinds.jsonl").write_text("".join(json.dumps(k) + "\n" for k in kinds))
    per_kind = {k: [r for r in kinds if r["kind"] == k] for k in chosen}
    kinds_ok = all(rs and all(r["ok"] for r in rs) for rs in per_kind.values())
    final = samples[-1]
    off = off_baseline(final)
    growth = memory_verdict(samples, warmup_s, rss_tolerance)
    faults = report.fault_counts(out / "raw.jsonl") if (out / "raw.jsonl").exists() else {}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    failures = summary.get("all", {}).get("failures")
    turns = summary.get("all", {}).get("requests")
    plot(
        samples,
        out / "soak.png",
        f"soak: {users} users, {seconds:g} s, {faults.get('cancelled', 0)} cancelled, "
        f"{faults.get('bad', 0)} bad requests",
    )
    # a server that cannot stop within its exit timeout holds a request it never released (a leak)
    stuck = "Exit timeout expired" in (out / "tritonserver.log").read_text(errors="replace")
    ok = (
        rc == 0
        and failures == 0
        and not faults.get("bad_wrong")
        and not off
        and not stuck
        and kinds_ok
        and all(g < rss_tolerance for g in growth.values())
    )
    lines = [
        f"# tandem soak: {'PASSED' if ok else 'FAILED'}",
        "",
        f"{users} users for {seconds:g} s; {turns} turns, {failures} unexpected failures; "
        f"{faults.get('cancelled', 0)} turns cancelled by the client; {faults.get('bad', 0)} bad requests "
        f"({faults.get('bad_wrong', 0)} not refused as they should be)",
        "",
        "| process | RSS at the end (MB) | RSS growth, last third vs first |",
        "|---|---|---|",
    ]
    for name, g in growth.items():
        lines.append(f"| {name} | {samples[-2]['rss_mb'].get(name, 0):.0f} | {100 * g:+.1f}% |")
    lines += ["", "| edge kind | runs | not as expected | first of those |", "|---|---|---|---|"]
    for kind, rs in per_kind.items():
        bad = [r for r in rs if not r["ok"]]
        first = bad[0]["error"].replace("|", "/")[:160] if bad else ("" if rs else "never ran")
        lines.append(f"| {kind} | {len(rs)} | {len(bad)} | {first} |")
    lines += [
        "",
        f"state gauges after the run: {'baseline' if not off else off}"
        + (
            f" ({settle:.1f} s after the last user stopped; idle_timeout_s {idle_timeout_s:g})"
            if settle is not None
            else ""
        ),
        f"gauges at the end: {final['tandem']}",
        "server stop: "
        + (
            "did not stop within its exit timeout (a model kept a request in flight)"
            if stuck
            else "clean (every model unloaded within the exit timeout)"
        ),
        "",
        "![memory and sessions](soak.png)",
    ]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:-1]))
    print(f"soak: {'PASSED' if ok else 'FAILED'}; report {out / 'soak.md'}")
    if not ok:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
