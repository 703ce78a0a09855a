"""The option table of ``docs/options.md``, generated from the code: one row per option, one column per strategy.

Each strategy's options are read as jsonargparse reads them for YAML and ``--help`` (``add_class_arguments``, which
follows ``**kwargs`` into the base class), so a cell says exactly what a user can write: the default, or "—" where
the strategy does not take the option. The meaning is the first sentence of the option's docstring. A second table
lists every registered name with the options its preset sets.

    python tests/option_table.py --write     # rewrite docs/options.md
    python tests/option_table.py             # print it
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

from lightning_dist.strategies.base import MeshParallelStrategy
from lightning_dist.strategies.registry import STRATEGY_NAMES

DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
ABSENT = "—"
HEADER = """# Strategy options

Every option of every strategy, as YAML (`init_args`) and Python keyword arguments take it. A cell holds the
option's default for that strategy, or "—" where the strategy does not take it. Options below the line are the ones
every strategy shares (defined once, in `MeshParallelStrategy.__init__`; the FSDP2 ones apply wherever the mesh has
data-parallel ranks). Generated from the code by `python tests/option_table.py --write`; `tests/test_option_table.py`
fails when this file is out of date. Do not edit by hand.
"""


def strategy_classes() -> dict[str, type]:
    """The primary registered name of each strategy class (the one without presets), in registry order."""
    classes: dict[str, type] = {}
    for name, cls, _, presets in STRATEGY_NAMES:
        if not presets and cls not in classes.values():
            classes[name] = cls
    return classes


def class_options(cls: type) -> dict[str, tuple[Any, str]]:
    """``{option: (default, help)}`` of ``cls`` as jsonargparse builds its YAML group."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "s")
    options = {}
    for action in parser._actions:
        if not action.dest.startswith("s.") or action.dest.endswith(".help"):
            continue
        options[action.dest[2:]] = (action.default, action.help or "")
    return options


def _cell(default: Any) -> str:
    if isinstance(default, str):
        return f'`"{default}"`'
    return f"`{default}`".replace("|", "\\|")


def _meaning(help_text: str) -> str:
    """The first sentence of ``help_text`` (up to a full stop outside brackets), in markdown."""
    text, depth, first = " ".join(help_text.split()), 0, ""
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "." and depth == 0 and text[i + 1 : i + 2] in ("", " ") and not text[:i].endswith(".."):
            first = text[: i + 1]
            break
    first = first or text
    first = re.sub(r":(?:class|func|mod|attr|meth|data):`~?([^`]+)`", lambda m: f"`{m[1].rsplit('.', 1)[-1]}`", first)
    return first.replace("``", "`").replace("|", "\\|")


def render() -> str:
    """The whole of ``docs/options.md``."""
    classes = strategy_classes()
    per_class = {name: class_options(cls) for name, cls in classes.items()}
    shared = list(class_options(MeshParallelStrategy))
    own = [opt for options in per_class.values() for opt in options if opt not in shared]
    rows = [*dict.fromkeys(own), None, *shared]
    lines = [HEADER, f"| Option | {' | '.join(f'`{n}`' for n in classes)} | Meaning |"]
    lines.append("|---" * (len(classes) + 2) + "|")
    for option in rows:
        if option is None:
            lines.append("| **shared** |" + " |" * (len(classes) + 1))
            continue
        cells = [_cell(per_class[n][option][0]) if option in per_class[n] else ABSENT for n in classes]
        meaning = next(_meaning(per_class[n][option][1]) for n in classes if option in per_class[n])
        lines.append(f"| `{option}` | {' | '.join(cells)} | {meaning} |")
    lines += ["", "## Registered names", "", "| Name | Class | Preset options | Description |", "|---|---|---|---|"]
    for name, cls, description, presets in STRATEGY_NAMES:
        preset = ", ".join(f"`{k}={v!r}`" for k, v in presets.items()) or ABSENT
        lines.append(f"| `{name}` | `{cls.__name__}` | {preset} | {description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--write" in sys.argv:
        DOC.write_text(render())
        print(f"wrote {DOC}")
    else:
        print(render(), end="")
