"""Lightning's fit-loop counters in a checkpoint, made to say where training really is.

Lightning 2.6 resumes a mid-epoch checkpoint written from ``on_train_batch_end`` (a ``ModelCheckpoint`` every n
steps) correctly. It does not resume correctly from a checkpoint written once its fit loop has counted the epoch as
processed: at train-epoch end, at the end of epoch-end validation, or by ``trainer.save_checkpoint`` after ``fit``
returned. Observed with a shuffling sampler, 2 ranks, 4 batches per epoch:

- after ``fit`` stopped at ``max_steps`` mid-epoch (3 of 4 batches), the loop had already advanced its epoch counter
  to 1 and resumed epoch 1 at its 4th batch; batches 0-2 of epoch 1 were never trained on;
- after a whole epoch (at train-epoch end, validation end, ``max_steps`` or ``max_epochs`` at the epoch boundary),
  it ran the next epoch with zero batches and went on with the one after: a whole epoch of data was skipped.

``settle_fit_loop`` rewrites those counters, in a checkpoint's ``loops`` entry, into the state a mid-epoch
``on_train_batch_end`` save (epoch cut short) or a fresh epoch start (epoch finished) would have, which Lightning
resumes correctly, and returns the true position: the epoch the next batch belongs to and the batches already trained
in it. Counters that are already right are left as they are, so settling twice changes nothing.
"""

from __future__ import annotations

from typing import Any

_COUNTERS = ("ready", "started", "processed", "completed")


def settle_fit_loop(loops: dict[str, Any] | None, batches_per_epoch: float | None = None) -> tuple[int, int] | None:
    """Make ``loops["fit_loop"]`` (a checkpoint's Lightning loop state) resume where training stopped, in place.

    Args:
        loops: The checkpoint's ``loops`` entry.
        batches_per_epoch: Training batches per epoch when known (at save time); the saved ``is_last_batch`` flag
            tells otherwise.

    Returns:
        ``(epoch, batches)``: the epoch the next training batch belongs to and how many of its batches were trained;
        ``None`` where the entry holds no fit-loop progress.
    """
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    if not isinstance(fit_loop, dict):
        return None
    epochs, batches = fit_loop.get("epoch_progress"), fit_loop.get("epoch_loop.batch_progress")
    if not all(_is_progress(p) for p in (epochs, batches)):
        return None  # not what Lightning 2.x saves: left to Lightning
    ready, processed = epochs["current"]["ready"], epochs["current"]["processed"]
    done = batches["current"]["processed"]
    last = bool(batches.get("is_last_batch")) or (batches_per_epoch is not None and done >= batches_per_epoch)
    if ready == 0 or processed < ready:  # before the first epoch, or mid-epoch: Lightning resumes these right
        return (processed + 1, 0) if last and ready > 0 else (processed, done)
    # The loop counted the epoch `processed - 1` as processed (its end hooks ran, or fit returned).
    finished = done == 0 or last
    if finished:  # the next epoch starts at its first batch, with its start hooks
        for counters in (epochs["current"], epochs["total"]):
            counters["completed"] = counters["processed"]
        _zero_current(batches)
        batches["is_last_batch"] = False
        for key in ("epoch_loop.scheduler_progress", "epoch_loop.automatic_optimization.optim_progress",
                    "epoch_loop.manual_optimization.optim_step_progress"):  # fmt: skip
            _zero_current(fit_loop.get(key))
        validation = fit_loop.get("epoch_loop.val_loop.batch_progress")
        if isinstance(validation, dict):  # as Lightning does when an epoch starts
            validation["total"] = dict.fromkeys(validation.get("total", _COUNTERS), 0)
            _zero_current(validation)
            validation["is_last_batch"] = False
        return processed, 0
    # Cut short (max_steps, a stop request): the epoch is still in progress, `done` of its batches trained.
    for counters in (epochs["current"], epochs["total"]):
        counters["processed"] = counters["completed"] = counters["ready"] - 1
    return processed - 1, done


def _zero_current(progress: Any) -> None:
    """Zero every ``current`` counter group in a (nested) progress state."""
    if not isinstance(progress, dict):
        return
    for key, value in progress.items():
        if key == "current" and isinstance(value, dict):
            progress[key] = dict.fromkeys(value, 0)
        else:
            _zero_current(value)


def _is_progress(progress: Any) -> bool:
    """Whether ``progress`` is a Lightning progress state: ``total`` and ``current`` counter groups of ints."""
    return isinstance(progress, dict) and all(
        isinstance(progress.get(group), dict)
        and all(
            isinstance(progress[group].get(c), int) and not isinstance(progress[group].get(c), bool) for c in _COUNTERS
        )
        for group in ("total", "current")
    )
