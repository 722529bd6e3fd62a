"""``make soak``: Locust at a constant number of users for minutes, with cancelled turns, multi-turn
sessions and bad requests mixed in, while the server's memory and session gauges are sampled.

Passes when there is no unexpected failure (a bad request refused naming its field and a cancelled
turn are expected outcomes), every state gauge is back at baseline after the run (sessions abandoned
between turns are reclaimed by the server's idle timeout, 10 s here), and each process's
memory is flat: its median RSS over the last third of the run within ``--rss-tolerance`` of its
median over the first third (after ``--warmup-s``). Writes ``memory.jsonl``, ``soak.png`` and
``soak.md`` beside the load test's own report (``reports/soak-<UTC time>/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])
STAGE_GAUGES = ("trunk", "drafter_mtp", "drafter_dflash")


def sample(srv) -> dict:
    """One sample: epoch seconds, RSS in MB per process, tandem's gauges and each stage's sequences."""
    from tandem.serving.observe import process_rss, tandem_metrics

    m = tandem_metrics(srv.metrics_port)
    return {"t": time.time(), "rss_mb": {k: v / 2**20 for k, v in process_rss(srv.proc.pid).items()},
            "tandem": m.get("tandem", {}), "stages": {s: m.get(s, {}).get("stage_sequences", 0.0) for s in STAGE_GAUGES}}


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
    for st in STAGE_GAUGES:
        b.plot(ts, [s["stages"][st] for s in samples], "--", label=f"{st} sequences")
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
    spec: str = typer.Option("mtp,dflash2,off", "--spec", help="arms sessions pick from"),
    sample_s: float = typer.Option(5.0, "--sample-s", min=0.5, help="seconds between memory samples"),
    warmup_s: float = typer.Option(60.0, "--warmup-s", min=0.0, help="seconds of samples left out of the memory check"),
    rss_tolerance: float = typer.Option(0.05, "--rss-tolerance", help="allowed RSS growth, last third vs first"),
    idle_timeout_s: float = typer.Option(10.0, "--idle-timeout-s", min=1.0, help="the server's idle timeout: "
                                         "sessions abandoned between turns must be reclaimed within it after the run"),
    prefix_cache_mb: int = typer.Option(16, "--prefix-cache-mb", min=0, help="the prefix cache's bound: small, so it "
                                        "fills during the warm-up (growth up to the bound is the cache, not a leak)"),
    report_dir: Optional[Path] = typer.Option(None, "--report-dir", help="[default: reports/soak-<UTC time>]"),
) -> None:
    """Soak the server: constant USERS for MINUTES with faults mixed in; fail on any unexpected error,
    a state gauge off baseline afterwards, memory that grows, or a server that cannot stop within its
    exit timeout."""
    from loadtest import report
    from tandem.model.checkpoint import DEFAULT_CHECKPOINT
    from tandem.serving.serve import running_server

    seconds = minutes * 60
    if seconds < warmup_s + 6 * sample_s:  # memory_verdict needs six samples after the warm-up
        raise typer.BadParameter(f"{seconds:g} s leave fewer than 6 memory samples after the {warmup_s:g} s warm-up "
                                 f"(one every {sample_s:g} s): run at least {(warmup_s + 6 * sample_s) / 60:.2f} "
                                 "minutes, or lower --warmup-s", param_hint="--minutes")
    out = (report_dir or Path("reports") / time.strftime("soak-%Y%m%dT%H%M%SZ", time.gmtime())).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak: {users} users for {seconds:g} s, {cancel_share:.0%} of turns cancelled, {bad_share:.0%} bad "
          f"requests, arms {spec}; report in {out}", flush=True)
    samples: list[dict] = []
    stop = threading.Event()
    env = {"TANDEM_CHECKPOINT": str(Path(DEFAULT_CHECKPOINT).resolve()), "TANDEM_PREFIX_CACHE_MB": str(prefix_cache_mb),
           "TANDEM_IDLE_TIMEOUT_S": f"{idle_timeout_s:g}"}
    with running_server(env=env, log_path=out / "tritonserver.log") as srv:
        def sampler():
            while not stop.is_set():
                try:
                    samples.append(sample(srv))
                except OSError as e:
                    print(f"soak: sample failed: {e}", file=sys.stderr)
                stop.wait(sample_s)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        cmd = [sys.executable, "-m", "loadtest.run", "--url", srv.grpc_url, "--users", str(users),
               "--start-users", str(users), "--step-seconds", f"{seconds:g}", "--max-tokens", str(max_tokens),
               "--spec", spec, "--report-dir", str(out), "--quiet",
               "--locust-args", f"--cancel-share {cancel_share} --bad-share {bad_share} --failure-backoff 0.2"]
        rc = subprocess.call(cmd)
        # idle: sessions abandoned between turns (a user stopped without END, a cancel that came after
        # its turn had ended) are reclaimed by the idle timeout; every gauge must then be at baseline
        t_end, settle = time.time(), None
        while time.time() - t_end < idle_timeout_s + 5:
            s = sample(srv)
            if not any(s["stages"].values()) and not s["tandem"].get("sessions_open") and not s["tandem"].get("turns_running"):
                settle = time.time() - t_end
                break
            time.sleep(0.5)
        stop.set()
        th.join()
        samples.append(sample(srv))
    (out / "memory.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    final = samples[-1]
    off_baseline = {k: v for k, v in {**final["stages"], "sessions_open": final["tandem"].get("sessions_open", 0),
                                      "turns_running": final["tandem"].get("turns_running", 0)}.items() if v}
    growth = memory_verdict(samples, warmup_s, rss_tolerance)
    faults = report.fault_counts(out / "raw.jsonl") if (out / "raw.jsonl").exists() else {}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    failures = summary.get("all", {}).get("failures")
    turns = summary.get("all", {}).get("requests")
    plot(samples, out / "soak.png", f"soak: {users} users, {seconds:g} s, {faults.get('cancelled', 0)} cancelled, "
                                   f"{faults.get('bad', 0)} bad requests")
    # a server that cannot stop within its exit timeout holds a request it never released (a leak)
    stuck = "Exit timeout expired" in (out / "tritonserver.log").read_text(errors="replace")
    ok = rc == 0 and failures == 0 and not faults.get("bad_wrong") and not off_baseline and not stuck and \
        all(g < rss_tolerance for g in growth.values())
    lines = [f"# tandem soak: {'PASSED' if ok else 'FAILED'}", "",
             f"{users} users for {seconds:g} s; {turns} turns, {failures} unexpected failures; "
             f"{faults.get('cancelled', 0)} turns cancelled by the client; {faults.get('bad', 0)} bad requests "
             f"({faults.get('bad_wrong', 0)} not refused as they should be)", "",
             "| process | RSS at the end (MB) | RSS growth, last third vs first |", "|---|---|---|"]
    for name, g in growth.items():
        lines.append(f"| {name} | {samples[-2]['rss_mb'].get(name, 0):.0f} | {100 * g:+.1f}% |")
    lines += ["", f"state gauges after the run: {'baseline' if not off_baseline else off_baseline}"
              + (f" ({settle:.1f} s after the last user stopped; idle_timeout_s {idle_timeout_s:g})" if settle is not None
                 else ""),
              f"gauges at the end: {final['tandem']}",
              "server stop: " + ("did not stop within its exit timeout (a model kept a request in flight)" if stuck
                                 else "clean (every model unloaded within the exit timeout)"),
              "", "![memory and sessions](soak.png)"]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:-1]))
    print(f"soak: {'PASSED' if ok else 'FAILED'}; report {out / 'soak.md'}")
    if not ok:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
