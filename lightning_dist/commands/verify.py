"""``lightning-dist verify``: check, before the expensive run, that a configuration trains under its strategy as it
does in one process. Takes what ``lightning-dist fit`` takes, plus its own options::

    lightning-dist verify --config configs/fsdp2.yaml --model.init_args.n_layer 2
    lightning-dist verify --config configs/hybrid3d.yaml --dtype float64 --steps 3 --json report.json

Exit status: 0 when every compared quantity is within the tolerance, 1 when one is not (or a run failed), 2 when
the check could not start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_dist.verification import VerifyError, strategy_facts
from lightning_dist.verification.run import run_check
from lightning_dist.verification.settings import ONE_PROCESS, VerifySettings

_EPILOG = """Every other argument is `lightning-dist fit`'s: --config files, --model.*, --data.*, --trainer.* and
--seed_everything. Scale the model down with --model.* overrides (fewer layers): the reference trains it in one
process. See docs/verify.md."""


def parser() -> argparse.ArgumentParser:
    """The verify options (the rest of the command line goes to the LightningCLI parser of ``fit``)."""
    p = argparse.ArgumentParser(prog="lightning-dist verify", description=__doc__.split("\n\n")[0], epilog=_EPILOG,
                                allow_abbrev=False)  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="optimizer steps each run trains (default 3)")
    p.add_argument(
        "--tolerance",
        type=float,
        help="largest relative difference accepted (default: 1e-10 in fp64,"
        " 1e-4 in fp32, 2e-2 in mixed precision, or what the strategy states: ZeRO++ quantization)",
    )
    p.add_argument("--dtype", choices=["float64", "float32"], help="run both sides in this dtype (float64: sharper)")
    p.add_argument("--against", default=ONE_PROCESS, help="the reference: one_process (default), ddp, or another"
                   " registered strategy on the same processes")  # fmt: skip
    p.add_argument("--keep-dropout", action="store_true", help="leave dropout on (its draws differ between layouts)")
    p.add_argument("--no-anchor", dest="anchor", action="store_false", help="let the reference train on its own and"
                   " compare whole runs (default: each reference step starts from the strategy's state; see"
                   " docs/verify.md)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--workdir", help="folder for the runs (default: a temporary one, removed when the check passes)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take (default 900)")
    p.add_argument("--reference-cache", metavar="DIR", help="keep reference runs in DIR and reuse them in later checks"
                   " of the same configuration (checking several strategies trains the reference once)")  # fmt: skip
    return p


def _reference_key(cli: Any) -> str:
    """The configuration apart from the strategy's processes (the reference has its own), as text."""
    config = cli.config.clone()
    for key in (
        "trainer.strategy",
        "trainer.devices",
        "trainer.num_nodes",
        "trainer.default_root_dir",
        "trainer.logger",
    ):
        if key in config:
            del config[key]
    return cli.parser.dump(config, skip_check=True)


def main(argv: list[str]) -> None:
    """Run ``lightning-dist verify`` with ``argv``; exits with its status."""
    from lightning_dist.verification.phase import build_from_cli

    args, fit_args = parser().parse_known_args(argv)
    settings = VerifySettings(args.steps, args.tolerance, args.dtype, args.against, args.keep_dropout, args.workdir,
                              timeout=args.timeout, reference_cache=args.reference_cache,
                              anchor=args.anchor)  # fmt: skip
    try:
        # The configuration, built once here: its errors end the check before any run; its module gives the
        # initial weights both runs copy.
        cli = build_from_cli(fit_args, (settings, "candidate", Path(args.workdir or tempfile.gettempdir())))
        seed = cli.config.get("seed_everything")
        if isinstance(seed, int) and not isinstance(seed, bool):
            settings.seed = seed
        trainer = cli.trainer
        strategy = cli.config["trainer"].get("strategy")
        name = strategy if isinstance(strategy, str) else type(trainer.strategy).__name__
        stated, extras = strategy_facts(trainer.strategy)
        report = run_check(
            settings,
            cli.model,
            name,
            str(trainer.precision),
            {"cli_args": fit_args, "main_path": None},
            stated,
            (trainer.num_devices, trainer.num_nodes),
            reference_key=_reference_key(cli),
            reference_extras=extras,
            initial_weights=getattr(trainer.strategy, "initial_weights", None),
        )
    except VerifyError as error:
        print(f"lightning-dist verify: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(report.table())
    if args.workdir or report.workdir:
        print(f"runs and logs: {report.workdir or args.workdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    sys.exit(0 if report.passed else 1)
