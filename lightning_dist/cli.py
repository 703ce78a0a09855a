"""The ``lightning-dist`` console script: the LightningCLI subcommands (:class:`~lightning_dist.lightning_cli.DistCLI`,
with the lightning_dist strategies registered) and the tools.

    lightning-dist fit --config configs/fsdp2.yaml
    lightning-dist validate --config configs/fsdp2.yaml --ckpt_path path/to/checkpoint
    lightning-dist <tool> ...        (the tools in lightning_dist.commands: see ``lightning-dist --help``)

Because the package is imported first, ``trainer.strategy: fsdp2`` (a registered name) works in the YAML as well as
``class_path: lightning_dist.FSDP2Strategy``. Like ``python -m``, the current directory is importable, so
``model.class_path`` can name a module of the project you run it from.
"""

from __future__ import annotations

import sys

import lightning_dist  # noqa: F401  (registers the strategy names)
from lightning_dist.commands import TOOLS, fail, run_tool
from lightning_dist.lightning_cli import CLI_CLASSES, DistCLI, import_from_cwd
from lightning_dist.strategies.lifecycle.preflight import FOUND_BEFORE_LAUNCH


def main(args: list[str] | None = None) -> None:
    """Run a tool (``lightning-dist <tool> ...``) or a LightningCLI subcommand (fit, validate, test, predict).

    A mistake the strategy's checks find before launch (a missing or damaged ``ckpt_path`` among them) ends the
    subcommand with its message (``lightning-dist fit: error: ...``) and exit status 2, without a traceback; what
    fails after launch keeps its traceback.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in TOOLS:
        run_tool(argv[0], argv[1:])
        return
    import_from_cwd()
    try:
        DistCLI(
            **CLI_CLASSES,
            args=args,  # None: LightningCLI reads sys.argv itself (passing both makes it warn)
            parser_kwargs={"epilog": "tools: " + ", ".join(f"{name} ({doc})" for name, (_, doc) in TOOLS.items())},
            save_config_kwargs={"overwrite": True},
        )
    except Exception as error:
        if not getattr(error, FOUND_BEFORE_LAUNCH, False):
            raise
        subcommand = next((a for a in argv if not a.startswith("-")), "")
        fail(subcommand, str(error))


if __name__ == "__main__":
    main()
