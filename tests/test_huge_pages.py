"""Transparent huge pages for torch's large CPU allocations (``schema.HUGE_PAGES_ENV``): the processes
that decode (the ``trunk`` model's, the bench's in-process rows) ask for them before torch's first
allocation; a value the user set is kept. The served check is in tests/test_serving.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import schema

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages off")


def anon_huge_kb(pid: int | str = "self") -> int:
    """``AnonHugePages`` of process ``pid`` (KiB)."""
    return next(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup") if line.startswith("AnonHugePages"))


def _after_import(module: str, env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != schema.HUGE_PAGES_ENV}
    if env_value is not None:
        env[schema.HUGE_PAGES_ENV] = env_value
    code = (f"import sys, {module}\nassert 'torch' not in sys.modules\nimport torch\n"
            "x = torch.empty(64 << 20, dtype=torch.uint8); x.fill_(1)\n"
            "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@needs_thp
def test_the_bench_puts_torchs_large_allocations_in_huge_pages_and_keeps_a_users_zero():
    # a 64 MiB buffer: 63,488 KiB of it in 2 MiB pages measured; none with HUGE_PAGES_ENV=0 (or without the bench)
    assert _after_import("tandem.tools.bench", None) >= 32 << 10
    assert _after_import("tandem.tools.bench", "0") < 32 << 10
    assert _after_import("tandem.schema", None) < 32 << 10


@needs_thp
def test_the_trunk_models_weights_sit_in_huge_pages_and_the_other_models_ask_for_none(server):
    from tandem.serving.observe import stub_pid

    assert anon_huge_kb(stub_pid(server.proc.pid, "trunk")) >= 2048  # (30 MiB measured)
    assert anon_huge_kb(stub_pid(server.proc.pid, "tandem")) < 2048  # (0 measured: it holds no weights)
