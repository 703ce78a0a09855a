"""Tools of the ``lightning-dist`` console script besides the LightningCLI subcommands.

Each tool is a module here with a ``main(argv: list[str]) -> None``; add it to :data:`TOOLS` to expose it as
``lightning-dist <name> ...``. Bad input ends a tool with one line, ``lightning-dist <name>: error: ...``, and exit
status 2: a :class:`~.errors.CommandError` or :class:`~lightning_dist.CheckpointError` it raises, or a file it cannot
read or write. A reader that closes the pipe (``lightning-dist inspect CKPT | head``) ends it quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lightning_dist.checkpoint.layout import CheckpointError
from lightning_dist.commands.errors import CommandError

#: name -> (module under lightning_dist.commands, one-line description)
TOOLS: dict[str, tuple[str, str]] = {
    "consolidate": ("consolidate", "merge a sharded checkpoint into one file"),
    "dryrun": ("dryrun", "rehearse a run of any world size on this machine: memory per rank, collectives agree"),
    "export": ("export", "write a checkpoint's model as a Hugging Face or litgpt folder"),
    "inspect": ("inspect_checkpoint", "summarize a checkpoint"),
    "plan": ("plan", "print the tensor-parallel plan (as YAML) or the pipeline stage split of a model"),
    "verify": ("verify", "check that a configuration trains under its strategy as it does in one process"),
}


def run_tool(name: str, argv: list[str]) -> None:
    """Run the tool ``name`` with its own arguments."""
    module_name, _ = TOOLS[name]
    try:
        importlib.import_module(f"lightning_dist.commands.{module_name}").main(argv)
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
    except (CheckpointError, CommandError) as err:
        fail(name, str(err))
    except BrokenPipeError:
        end_on_closed_pipe()
    except OSError as err:  # a file the tool was given that cannot be read or written
        fail(name, f"{err.strerror or err}: {err.filename!r}" if err.filename else str(err))


def fail(tool: str, message: str) -> None:
    """End ``tool`` for bad input: its message on stderr, exit status 2."""
    print(f"lightning-dist {tool}: error: {message}", file=sys.stderr)
    sys.exit(2)


def end_on_closed_pipe() -> None:
    """The reader of stdout went away (``| head``): end quietly, without the interpreter's complaint at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress and no summary; errors still go to stderr."""
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors (no progress, no summary)")


def add_trust_code_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-code``: Lightning's ``weights_only=False`` for a tool that reads a checkpoint."""
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="unpickle the checkpoint's files in full (weights_only=False), which can run code stored in them; only"
        " for checkpoints from a source you trust. By default nothing but tensors and plain data is unpickled",
    )
