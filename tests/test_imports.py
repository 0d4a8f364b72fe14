"""The package's shape, read from its source: no import cycles among moespec's modules (imports
inside functions count), docs/architecture.md's module floors drawn from the code as it is, and no
class or module past the sizes a reader can hold."""
import ast

from import_graph import ROOT, cycles, draw_floors, drawn_block, import_graph, module_files

MAX_CLASS_LINES, MAX_MODULE_LINES = 400, 700


def test_no_import_cycles():
    graph = import_graph()
    assert "moespec.engine" in graph and "moespec.engine" in graph["moespec.startup"]  # the reader sees the package
    assert cycles(graph) == []


def test_a_cycle_is_found_even_through_a_local_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_architecture_page_draws_the_floors_of_the_code():
    drawn = drawn_block((ROOT / "docs" / "architecture.md").read_text())
    assert drawn == draw_floors(import_graph()), "redraw: python tests/import_graph.py --write docs/architecture.md"


def test_no_class_or_module_past_its_size():
    too_long = []
    for name, path in module_files().items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
