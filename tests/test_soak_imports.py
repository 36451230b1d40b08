"""The soak package's modules import one another one way: no cycle, counting ``if TYPE_CHECKING:`` and
function-level imports, and only the driver imports the report (the loads record into ``findings``)."""

import ast
import pathlib

import hotloop.soak

PACKAGE = "hotloop.soak"


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source."""
    root = pathlib.Path(hotloop.soak.__file__).parent
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for m in modules:
        edges = set()
        for node in ast.walk(ast.parse((root / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith(PACKAGE + "."):
                    edges.add(name[len(PACKAGE) + 1:].split(".")[0])
        graph[m] = (edges & modules) - {m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()

    def visit(m, path):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph[m]):
            found = visit(n, path + [m])
            if found:
                return found
        done.add(m)
        return None

    for m in sorted(graph):
        found = visit(m, [])
        if found:
            return found
    return None


def test_the_soak_modules_import_one_way():
    graph = _import_graph()
    assert {"findings", "report", "driver"} <= graph.keys(), sorted(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert sorted(m for m, edges in graph.items() if "report" in edges) == ["driver"], graph


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
