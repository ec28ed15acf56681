"""Import hygiene, read from the source with `ast` (nothing is imported): no cycle between
metrale's packages, every import going down the layers (LAYERS), no private name imported
from another metrale module (nor by the benchmarks), no dispatch on class-name strings.

Every import counts, at module level or inside a function: a lazy import hides a
dependency from the reader, not from the design.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "metrale"

def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
# Scripts that use metrale as a library: held to its public names like any module.
CLIENTS: dict[str, Path] = {_module_name(p): p for p in sorted((ROOT / "bench").glob("*.py"))}


def _unit(module: str) -> str:
    """The node of the package graph a module belongs to: its subpackage
    (metrale.engine, metrale.ops, ...), or itself at the top level (metrale.config)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py"):
        return ".".join(parts[:2])
    return module


def _imports(module: str):
    """(imported metrale module, names taken from it, line) for every import in module."""
    path = MODULES.get(module) or CLIENTS[module]
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "metrale":
                    yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "metrale":
                continue
            names = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:  # `from metrale.ops import fused_triton` imports a module
                    yield sub, (), node.lineno
                else:
                    names.append(alias.name)
            if names:
                yield source, tuple(names), node.lineno


def _rel(module: str) -> str:
    return (MODULES.get(module) or CLIENTS[module]).relative_to(ROOT).as_posix()


def test_every_import_resolves_to_a_module():
    missing = [f"{_rel(m)}:{line}: {target}" for m in [*MODULES, *CLIENTS]
               for target, _, line in _imports(m) if target not in MODULES]
    assert not missing, "imports of no metrale module (the graph below would miss them):\n" + \
        "\n".join(missing)


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> unit it imports -> the import lines that make the edge."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for m in MODULES:
        for target, _, line in _imports(m):
            a, b = _unit(m), _unit(target)
            if a != b:
                graph[a][b].append(f"{_rel(m)}:{line} imports {target}")
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                found.append(sorted(component))

    for v in sorted(set(graph) | {_unit(m) for m in MODULES}):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_package_cycle():
    graph = _package_graph()
    report = []
    for component in _cycles(graph):
        report.append("cycle between " + ", ".join(component) + ":")
        report += [f"  {a} -> {b}: {graph[a][b][0]}"
                   for a in component for b in component if b in graph.get(a, {})]
    assert not report, "\n".join(report)


# metrale's units (_unit), bottom layer first: a unit imports only from units below it.
LAYERS = (
    "metrale.errors",
    "metrale.names",  # adapter names, torch-free: the CLI and the registry share the rule
    "metrale.progress",
    "metrale.config",
    "metrale.dtypes",  # config's dtype names -> torch dtypes (config itself is torch-free)
    "metrale.threads",
    "metrale.forward_context",  # where the engine (writes) and the model and ops (read) meet
    "metrale.adapters",
    "metrale.ops",
    "metrale.model",
    "metrale.pool",
    "metrale.peer",
    "metrale.engine",
    "metrale",  # the package's own names (LLM, SamplingParams, __version__)
    "metrale.server",
    "metrale.cluster",
    "metrale.demo_adapters",  # training code: the CLI may prepare the demo adapters, no server
    "metrale.cli",
    "metrale.__main__",
)


def _upward_imports(graph, layers) -> list[str]:
    """An import line for every edge from a unit to one in a higher layer."""
    rank = {unit: i for i, unit in enumerate(layers)}
    return [f"{a} -> {b}: {where[0]}" for a, targets in sorted(graph.items())
            for b, where in sorted(targets.items()) if rank[a] < rank[b]]


def test_layer_check_finds_an_upward_import():
    graph = {"top": {"bottom": ["top.py:1 imports bottom"]},
             "bottom": {"top": ["bottom.py:7 imports top"]}}
    assert _upward_imports(graph, ("bottom", "top")) == ["bottom -> top: bottom.py:7 imports top"]
    assert _upward_imports({"top": graph["top"]}, ("bottom", "top")) == []


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units <= set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"
    assert set(LAYERS) <= units, f"no such unit (drop from LAYERS): {sorted(set(LAYERS) - units)}"


def test_imports_go_down_the_layers():
    upward = _upward_imports(_package_graph(), LAYERS)
    assert not upward, ("a unit imports one of a higher layer (LAYERS lists them bottom first); "
                        "move the shared code down, or pass it in from above:\n" + "\n".join(upward))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_imports() -> dict[tuple[str, str, str], str]:
    found = {}
    for m in [*MODULES, *CLIENTS]:
        for target, names, line in _imports(m):
            for part in target.split(".")[1:]:
                if _is_private(part):
                    found[(_rel(m), target, part)] = f"{_rel(m)}:{line}: module {target}"
            for name in names:
                if _is_private(name):
                    found[(_rel(m), target, name)] = f"{_rel(m)}:{line}: {name} from {target}"
    return found


def test_no_private_names_imported_across_modules():
    new = [where for _, where in sorted(_private_imports().items())]
    assert not new, ("a module imports another's private name; make it public where it is "
                     "defined, or move it to a module both can use:\n" + "\n".join(new))


def _names_a_class(node: ast.AST) -> bool:
    """type(x).__name__ or x.__class__.__name__ (or __qualname__)."""
    if not (isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__")):
        return False
    v = node.value
    return ((isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "type")
            or (isinstance(v, ast.Attribute) and v.attr == "__class__"))


def _is_str_literal(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_str_literal(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_no_dispatch_on_class_name_strings():
    """Comparing a class's name with a string breaks silently when the class is renamed
    or wrapped: use isinstance, or ask the object (an attribute, a protocol)."""
    found = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(map(_names_a_class, operands)) and any(map(_is_str_literal, operands)):
                    found.append(f"{_rel(m)}:{node.lineno}")
    assert not found, "class-name string comparisons:\n" + "\n".join(found)
