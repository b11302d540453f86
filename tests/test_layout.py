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


def test_lower_layers_do_not_import_the_engine_or_the_server():
    edges = _graph_module().graph()
    for low in ("spec", "distributed", "runner", "kv", "sampling", "models"):
        assert not edges.get(low, set()) & {"engine", "server", "run", "cli"}, (low, edges.get(low))


def test_the_cycle_finder_finds_cycles():
    graph = _graph_module()
    assert graph.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
