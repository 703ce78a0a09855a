"""Scenario scripts do not import each other: what several of them share lives in the shared modules (issue 26).

Read from the syntax tree of every file in tests/scenarios/, without running it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
# The harness and recorders, the pure-PyTorch harness, the shared models, the crafted checkpoint files (also used
# by the security tests) and the modules written with users' habits (user_modules.py).
SHARED = {"common", "pure_torch", "models", "crafted_checkpoints", "user_modules"}


def imported_siblings(path: Path) -> set[str]:
    """The modules of tests/scenarios/ that a file imports, by any spelling (``common``, ``scenarios.models``,
    ``tests.scenarios.x``, a relative import), at module level or inside a function."""
    siblings = {p.stem for p in SCENARIOS.glob("*.py")} - {"__init__"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] if node.level == 0 else [f"{base}.{alias.name}".strip(".") for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in siblings:
                found.add(parts[0])
            elif parts[:2] == ["tests", "scenarios"] and len(parts) > 2:
                found.add(parts[2])
            elif parts[0] == "scenarios" and len(parts) > 1:
                found.add(parts[1])
    return found - {path.stem}


def test_scenario_scripts_import_only_the_shared_modules() -> None:
    crossing = {}
    for path in sorted(SCENARIOS.glob("*.py")):
        others = imported_siblings(path) - SHARED
        if others:
            crossing[path.name] = sorted(others)
    assert not crossing, (
        f"scenario scripts import other scenario scripts: {crossing}; move what they share into "
        f"tests/scenarios/models.py (models) or common.py (harness, recorders)"
    )


def test_the_shared_modules_import_no_scenario_script() -> None:
    for name in sorted(SHARED):
        others = imported_siblings(SCENARIOS / f"{name}.py") - SHARED
        assert not others, f"tests/scenarios/{name}.py imports scenario scripts {sorted(others)}"
