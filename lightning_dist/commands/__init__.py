"""Tools of the ``lightning-dist`` console script besides the LightningCLI subcommands.

Each tool is a module here with a ``main(argv: list[str]) -> None``; add it to :data:`TOOLS` to expose it as
``lightning-dist <name> ...``.
"""

from __future__ import annotations

import importlib
import sys

from lightning_dist.checkpoint.layout import CheckpointError

#: name -> (module under lightning_dist.commands, one-line description)
TOOLS: dict[str, tuple[str, str]] = {
    "consolidate": ("consolidate", "merge a sharded checkpoint into one file"),
    "inspect": ("inspect_checkpoint", "summarize a checkpoint"),
    "plan": ("plan", "print the tensor-parallel plan (as YAML) or the pipeline stage split of a model"),
}


def run_tool(name: str, argv: list[str]) -> None:
    """Run the tool ``name`` with its own arguments."""
    module_name, _ = TOOLS[name]
    try:
        importlib.import_module(f"lightning_dist.commands.{module_name}").main(argv)
    except CheckpointError as err:
        print(f"lightning-dist {name}: error: {err}", file=sys.stderr)
        sys.exit(2)
