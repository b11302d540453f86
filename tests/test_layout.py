"""The layout shows the architecture: packages import one way (no cycle), and the layers below
the engine never reach up into it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "import_graph.py"


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_package_import_cycle():
    graph = _graph_module()
    assert graph.cycles(graph.graph()) == []


def test_no_module_import_cycle_inside_a_package():
    """Function-level imports count: a lazy import that closes a loop is still a cycle."""
    graph = _graph_module()
    edges = graph.module_graph()
    assert "macspec.models.store" in edges.get("macspec.models.built", set())  # the graph sees imports
    assert graph.cycles(edges) == []


def test_models_store_is_the_bottom_of_models():
    edges = _graph_module().module_graph()
    assert not edges.get("macspec.models.store"), edges.get("macspec.models.store")


def test_lower_layers_do_not_import_the_engine_or_the_server():
    edges = _graph_module().graph()
    for low in ("spec", "distributed", "proposers", "faults", "kv", "sampling", "models"):
        assert not edges.get(low, set()) & {"engine", "server", "run", "cli"}, (low, edges.get(low))


def test_the_cycle_finder_finds_cycles():
    graph = _graph_module()
    assert graph.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_proposer_methods_are_listed_in_one_place():
    """A literal naming two or more proposer methods anywhere but the registry is a second list
    that a new proposer would miss (its priors unsaved, its CLI choice absent...)."""
    import ast

    from macspec.proposers import METHODS

    package = SCRIPT.parent.parent / "macspec"
    found = []
    for path in package.rglob("*.py"):
        if path.name == "proposers.py" or path.parts[-2] == "forge":  # forge: training schedules
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(METHODS)
                if len(names) >= 2:
                    found.append(f"{path.relative_to(package)}:{node.lineno} {sorted(names)}")
    assert found == []
