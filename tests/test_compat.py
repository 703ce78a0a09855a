"""Private torch and Lightning APIs live in lightning_dist/compat/ only, so a new release needs one folder changed
(compat/torch.py, compat/lightning.py; compat/hugging_face.py for transformers, compat/peft.py for PEFT).

The check reads the package's syntax tree. Outside ``lightning_dist/compat/`` it fails on
(a) an import of a private module or name of torch, Lightning, lightning_utilities, torchmetrics or transformers,
(b) an attribute chain from one of those modules (or a name imported from them) that reaches a private name
    (``torch._C.x``, ``torch.ops._c10d_functional``),
(c) any ``obj._name`` access (read, write, ``getattr(obj, "_name")``) where ``_name`` is defined nowhere in our own
    package: such a name belongs to a foreign library.
Dunder names are fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_dist
from lightning_dist.compat import PRIVATE_TORCH_NAMES, TESTED_TORCH, torch_minor_version, untested_torch_message
from lightning_dist.compat.hugging_face import PRIVATE_HUGGING_FACE_NAMES
from lightning_dist.compat.lightning import PRIVATE_LIGHTNING_NAMES
from lightning_dist.compat.peft import PRIVATE_PEFT_NAMES

PACKAGE = Path(lightning_dist.__file__).parent
COMPAT = PACKAGE / "compat"
FOREIGN_ROOTS = {
    "torch",
    "lightning",
    "lightning_utilities",
    "lightning_fabric",
    "pytorch_lightning",
    "torchmetrics",
    "transformers",
    "peft",
}
# Private-looking names of the Python standard library that are its public API.
STDLIB_ALLOWED = {
    "_replace": "namedtuple's documented copy-with-changes method",
    "_asdict": "namedtuple's documented dict view",
    "_fields": "namedtuple's documented field names",
    "_make": "namedtuple's documented constructor from an iterable",
    "_exit": "os._exit: documented exit without cleanup (a rank that must not run atexit handlers)",
    "_getframe": "sys._getframe: documented frame access",
}
ATTRIBUTE_BUILTINS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_files() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if COMPAT not in path.parents)


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in PACKAGE.rglob("*.py")}


def _own_private_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every private name our package defines: functions, classes, methods, arguments, assigned names and
    ``self._x``/``cls._x`` attributes (also set through ``setattr``), keyword arguments, names imported from our own modules and ``as`` aliases."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in {"self", "cls"}
            ):
                names.add(node.attr)
            elif (  # setattr(self, "_x", v) / object.__setattr__(self, "_x", v)
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in {"setattr", "object.__setattr__"}
                and len(node.args) == 3
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in {"self", "cls"}
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                names.add(node.args[1].value)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lightning_dist")):
                names.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {name for name in names if _is_private(name)}


def _foreign_aliases(tree: ast.Module) -> set[str]:
    """The names a file binds to torch/Lightning modules or objects (``torch``, ``dist``, ``nn``, ``F``, ``pl``)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FOREIGN_ROOTS:
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN_ROOTS:
            aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def _chain_root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(tree: ast.Module, own: set[str]) -> list[tuple[int, str, str]]:
    """``(line, private name, what)`` for every private torch/Lightning use in ``tree``."""
    aliases = _foreign_aliases(tree)
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in FOREIGN_ROOTS:
                    found += [(node.lineno, part, f"import {alias.name}") for part in parts if _is_private(part)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN_ROOTS:
            for part in node.module.split("."):
                if _is_private(part):
                    found.append((node.lineno, part, f"from {node.module} import ..."))
            for alias in node.names:
                if _is_private(alias.name):
                    found.append((node.lineno, alias.name, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            if _chain_root(node) in aliases:
                found.append((node.lineno, node.attr, f"{ast.unparse(node)} (private attribute of torch/Lightning)"))
            elif node.attr not in own and node.attr not in STDLIB_ALLOWED:
                found.append((node.lineno, node.attr, f".{node.attr} (defined nowhere in lightning_dist)"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_BUILTINS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and node.args[1].value not in own
            and node.args[1].value not in STDLIB_ALLOWED
        ):
            name = node.args[1].value
            found.append((node.lineno, name, f'{node.func.id}(..., "{name}") (defined nowhere in lightning_dist)'))
    return sorted(set(found))


def test_no_private_torch_or_lightning_use_outside_compat():
    trees = _trees()
    own = _own_private_names(trees)
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in _package_files()
        for line, _, what in private_uses(trees[path], own)
    ]
    assert not offenders, (
        f"{len(offenders)} private torch/Lightning uses outside lightning_dist/compat/; move each into a named function"
        " or constant in lightning_dist/compat/torch.py or lightning.py (listed with the version it was checked on):\n"
        + "\n".join(offenders)
    )


def test_the_check_sees_each_kind_of_private_use():
    lines = [
        "import torch",
        "import torch.distributed as dist",
        "from torch import nn",
        "import torch._dynamo",
        "from torch.distributed.fsdp._fully_shard import fully_shard",
        "from lightning.fabric.utilities.distributed import _init_dist_connection",
        "torch._C._current_graph_task_id()",
        "torch.ops._c10d_functional.all_reduce",
        "dist.distributed_c10d._world",
        "nn.Module._call_impl",
        "loop._skip_backward = True",
        "model._orig_mod",
        'getattr(model, "_orig_mod", None)',
        "self._mine = 1",
        "print(self._mine)",
        "point._replace(x=1)",
        "print(model.__class__)",
    ]
    tree = ast.parse("\n".join(lines))
    flagged = {line for line, _, _ in private_uses(tree, _own_private_names({Path("x.py"): tree}))}
    assert flagged == set(range(4, 14)), [lines[line - 1] for line in sorted(flagged)]


def test_every_private_name_in_compat_is_listed_with_the_version_it_was_checked_on():
    listed = {**PRIVATE_TORCH_NAMES, **PRIVATE_LIGHTNING_NAMES, **PRIVATE_HUGGING_FACE_NAMES, **PRIVATE_PEFT_NAMES}
    unlisted = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted(COMPAT.glob("*.py"))
        for line, name, _ in private_uses(ast.parse(path.read_text()), own=set())
        if name not in listed
    ]
    assert not unlisted, "add these to the PRIVATE_*_NAMES table of their compat file:\n" + "\n".join(unlisted)
    assert all(version and purpose for version, purpose in listed.values())


def test_versions_newer_than_the_tested_ones_are_named():
    assert torch_minor_version("2.14.1+cu130") == (2, 14)
    assert untested_torch_message("2.13.0+cpu") is None and untested_torch_message("2.14.1") is None
    newer = f"{max(TESTED_TORCH)[0]}.{max(TESTED_TORCH)[1] + 1}.0"
    message = untested_torch_message(newer)
    assert message is not None and f"torch {newer}" in message and "lightning_dist/compat/" in message
