"""The package layers import only downward: wire <- schema <- schema_text <- model <- engine <- serving <- tools."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "backend_src" / "tandem"
ORDER = ["wire", "schema", "schema_text", "model", "engine", "serving", "tools"]


def _layer(module: str) -> int:
    return ORDER.index(module.split(".")[0])


def _imports(path: Path) -> list[str]:
    """``tandem``-relative module names imported by ``path`` (absolute ``tandem.x`` or relative)."""
    rel = path.relative_to(PKG).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[: len(rel) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [".".join(base + [a.name]) for a in node.names]
            elif node.module and node.module.startswith("tandem."):
                names = [node.module[len("tandem."):]]
            elif node.module == "tandem":
                names = [a.name for a in node.names]
            else:
                names = []
            out += [n for n in names if n]
    return out


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.parent != PKG or p.name != "__init__.py"),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_imports_run_downward(path):
    own = path.relative_to(PKG).parts[0].removesuffix(".py")
    for mod in _imports(path):
        assert _layer(mod) <= _layer(own), f"{path.relative_to(PKG)} imports {mod} (a higher layer)"


def test_no_source_file_over_400_lines():
    root = PKG.parents[1]
    files = [p for d in ("backend_src", "client", "loadtest", "model_repository", "tests", "kernels")
             for p in (root / d).rglob("*.py")]
    long = {str(p.relative_to(root)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
