"""No import cycles anywhere in `rlloom/`: every import counts, also one inside a function or
under TYPE_CHECKING, since a lazy import that closes a loop still ties the modules together."""
import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlloom"


def _module(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package's name stands for its
    __init__)."""
    modules = {_module(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                deps |= {m for m in (base, *(f"{base}.{a.name}" for a in node.names))
                         if m in modules}
        graph[name] = deps - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_lazy_and_type_only_imports_close_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert set(cycle(graph)) == {"pkg.a", "pkg.sub.b", "pkg.c"}
    (pkg / "c.py").write_text("")
    assert cycle(import_graph(pkg)) is None


def test_no_import_cycles_in_rlloom():
    graph = import_graph()
    assert "rlloom.runtime.executor.loop" in graph["rlloom.runtime.executor.launch"]
    found = cycle(graph)
    assert found is None, f"import cycle: {' -> '.join(found)}"
