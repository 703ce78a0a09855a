"""A save of ``last.ckpt`` stopped at each step of its publishing, then a restart with ``ckpt_path="last"``.

    python tests/scenarios/publish_kill_runs.py --devices 1 --out r.json --workdir DIR --scenarios kill_matrix

One process (fsdp2 on one rank: publishing is rank 0's work whatever the world size, and the restart is checked
before launch, in the launching process). The run checkpoints every 2 of its 6 steps with ``save_last=True``, into
``DIR/ckpts``. Its publishes of ``last.ckpt`` are interrupted at these points (``KILL_POINTS``):

* ``unfinished``: the first save of ``last`` (step 2), before its ``COMPLETE`` marker: no complete ``last`` exists;
* ``before``: the step-4 save, complete, before the previous ``last.ckpt`` is renamed aside;
* ``between``: after that rename, before the new one is renamed into place (no ``last.ckpt`` at all);
* ``after``: both renames done, before the previous version set aside is deleted.

A real ``SIGKILL`` at ``between`` (a child process forked before any training, so that it starts as cold as a new
process) leaves ``DIR/killed``. The same points are also frozen in one uninterrupted run by copying the folder at
that instant (``DIR/state_<point>``): what a process killed there leaves on disk, since nothing else writes it. Each
state is then moved to ``DIR/ckpts`` (the run's own ``dirpath``) and a new Trainer restarts with
``ckpt_path="last"``; a fresh run (``ckpt_path=None``) starts in the ``between`` state too.
"""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_dist
from lightning_dist.checkpoint.layout import read_metadata
from lightning_dist.plugins import checkpoint_io

STEPS = 6
SAVE_EVERY = 2
KILL_POINTS = ("unfinished", "before", "between", "after")


class PublishHooks:
    """Calls ``at(point)`` at each kill point of the publishing of ``last.ckpt`` (see the module docstring)."""

    def __init__(self, at: Any) -> None:
        self.at = at
        self.renames = 0
        self.markers = 0
        self._replace, self._write_marker = os.replace, checkpoint_io.write_marker

    def __enter__(self) -> PublishHooks:  # noqa: PYI034
        os.replace = self._hooked_replace  # type: ignore[assignment]
        checkpoint_io.write_marker = self._hooked_write_marker  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.replace, checkpoint_io.write_marker = self._replace, self._write_marker

    def _hooked_replace(self, src: Any, dst: Any, **kwargs: Any) -> None:
        if not any(Path(p).name.lstrip(".").startswith("last.ckpt") for p in (src, dst)):
            return self._replace(src, dst, **kwargs)
        self.renames += 1  # 1: the step-2 publish; 2 and 3: the step-4 publish (previous aside, new one in place)
        if self.renames == 2:
            self.at("before")
        if self.renames == 3:
            self.at("between")
        self._replace(src, dst, **kwargs)
        if self.renames == 3:
            self.at("after")
        return None

    def _hooked_write_marker(self, folder: Path, records: Any) -> None:
        if folder.name.startswith(".last.ckpt.tmp-"):
            self.markers += 1
            if self.markers == 1:
                self.at("unfinished")
        self._write_marker(folder, records)


def fit(workdir: str, ckpt_path: str | None, max_steps: int = STEPS) -> dict[str, Any]:
    model, data = make_model_and_data(1, train_samples=32, vocab_size=64)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(
        dirpath=f"{workdir}/ckpts", every_n_train_steps=SAVE_EVERY, save_top_k=-1, save_last=True, filename="{step}"
    )
    trainer = L.Trainer(
        **trainer_kwargs(1, strategy=lightning_dist.FSDP2Strategy(), precision="32-true", enable_checkpointing=True),
        max_steps=max_steps,
        callbacks=[recorder, checkpoints],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    said = [str(w.message) for w in caught if "last" in str(w.message) or "lightning_dist" in str(w.message)]
    return {"losses": recorder.losses, "global_step": trainer.global_step, "warnings": said}


def listing(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir())


def killed_between(workdir: str) -> dict[str, Any]:
    """Fork a child that trains and is SIGKILLed between the two renames publishing ``last.ckpt`` at step 4."""
    pid = os.fork()
    if pid == 0:  # the child: dies inside the hook; never returns into the scenario harness
        try:
            with PublishHooks(lambda point: point == "between" and os.kill(os.getpid(), signal.SIGKILL)):
                fit(workdir, None)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    killed = Path(workdir, "killed")
    os.replace(Path(workdir, "ckpts"), killed)
    signal_number = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {"signal": signal_number, "listing": listing(killed)}


def kill_matrix(devices: int, workdir: str) -> dict[str, Any]:
    assert devices == 1, "publishing is rank 0's work: one process is enough"
    result: dict[str, Any] = {"sigkill": killed_between(workdir)}

    def freeze(point: str) -> None:
        shutil.copytree(Path(workdir, "ckpts"), Path(workdir, f"state_{point}"), symlinks=True)

    with PublishHooks(freeze):
        result["reference"] = fit(workdir, None)
    os.replace(Path(workdir, "ckpts"), Path(workdir, "reference"))

    result["fresh_run"] = restart(workdir, Path(workdir, "state_between"), None, copy=True, max_steps=SAVE_EVERY)
    restarts = {point: Path(workdir, f"state_{point}") for point in KILL_POINTS}
    restarts["killed"] = Path(workdir, "killed")
    for name, state in restarts.items():
        result[name] = restart(workdir, state, "last")
    return result


def restart(
    workdir: str, state: Path, ckpt_path: str | None, copy: bool = False, max_steps: int = STEPS
) -> dict[str, Any]:
    """Restart in ``state`` (moved, or copied, to the run's ``dirpath``), then keep the folder as ``after_<name>``."""
    folder = Path(workdir, "ckpts")
    before = listing(state)
    shutil.copytree(state, folder, symlinks=True) if copy else os.replace(state, folder)
    run = fit(workdir, ckpt_path, max_steps)
    run["listing_before"], run["listing_after"] = before, listing(folder)
    last = folder / "last.ckpt"
    run["last_step"] = read_metadata(last)["global_step"] if last.exists() else None
    os.replace(folder, Path(workdir, f"after_{state.name}{'_fresh' if copy else ''}"))
    return run


if __name__ == "__main__":
    run_scenario_script({"kill_matrix": kill_matrix})
