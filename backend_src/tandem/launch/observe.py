"""Watching a running server from outside: its Prometheus metrics (the tandem gauges of
:data:`tandem.serving.engine_core.GAUGES` and each stage's ``tandem_stage_sequences``) and the resident
memory of its processes (tritonserver and one Python-backend stub per model). Used by the leak and
fault tests and by ``make soak``."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

_LINE = re.compile(r'^(tandem_\w+)\{model="([\w-]+)"\} ([-+0-9.eE]+|NaN)$')


def tandem_metrics(metrics_port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """``{model: {gauge: value}}`` of every ``tandem_*`` metric on ``http://host:port/metrics``
    (gauge names without the ``tandem_`` prefix). Raises ``OSError`` when the port does not answer."""
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out.setdefault(m.group(2), {})[m.group(1)[len("tandem_") :]] = float(m.group(3))
    return out


def scrape(
    metrics_port: int, host: str = "127.0.0.1", prefix: str = "tandem_", timeout_s: float = 5.0
) -> dict[tuple[str, frozenset], float]:
    """Every sample of the metrics named ``prefix*`` on the metrics port, parsed by
    ``prometheus_client``: ``(sample name, frozenset of (label, value))`` -> value (histograms give
    their ``_bucket`` / ``_count`` / ``_sum`` samples). Raises ``OSError`` when the port does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith(prefix)
        for s in fam.samples
    }


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def process_rss(root_pid: int) -> dict[str, int]:
    """Resident memory in bytes of ``root_pid`` (``tritonserver``) and each descendant, keyed by
    ``tritonserver`` or the stub's model instance (``trunk_0_0``; from its command line). Linux ``/proc``."""
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024 if "VmRSS" in status else 0
        name = (
            "tritonserver"
            if pid == root_pid
            else next((a.decode() for a in cmd if re.fullmatch(rb"\w+_\d+_\d+", a)), f"pid{pid}")
        )
        out[name] = rss
        todo += _children(pid)
    return out


def _descendants(root_pid: int):
    """Yield ``(pid, argv as bytes)`` of every live process under ``root_pid`` (not itself)."""
    todo = _children(root_pid)
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield pid, cmd
        todo += _children(pid)


def stub_pids(root_pid: int) -> list[int]:
    """The pids of every Python-backend stub process under ``root_pid`` (``triton_python_backend_stub``)."""
    return [pid for pid, cmd in _descendants(root_pid) if cmd[0].endswith(b"triton_python_backend_stub")]


def stub_pid(root_pid: int, model: str) -> int:
    """The pid of ``model``'s Python-backend stub process under ``root_pid``. Raises ``LookupError``."""
    for pid, cmd in _descendants(root_pid):
        if any(re.fullmatch(rf"{model}_\d+_\d+".encode(), a) for a in cmd):
            return pid
    raise LookupError(f"no stub process of model {model!r} under pid {root_pid}")
