"""tools/ stays a set of small modules without import cycles (issue 20).

tools/bench.py was 2,033 lines, and bench_sharded.py, bench_replica.py and bench_s3.py
imported it back while it imported them; these checks keep the split into tools/benchkit/
and tools/crashkit/ from growing back. Imports inside functions count: a lazy import that
closes a loop is a cycle all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

from _helpers import REPO

TOOLS = REPO / "tools"
MAX_LINES = 800


def _modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` by its dotted name, as ``python tools/x.py`` imports it
    (tools/ on ``sys.path``): ``bench``, ``benchkit``, ``benchkit.harness``, ..."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def _graph(root: Path) -> dict[str, set[str]]:
    mods = _modules(root)
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_lazy_import_back(tmp_path: Path) -> None:
    """The checker has teeth: the old shape (bench.py importing bench_sharded inside a
    function, bench_sharded importing bench at the top) is a cycle; a package whose
    modules import downwards is not."""
    (tmp_path / "bench.py").write_text("def main():\n    import bench_sharded\n")
    (tmp_path / "bench_sharded.py").write_text("import bench\n")
    pkg = tmp_path / "kit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kit import b\nfrom kit.c import f\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("def f(): pass\n")
    graph = _graph(tmp_path)
    assert graph["kit.a"] == {"kit", "kit.b", "kit.c"}
    assert graph["kit.b"] == {"kit", "kit.c"}
    assert _cycles(graph) == [["bench", "bench_sharded"]]
    (pkg / "c.py").write_text("def f():\n    from .a import g\n")
    assert _cycles(_graph(tmp_path)) == [["bench", "bench_sharded"], ["kit.a", "kit.b", "kit.c"]]


def test_no_import_cycle_in_tools() -> None:
    graph = _graph(TOOLS)
    assert {"bench", "benchkit.cli", "benchkit.sharded", "crashtest", "crashkit.server"} <= set(
        graph
    )
    assert "benchkit.cli" in graph["bench"]
    assert _cycles(graph) == []


def test_no_module_in_tools_over_800_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules(TOOLS).items()}
    assert {k: v for k, v in sizes.items() if v > MAX_LINES} == {}
