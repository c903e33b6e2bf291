"""The core's shape: no import circle inside ``kvcm_core`` (imports under
``TYPE_CHECKING`` and inside functions count), no core module reading or writing another
object's underscore attributes, and the heart modules kept small."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcm_core

CORE = Path(kvcm_core.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(CORE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in CORE.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every kvcm_core module ``path`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("kvcm_core"):
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        # A package's __init__ importing its own submodules (re-exports) is no circle.
        deps = _imports(path, name, known)
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if d == "kvcm_core" or (n != "kvcm_core" and n.startswith("kvcm_core.") and
                                    d == "kvcm_core"):
                continue  # the package facade re-exports; submodules never import it
            if color.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in color:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if n not in color:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_circle_in_the_core_type_checking_and_local_imports_included() -> None:
    graph = _graph()
    assert "kvcm_core.cache" in graph and "kvcm_core.levels" in graph
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_the_circle_finder_finds_a_planted_circle() -> None:
    graph = {"kvcm_core.a": {"kvcm_core.b"}, "kvcm_core.b": {"kvcm_core.c"},
             "kvcm_core.c": {"kvcm_core.a"}}
    assert _find_cycle(graph) == ["kvcm_core.a", "kvcm_core.b", "kvcm_core.c", "kvcm_core.a"]


def _foreign_private_accesses(source: str) -> list[str]:
    """``x._name`` where ``x`` is neither ``self`` nor ``cls`` (dunder names allowed)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def test_no_core_module_reads_or_writes_another_objects_underscore_attributes() -> None:
    found = []
    for name, path in sorted(_modules().items()):
        found += [f"{name}: {hit}" for hit in _foreign_private_accesses(path.read_text())]
    assert not found, "\n".join(found)


def test_the_private_access_finder_sees_reads_and_writes() -> None:
    src = "def f(m):\n    m._x = 1\n    return m._y + self._z + obj.__dict__\n"
    assert [h.split(" ")[0] for h in _foreign_private_accesses(src)] == ["m._x", "m._y"]


def test_cache_and_manager_modules_stay_under_600_lines() -> None:
    for name in ("cache.py", "manager.py"):
        lines = len((CORE / name).read_text().splitlines())
        assert lines < 600, f"{name}: {lines} lines"
