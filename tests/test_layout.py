"""The source layout: layers import only downward, each package runs in the process its name says, no
module imports itself back, and each file keeps its line budget.

Layers, lowest first: the modules every process shares (``wire``, ``schema``, ``schema_text``,
``internal_key``), then ``ops`` (the kernels behind one dispatch), ``model`` (the reference glm5_next in torch), ``engine`` (the engine core and its
stages), ``serving`` (inside Triton's model processes), ``front`` (the OpenAI-compatible API's process, a
client of the server), ``launch`` (the launcher's process, which starts tritonserver and the front) and
``tools``."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "backend_src" / "tandem"
ORDER = [
    "wire",
    "schema",
    "schema_text",
    "internal_key",
    "ops",
    "model",
    "engine",
    "serving",
    "front",
    "launch",
    "tools",
]
#: packages a package must not import although they sit below it: the launcher starts the server's
#: processes and never runs their code
APART = {"launch": {"engine", "serving", "front"}, "front": {"engine", "serving"}}


def _layer(module: str) -> int:
    return ORDER.index(module.split(".")[0])


def _imports(path: Path) -> list[str]:
    """``tandem``-relative module names imported by ``path`` (absolute ``tandem.x`` or relative)."""
    rel = path.relative_to(PKG).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name[len("tandem.") :] for a in node.names if a.name.startswith("tandem.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[: len(rel) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [".".join(base + [a.name]) for a in node.names]
            elif node.module and node.module.startswith("tandem."):
                names = [node.module[len("tandem.") :]]
            elif node.module == "tandem":
                names = [a.name for a in node.names]
            else:
                names = []
            out += [n for n in names if n]
    return out


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PKG.rglob("*.py") if p.parent != PKG or p.name != "__init__.py"),
    ids=lambda p: str(p.relative_to(PKG)),
)
def test_imports_run_downward(path):
    own = path.relative_to(PKG).parts[0].removesuffix(".py")
    for mod in _imports(path):
        assert _layer(mod) <= _layer(own), f"{path.relative_to(PKG)} imports {mod} (a higher layer)"
        assert mod.split(".")[0] not in APART.get(own, ()), f"{path.relative_to(PKG)} imports {mod} (another process)"


#: a source file's line budget: none may pass ``HARD_LINES``; one over ``LISTED_LINES`` must be listed in
#: ``LONG_FILES`` with the reason it stays whole (code is split by responsibility, never by a line count)
HARD_LINES, LISTED_LINES = 800, 500
LONG_FILES: dict[str, str] = {
    "backend_src/tandem/schema.py": "the wire declared once: every model's tensors, the serving defaults and limits",
    "backend_src/tandem/launch/serve.py": "one path from the wheel to a running tritonserver (backend folder, argv, "
    "environment, lifetime)",
    "tests/test_cluster.py": "every test of one served configuration (replicas behind HAProxy) shares its cluster",
    "tests/test_faults_served.py": "every test of one served configuration (short limits) shares its server",
}


def test_source_files_keep_their_line_budget():
    root = PKG.parents[1]
    files = [
        p
        for d in ("backend_src", "client", "loadtest", "model_repository", "tests", "kernels")
        for p in (root / d).rglob("*.py")
    ]
    lines = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in files}
    assert {f: n for f, n in lines.items() if n > HARD_LINES} == {}
    assert {f: n for f, n in lines.items() if n > LISTED_LINES and f not in LONG_FILES} == {}
    assert [f for f in LONG_FILES if lines.get(f, 0) <= LISTED_LINES] == []  # the list holds only long files


def _module(path: Path) -> str:
    """``tandem``-relative dotted name of a source file (a package's ``__init__`` is the package)."""
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle():
    """No module reaches itself through imports, at module level or inside a function (Tarjan's strongly
    connected components over the import graph; an imported name that is not a module counts as its
    package)."""
    paths = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for m, p in paths.items():
        deps = set()
        for d in _imports(p):
            while d and d not in paths:
                d = d.rpartition(".")[0]
            if d and d != m:
                deps.add(d)
        graph[m] = deps
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_model_reaches_its_kernels_only_through_dispatch():
    """``model/`` is the reference in torch: of :mod:`tandem.ops` it imports the dispatch point, the settings,
    the state types and the FP8 block format (torch), never a kernel module (numba or Triton)."""
    allowed = {"ops.dispatch", "ops.settings", "ops.state", "ops.fp8"}
    for path in sorted((PKG / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = ("." * node.level + (node.module or "")).lstrip(".").removeprefix("tandem.")
            names = [mod] if mod != "ops" else [f"ops.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("ops"):
                    assert name in allowed, f"model/{path.name} imports {name}"
