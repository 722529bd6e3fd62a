"""The documentation: the generated reference docs match the code, the README stays a short
document for users, and no markdown file holds a dated work log (history lives in git)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from tandem import schema, schema_text
from tandem.tools import docs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: dated-log phrases: work sessions, tracker numbers, milestone labels
LOG_PATTERNS = [re.compile(p, re.I) for p in (r"\bsit" r"ting\b", r"\bissue \d+", r"\bMS\d\b", r"\bmust-show\b")]


def _markdown_files() -> list[Path]:
    """Markdown files git tracks or would track (untracked, not ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return [ROOT / p for p in out if (ROOT / p).exists()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".venv-genai", "triton_backends", "reports", "runs", ".git"}
        return [p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)]


def _outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def test_generated_docs_are_current():
    """`python -m tandem.tools.docs --check` passes: docs/wire.md and docs/options.md are what the schema gives."""
    p = subprocess.run([sys.executable, "-m", "tandem.tools.docs", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr + "\nregenerate: .venv/bin/python -m tandem.tools.docs"


def test_a_changed_default_makes_the_docs_stale(tmp_path):
    """A ServingConfig default changed without regenerating fails the check, naming docs/options.md."""
    before = docs.generate()
    changed = dataclasses.replace(schema.DEFAULTS, burst_rounds=schema.DEFAULTS.burst_rounds + 1)
    after = docs.generate(changed)
    assert after[docs.OPTIONS] != before[docs.OPTIONS] and after[docs.WIRE] == before[docs.WIRE]
    assert f"| `{changed.burst_rounds}` |" in after[docs.OPTIONS]
    for rel, text in before.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    assert docs.stale(tmp_path, before) == []
    assert docs.stale(tmp_path, after) == [docs.OPTIONS]
    (tmp_path / docs.WIRE).unlink()
    assert docs.stale(tmp_path, before) == [docs.WIRE]


def test_every_option_and_tensor_is_documented():
    text = docs.render_options()
    field_docs = docs.field_docs()
    for f in dataclasses.fields(schema.ServingConfig):
        assert f"## {f.name}\n" in text
        assert field_docs[f.name], f"ServingConfig's docstring does not describe {f.name}"
    wire = docs.render_wire()
    for m in [*schema.MODELS.values(), *schema_text.MODELS.values()]:
        assert f"## {m.name}\n" in wire
        for t in (*m.inputs, *m.outputs):
            assert f"| `{t.name}` |" in wire, (m.name, t.name)


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 350, f"README.md has {n} lines (at most 350: move depth to docs/)"


def test_readme_lines_outside_code_are_short():
    long = [(n, len(line)) for n, line in _outside_code(README.read_text(encoding="utf-8")) if len(line) > 200]
    assert long == [], f"README.md lines over 200 characters outside code blocks (line, length): {long}"


def test_no_markdown_file_holds_a_dated_log():
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
        for p in _markdown_files()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if any(r.search(line) for r in LOG_PATTERNS)
    ]
    assert hits == [], "\n".join(hits)


def test_docs_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists (docs/security.md aside
    until it is written)."""
    missing = []
    for p in [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", p.read_text(encoding="utf-8")):
            if not (p.parent / target).exists() and Path(target).name != "security.md":
                missing.append(f"{p.relative_to(ROOT)} -> {target}")
    assert missing == []
