"""The import graphs of macspec, and whether they have a cycle.

    python benchmarks/import_graph.py      # prints "a -> b" edges; exit 1 on a cycle

Every `import`/`from` in macspec/ counts, function-level ones included (a lazy import is
still a dependency). Two graphs: between macspec's top-level modules and packages (engine,
spec, ...), and between modules inside each package (engine.engine -> engine.scheduler).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "macspec"


def node_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "macspec" or len(parts) < 2 or parts[1] == "__version__":
        return None
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                out.add(target)
                if not node.module:  # from . import x: x may be a module
                    out.update(f"{target}.{alias.name}" for alias in node.names)
            elif node.module:
                out.add(node.module)
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = node_of(module_name(path))
        if source is None:
            continue
        for target in imports(path):
            dest = node_of(target)
            if dest and dest != source:
                edges.setdefault(source, set()).add(dest)
    return edges


def module_graph() -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a package's __init__ is a module)."""
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        package = source.rsplit(".", 1)[0] if path.name != "__init__.py" else source
        for target in imports(path):
            while target and target not in modules:  # `from .x import name`: x, not name
                target = target.rsplit(".", 1)[0] if "." in target else ""
            same_package = target.rsplit(".", 1)[0] == package if target else False
            if target and target != source and same_package:
                edges.setdefault(source, set()).add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    edges = graph()
    for source in sorted(edges):
        print(f"{source} -> {', '.join(sorted(edges[source]))}")
    found = cycles(edges)
    for component in found:
        print("cycle:", " <-> ".join(component))
    print("no package import cycle" if not found else f"{len(found)} cycle(s)")
    module_cycles = cycles(module_graph())
    for component in module_cycles:
        print("module cycle:", " <-> ".join(component))
    print("no module import cycle" if not module_cycles else f"{len(module_cycles)} module cycle(s)")
    return 1 if found or module_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
