"""Tools of the ``lightning-dist`` console script besides the LightningCLI subcommands.

Each tool is a module here with a ``main(argv: list[str]) -> None``; add it to :data:`TOOLS` to expose it as
``lightning-dist <name> ...``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lightning_dist.checkpoint.layout import CheckpointError

#: name -> (module under lightning_dist.commands, one-line description)
TOOLS: dict[str, tuple[str, str]] = {
    "consolidate": ("consolidate", "merge a sharded checkpoint into one file"),
    "inspect": ("inspect_checkpoint", "summarize a checkpoint"),
    "plan": ("plan", "print the tensor-parallel plan (as YAML) or the pipeline stage split of a model"),
    "verify": ("verify", "check that a configuration trains under its strategy as it does in one process"),
}


def run_tool(name: str, argv: list[str]) -> None:
    """Run the tool ``name`` with its own arguments."""
    module_name, _ = TOOLS[name]
    try:
        importlib.import_module(f"lightning_dist.commands.{module_name}").main(argv)
    except CheckpointError as err:
        print(f"lightning-dist {name}: error: {err}", file=sys.stderr)
        sys.exit(2)


def add_trust_code_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-code``: Lightning's ``weights_only=False`` for a tool that reads a checkpoint."""
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="unpickle the checkpoint's files in full (weights_only=False), which can run code stored in them; only"
        " for checkpoints from a source you trust. By default nothing but tensors and plain data is unpickled",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--model`` and ``--init-args``: the model a ``plan`` tool reads."""
    parser.add_argument("--config", help="a lightning-dist/LightningCLI YAML: model and strategy options from it")
    parser.add_argument("--model", help="class path of the model (LightningModule or nn.Module)")
    parser.add_argument("--init-args", default="{}", help="JSON object of the model's constructor arguments")
