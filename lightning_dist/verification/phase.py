"""One run of a verify check, in processes of its own: the candidate (the user's strategy) or the reference.

Started by :mod:`lightning_dist.verification.run` as ``python -m lightning_dist.verification.phase <workdir> <role>``; with more
than one process, Lightning's launcher starts the other ranks with the same command. What to run is in
``<workdir>/settings.json`` (written once) and ``<workdir>/<role>.json``: either the ``lightning-dist fit``
arguments of the configuration (``cli_args``), or, from the Python API, the pickled objects in
``<workdir>/objects.pkl``.
"""

from __future__ import annotations

import json
import multiprocessing.spawn
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from lightning_dist.compat.hugging_face import restore_output_capture
from lightning_dist.lightning_cli import CLI_CLASSES, DistCLI, import_from_cwd
from lightning_dist.verification.one_process import ONE_PROCESS_STRATEGY, OneProcessStrategy
from lightning_dist.verification.recorder import VerifyRecorder
from lightning_dist.verification.settings import VerifySettings, is_removed_callback, trainer_overrides


def _overrides(settings: VerifySettings, role: str, workdir: Path, trainer: dict[str, Any]) -> dict[str, Any]:
    """Everything verify replaces in a Trainer configured with ``trainer`` (its arguments) for ``role``."""
    validates = trainer.get("limit_val_batches", 1.0) not in (0, 0.0)
    accumulate = trainer.get("accumulate_grad_batches") or 1
    path = workdir / f"{role}.json"  # absent where the configuration is only built (verify's own process)
    role_args = json.loads(path.read_text()) if path.exists() else {}
    return {**trainer_overrides(settings, role, workdir, validates, accumulate), **role_args.get("trainer", {})}


def _one_process_strategy(overrides: dict[str, Any], config: bool) -> dict[str, Any]:
    """``overrides`` with the one-process reference's strategy as a configuration entry (``config``) or an
    instance, in place of its class path (a plain string names a registered strategy)."""
    if overrides.get("strategy") == ONE_PROCESS_STRATEGY:
        entry = Namespace(class_path=ONE_PROCESS_STRATEGY, init_args=Namespace())
        overrides["strategy"] = entry if config else OneProcessStrategy()
    return overrides


class VerifyCLI(DistCLI):
    """``lightning-dist fit``'s parser and classes, with verify's Trainer settings in place of the user's."""

    def __init__(self, *args: Any, verify: tuple[VerifySettings, str, Path], **kwargs: Any) -> None:
        self.verify = verify
        super().__init__(*args, **kwargs)

    @override
    def builds_model_on_meta_device(self) -> bool:
        """Never: verify's runs are small, and both start from the same whole initial state (``initial_weights``
        loaded into it first), which a model on the meta device does not have."""
        return False

    @override
    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        settings, role, workdir = self.verify
        trainer = self.config["trainer"]
        overrides = _one_process_strategy(_overrides(settings, role, workdir, dict(vars(trainer))), config=True)
        for key, value in overrides.items():
            trainer[key] = value
        trainer["callbacks"] = [c for c in (trainer.get("callbacks") or []) if not is_removed_callback(c)]
        logger = Namespace(save_dir=str(workdir / role), name="logs")
        trainer["logger"] = Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=logger)


def build_from_cli(cli_args: list[str], verify: tuple[VerifySettings, str, Path]) -> VerifyCLI:
    """The configuration's model, datamodule and Trainer (verify's settings in place), not yet fitted."""
    # verify passes the configuration's part of its own command line as `args` (Lightning warns that both exist)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    import_from_cwd()
    return VerifyCLI(**CLI_CLASSES, args=cli_args, run=False, save_config_callback=None, verify=verify)


class _MainAliasUnpickler(pickle.Unpickler):
    """Finds classes the caller's ``__main__`` defined in its script, imported here as ``__mp_main__`` (the way
    multiprocessing's spawn start method does)."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class("__mp_main__" if module == "__main__" else module, name)


def load_objects(workdir: Path, main_path: str | None) -> dict[str, Any]:
    """The model, datamodule and Trainer arguments the Python API pickled into ``workdir`` (a file verify wrote
    itself moments before, not a checkpoint)."""
    if main_path:
        original = sys.modules["__main__"]
        multiprocessing.spawn.import_main_path(main_path)  # the script runs as __mp_main__, not as __main__
        sys.modules["__main__"] = original
    with open(workdir / "objects.pkl", "rb") as file:
        objects = _MainAliasUnpickler(file).load()
    restore_output_capture(objects["model"])  # transformers forgets it for a model it did not construct here
    return objects


def run(workdir: Path, role: str) -> None:
    """Train ``role``'s run as configured in ``workdir``, recording it."""
    shared = json.loads((workdir / "settings.json").read_text())
    settings = VerifySettings(**shared["settings"])
    role_args = json.loads((workdir / f"{role}.json").read_text())
    recorder = VerifyRecorder(
        str(workdir),
        role,
        candidate_replicas=role_args.get("candidate_replicas", 0),
        candidate_batches=role_args.get("candidate_batches"),
        candidate_kept=role_args.get("candidate_kept"),
        keep_dropout=settings.keep_dropout,
        save_checkpoint=role == "candidate",
        float8=role_args.get("float8"),
        anchoring=role_args.get("anchoring", ""),
    )
    if shared.get("cli_args") is not None:
        cli = build_from_cli([*shared["cli_args"], f"--seed_everything={settings.seed}"], (settings, role, workdir))
        cli.trainer.callbacks.append(recorder)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        return
    objects = load_objects(workdir, shared.get("main_path"))
    pl.seed_everything(settings.seed, verbose=False)
    kwargs = dict(objects["trainer_kwargs"])
    kwargs.update(_one_process_strategy(_overrides(settings, role, workdir, kwargs), config=False))
    kwargs["callbacks"] = [c for c in kwargs.get("callbacks") or [] if not is_removed_callback(c)] + [recorder]
    kwargs["logger"] = CSVLogger(str(workdir / role), name="logs")
    pl.Trainer(**kwargs).fit(objects["model"], datamodule=objects["datamodule"])


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2])
