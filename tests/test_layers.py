"""Imports in the package go downwards only, and in no circle (docs/architecture.md, "How it is built").

The check reads the package's syntax tree: every import, at module level and inside functions (a lazy import that
closes a circle is still a circle), except those under ``if TYPE_CHECKING:``. Importing ``a.b.c`` from outside the
package ``a.b`` runs ``a/b/__init__.py`` (and ``a/__init__.py``) first, so it counts as importing those too. It fails
on (a) any import circle, (b) any import of Lightning reachable from ``parallel/``, ``checkpoint/``, ``profiling/`` or
``planning/`` and (c) any import of a higher layer of :data:`LAYERS`.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_dist"
#: The name of the package's own ``__init__.py`` as a room of :data:`LAYERS`.
PACKAGE_ROOM = "__init__"

#: The rooms of the package (its folders and top-level modules), top to bottom, as docs/architecture.md states them.
#: A module may import its own room and any room of a lower layer; rooms of one layer may import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),  # the console entry: `lightning-dist`
    ("commands",),  # its tools
    (PACKAGE_ROOM,),  # the package itself: registers the strategy names, exports the public classes and verify()
    ("verification", "dryrun"),  # verify's runs; the dry run (one rank's Trainer at a time, on fake collectives)
    ("lightning_cli", "callbacks"),  # the LightningCLI class (fit and verify's runs), the callbacks
    ("fabric",),  # the Fabric strategies, adapters over the Trainer strategies
    ("strategies",),
    ("plugins",),
    ("profiling",),  # FLOPs per token read off the planner's model facts
    ("planning",),
    ("parallel",),
    ("checkpoint",),
    ("compat", "version", "progress"),  # `__version__` (also in each checkpoint's provenance); progress display
)
#: Pure PyTorch: no module these rooms import, directly or through another, may import Lightning.
PURE_PYTORCH = ("parallel", "checkpoint", "profiling", "planning")
LIGHTNING = {"lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics"}


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``module`` (of the package or not) at ``line``."""

    importer: str
    module: str
    line: int

    def where(self, modules: Mapping[str, Path]) -> str:
        return f"{modules[self.importer].relative_to(ROOT)}:{self.line}"


def module_files(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by its dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_statements(tree: ast.Module, name: str, is_package: bool) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """``(module, names, line)`` of every import in ``tree`` (module ``name``) outside ``if TYPE_CHECKING:`` blocks,
    relative imports resolved: ``import a.b`` gives ``("a.b", (), line)``, ``from a import b, c``
    ``("a", ("b", "c"), line)``."""
    package = name if is_package else name.rpartition(".")[0]
    for node in _nodes_outside_type_checking(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            yield base, tuple(alias.name for alias in node.names), node.lineno


def _nodes_outside_type_checking(node: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _nodes_outside_type_checking(other)
            continue
        yield child
        yield from _nodes_outside_type_checking(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(modules: Mapping[str, Path], name: str) -> list[Import]:
    """What module ``name`` imports: each module of the package it names, with the packages above that module (their
    ``__init__`` runs first) except those enclosing ``name`` (they ran before ``name`` did); of anything else, the
    top-level name. ``from a import b`` names the module ``a.b`` if there is one, else ``a`` itself, even when ``a``
    encloses ``name``: ``b`` is then defined in ``a/__init__.py``."""
    path = modules[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, Import] = {}
    for base, names, line in import_statements(tree, name, path.name == "__init__.py"):
        if base.split(".")[0] != PACKAGE:
            found.setdefault(base.split(".")[0], Import(name, base.split(".")[0], line))
            continue
        submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
        named = submodules + ([base] if len(submodules) < len(names) or not names else [])
        for target in named:
            parts = target.split(".")
            for module in [".".join(parts[:end]) for end in range(1, len(parts))]:
                if module in modules and module != name and not name.startswith(f"{module}."):
                    found.setdefault(module, Import(name, module, line))
            if target in modules and target != name:
                found.setdefault(target, Import(name, target, line))
    return list(found.values())


@cache
def package_imports() -> tuple[dict[str, Path], dict[str, list[Import]]]:
    modules = module_files(ROOT / PACKAGE)
    return modules, {name: module_imports(modules, name) for name in modules}


def module_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Module → the package's modules it imports, and where each import is (``file:line``)."""
    modules, imports = package_imports()
    graph = {name: {i.module for i in found if i.module in modules} for name, found in imports.items()}
    return graph, {(i.importer, i.module): i.where(modules) for found in imports.values() for i in found}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE_ROOM


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The sets of two or more nodes of ``graph`` that reach each other (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_circle(graph: Mapping[str, set[str]], start: str) -> list[str]:
    """The shortest path ``start → … → start`` in ``graph`` (breadth first), as its nodes (``start`` at both ends)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for other in sorted(graph.get(node, ())):
            if other == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if other not in came_from:
                came_from[other] = node
                queue.append(other)
    return []


def circles_message(graph: Mapping[str, set[str]], where: Mapping[tuple[str, str], str]) -> str:
    """Every circle of ``graph`` (a set of modules that import each other), each as one path ``a → b → … → a`` with
    the line of each import, and the other modules of its set; empty when there is none."""
    lines = []
    for members in strongly_connected(graph):
        path = shortest_circle(graph, members[0])
        steps = " → ".join(f"{_short(b)} ({where[a, b]})" for a, b in itertools.pairwise(path))
        rest = ", ".join(map(_short, sorted(set(members) - set(path))))
        lines.append(f"  {_short(path[0])} → {steps}" + (f"\n    and, in the same circle: {rest}" if rest else ""))
    return "\n".join(lines)


def _short(module: str) -> str:
    return module.removeprefix(f"{PACKAGE}.")


def test_no_import_circle() -> None:
    graph, where = module_graph()
    message = circles_message(graph, where)
    assert not message, (
        "These modules import each other (imports in function bodies count; move what both need to the lower one):\n"
        + message
    )


def test_pure_pytorch_rooms_import_no_lightning() -> None:
    modules, imports = package_imports()
    found = []
    for start in (m for m in modules if room(m) in PURE_PYTORCH):
        seen, queue = {start: [start]}, deque([start])
        while queue:
            name = queue.popleft()
            for i in imports[name]:
                if i.module in LIGHTNING:
                    chain = " → ".join(map(_short, seen[name]))
                    found.append(f"  {chain} imports {i.module} ({i.where(modules)})")
                elif i.module in modules and i.module not in seen:
                    seen[i.module] = [*seen[name], i.module]
                    queue.append(i.module)
    assert not found, (
        f"{', '.join(f'{r}/' for r in PURE_PYTORCH)} are pure PyTorch: nothing they import, directly or through"
        " another module (compat/lightning.py imports Lightning), may import Lightning:\n"
        + "\n".join(sorted(set(found)))
    )


def test_imports_go_down_the_layers() -> None:
    modules, imports = package_imports()
    layer = {r: depth for depth, rooms in enumerate(LAYERS) for r in rooms}
    upward = [
        f"  {room(i.importer)} imports {room(i.module)}: {_short(i.importer)} → {_short(i.module)} ({i.where(modules)})"
        for found in imports.values()
        for i in found
        if i.module in modules and layer[room(i.module)] < layer[room(i.importer)]
    ]
    order = " > ".join(" = ".join(rooms) for rooms in LAYERS)
    assert not upward, f"Imports go downwards only ({order}); these go up:\n" + "\n".join(upward)


def test_every_room_of_the_package_has_a_layer() -> None:
    modules, _ = package_imports()
    placed = {r for rooms in LAYERS for r in rooms}
    assert {room(m) for m in modules} == placed, "name each folder and top-level module of the package in LAYERS"


def test_the_check_reads_lazy_relative_and_type_checking_imports() -> None:
    source = """
from typing import TYPE_CHECKING
from . import sibling
from ..other import thing
if TYPE_CHECKING:
    from lightning_dist.hidden import Type
else:
    import shown
def f():
    import lightning.pytorch
"""
    statements = {
        (base, names) for base, names, _ in import_statements(ast.parse(source), "lightning_dist.pkg.mod", False)
    }
    assert ("lightning_dist.pkg", ("sibling",)) in statements and ("lightning_dist.other", ("thing",)) in statements
    assert {("shown", ()), ("lightning.pytorch", ())} <= statements
    assert not any("hidden" in base for base, _ in statements)


def test_the_circle_message_shows_each_circle_as_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "x": {"y"}, "y": {"x"}}
    where = {(a, b): f"{a}.py:1" for a, targets in graph.items() for b in targets}
    message = circles_message(graph, where)
    assert "a → b (a.py:1) → c (b.py:1) → a (c.py:1)" in message
    assert "x → y (x.py:1) → x (y.py:1)" in message
    assert circles_message({"a": {"b"}, "b": set()}, {("a", "b"): ""}) == ""


def strategies_room(module: str) -> str | None:
    """The room of a module inside ``strategies/``: ``lifecycle``, ``parallelisms.<name>`` or ``presets`` (the top:
    base.py, the presets, the registry); ``None`` outside ``strategies/``."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "strategies"]:
        return None
    if len(parts) > 2 and parts[2] == "lifecycle":
        return "lifecycle"
    if len(parts) > 3 and parts[2] == "parallelisms":
        return f"parallelisms.{parts[3]}"
    return "parallelisms" if len(parts) > 2 and parts[2] == "parallelisms" else "presets"


def test_the_rooms_of_strategies_import_only_down() -> None:
    # docs/architecture.md, "The rooms of strategies/": lifecycle/ imports no parallelism and no preset; a parallelism
    # imports the lifecycle and parallel/, never a preset or another parallelism; base.py (the shared base, built from
    # the lifecycle's mixins) imports no parallelism.
    modules, imports = package_imports()
    wrong = []
    for importer, found in imports.items():
        source = strategies_room(importer)
        for i in found:
            target = strategies_room(i.module)
            if source is None or target is None or target in (source, "parallelisms"):
                continue
            up = target == "presets" and source != "presets"
            sideways = source.startswith("parallelisms.") and target.startswith("parallelisms.")
            into_parallelism = target.startswith("parallelisms.") and (
                source == "lifecycle" or importer == f"{PACKAGE}.strategies.base"
            )
            if up or sideways or into_parallelism:
                wrong.append(
                    f"  {_short(importer)} ({source}) imports {_short(i.module)} ({target}): {i.where(modules)}"
                )
    assert not wrong, "strategies/ rooms import only down (presets > parallelisms > lifecycle):\n" + "\n".join(wrong)


def test_the_drawing_in_the_architecture_doc_lists_the_layers_in_order() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawing = text.split("```text\n", 1)[1].split("```", 1)[0]
    rows = [line.split("│")[0].strip() for line in drawing.splitlines() if "│" in line]
    drawn = [tuple(name.strip().removesuffix("/").removesuffix(".py") for name in row.split(",")) for row in rows]
    assert drawn == [tuple(r if r != PACKAGE_ROOM else "__init__" for r in rooms) for rooms in LAYERS], drawn
