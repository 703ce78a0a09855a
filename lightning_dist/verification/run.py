"""A verify check from start to end: the shared initial weights, the strategy's run, the reference's run, the
comparison, the checkpoint round trip and the report.

The two runs are separate launches (:mod:`lightning_dist.verification.phase`) in a work folder of verify's own; this
process only builds the module once (for its initial weights, and at the end to load the strategy's checkpoint
the way one process would).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.verification.causes import likely_causes
from lightning_dist.verification.compare import Row, compare_runs, merge_ranks, tensor_difference
from lightning_dist.verification.data import HOOKS, global_batches
from lightning_dist.verification.recorder import FOLLOW, RECORD, load_records
from lightning_dist.verification.report import VerifyReport
from lightning_dist.verification.settings import ONE_PROCESS, VerifySettings, default_tolerance, reference_strategy
from lightning_dist.verification.tensors import initial_state, start_from_initial_weights

#: A file verify writes first into its work folder; a folder without it that is not empty is not verify's to use.
MARKER = "lightning-dist-verify"
_ENV_OF_A_LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


class VerifyError(RuntimeError):
    """verify cannot run the check it was asked for (an unusable work folder, data it cannot scale)."""


def prepare_workdir(settings: VerifySettings) -> tuple[Path, bool]:
    """verify's work folder, and whether verify created it (then it is removed after a passing check)."""
    if settings.workdir is None:
        return Path(tempfile.mkdtemp(prefix="lightning-dist-verify-")), True
    path = Path(settings.workdir)
    if path.exists() and any(path.iterdir()) and not (path / MARKER).exists():
        raise VerifyError(
            f"--workdir {str(path)!r} is not empty and was not made by verify; verify writes and replaces files in"
            " its work folder. Give a new or empty folder."
        )
    for role in ("candidate", "reference"):  # a previous check's runs: verify's own files
        shutil.rmtree(path / role, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path, False


def run_check(
    settings: VerifySettings,
    module: nn.Module,
    strategy: str,
    precision: str,
    shared: dict[str, Any],
    stated_tolerance: tuple[float, str, tuple[str, ...]] | None = None,
    devices: tuple[Any, int] = (1, 1),
    objects: bytes | None = None,
    reference_key: str = "",
    reference_extras: dict[str, Any] | None = None,
    initial_weights: str | Path | None = None,
) -> VerifyReport:
    """Run the check on ``module`` (a copy this function may change), whose runs are described by ``shared`` (what
    :mod:`~lightning_dist.verification.phase` reads: ``cli_args``, or the Python API's ``main_path`` and its pickled
    ``objects``). ``stated_tolerance`` is the strategy's own (tolerance, why, the quantities it holds for);
    ``reference_key`` names what the reference trains apart from the strategy (for ``settings.reference_cache``);
    ``reference_extras`` go to the reference's run (see :func:`lightning_dist.verification.strategy_facts`);
    ``initial_weights``: the strategy's, loaded into ``module`` here, so that both runs start from them."""
    reference_extras = reference_extras or {}
    start = time.perf_counter()
    workdir, temporary = prepare_workdir(settings)
    (workdir / MARKER).write_text("a lightning-dist verify work folder\n")
    if objects is not None:
        (workdir / "objects.pkl").write_bytes(objects)
    tolerance, reason = _tolerance(settings, precision, stated_tolerance)
    against = "one process" if settings.against == ONE_PROCESS else f"{settings.against} on the same processes"
    report = VerifyReport(strategy, against, tolerance, reason, settings.steps, workdir=str(workdir))
    if hasattr(module, "configure_model"):
        module.configure_model()
    meta = [name for name, value in module.state_dict().items() if isinstance(value, torch.Tensor) and value.is_meta]
    if meta:
        raise VerifyError(
            f"verify needs the module built whole, and {len(meta)} of its tensors are on the meta device (e.g."
            f" {meta[0]!r}): build it without init_module(empty_init=True) for verify (its runs are small), and"
            " keep the strategy's initial_weights: both runs then start from those weights."
        )
    if initial_weights is not None:
        start_from_initial_weights(module, Path(initial_weights))
        report.notes.append(f"both runs started from initial_weights={str(initial_weights)!r}")
    torch.save(initial_state(module), workdir / "initial.pt")
    (workdir / "settings.json").write_text(json.dumps({"settings": vars(settings), **shared}))
    (workdir / "candidate.json").write_text(json.dumps({"anchoring": RECORD} if settings.anchored else {}))
    if settings.anchored:
        report.notes.append(
            "each reference step started from the strategy's parameters and optimizer states of that step (each"
            " step's computation compared, not the rounding the runs accumulate; --no-anchor compares whole runs)"
            + (
                "; the reference cache is not used, since such a reference depends on the strategy's run"
                if settings.reference_cache
                else ""
            )
        )
    elif settings.anchor:
        report.notes.append(f"each run trained on its own: a reference under {settings.against} cannot be anchored")
    ours = _run(workdir, "candidate", settings.timeout, report)
    if ours is not None:
        meta = ours[0]["meta"]
        report.strategy = f"{strategy} ({meta['mesh']})" if meta["mesh"] else strategy
        ref = _reference_run(settings, workdir, ours, devices, reference_key, report, reference_extras)
        if ref is not None:
            compare_into(report, ours, ref, module, workdir, None if settings.tolerance else stated_tolerance)
    report.seconds = time.perf_counter() - start
    if report.passed and temporary:
        shutil.rmtree(workdir, ignore_errors=True)
        report.workdir = ""
    return report


def _reference_run(
    settings: VerifySettings,
    workdir: Path,
    ours: list[dict[str, Any]],
    devices: tuple[Any, int],
    key: str,
    report: VerifyReport,
    extras: dict[str, Any],
) -> list[dict[str, Any]] | None:
    """The reference's records: launched with the strategy's global batch (from the strategy's records ``ours``), or
    reused from the reference cache."""
    ranks = [(r["meta"]["data_parallel_rank"], r["meta"]["loader_batches"]) for r in ours]
    batches = {stage: global_batches([(dp, sizes.get(stage, [])) for dp, sizes in ranks]) for stage in HOOKS}
    role = {
        "trainer": reference_strategy(settings.against, *devices),
        "candidate_replicas": ours[0]["meta"]["replicas"],
        "candidate_batches": batches,
        "candidate_kept": ours[0]["meta"].get("loader_kept", {}),
        **extras,
    }
    if settings.anchored:
        role["anchoring"] = FOLLOW
    (workdir / "reference.json").write_text(json.dumps(role))
    cached = _cached_reference(settings, key, workdir, role)
    if cached:
        report.notes.append(f"the reference run was reused from {cached}")
        return load_records(cached)
    ref = _run(workdir, "reference", settings.timeout, report)
    if ref is not None and settings.reference_cache and key and not settings.anchored:
        _keep_reference(workdir / "reference", settings, key, workdir, role)
    return ref


def compare_into(
    report: VerifyReport,
    ours: list[dict[str, Any]],
    ref: list[dict[str, Any]],
    module: nn.Module,
    workdir: Path,
    stated_tolerance: tuple[float, str, tuple[str, ...]] | None,
) -> None:
    """The report's rows (the checkpoint round trip last), its likely causes and its notes; its failure where the
    reference did not read the strategy's samples before any other difference."""
    report.rows = compare_runs(ours, ref, report.tolerance)
    if stated_tolerance is not None:
        report.notes.append(_limit_to(report.rows, stated_tolerance))
    report.rows.append(_checkpoint_row(module, workdir / "candidate" / "checkpoint", ours))
    report.causes = likely_causes(report.rows, module, ours[0], ref[0])
    first = report.first_difference
    if first is not None and first.quantity == "samples":  # the inputs differ: the outputs say nothing
        report.failure = (
            f"the reference did not read the samples the strategy's ranks read ({first.when}: {first.detail}), so"
            " the runs cannot be compared. verify gives the reference the strategy's global batch through your own"
            " loaders (docs/verify.md, 'What it runs'); data that changes between runs (random per-sample transforms"
            " drawn per rank) or a loader that does not split the data over the data-parallel ranks cannot be."
        )
    zeroed = ours[0]["dropout_zeroed"]
    if zeroed:
        shown = ", ".join(zeroed[:4]) + (", ..." if len(zeroed) > 4 else "")
        report.notes.append(
            f"dropout set to 0 on both sides in {len(zeroed)} places ({shown}); --keep-dropout leaves it on"
        )


def _limit_to(rows: list[Row], stated: tuple[float, str, tuple[str, ...]]) -> str:
    """Rows the strategy's stated tolerance does not cover become informational (compared, not judged)."""
    covered = stated[2]
    always = ("replicas", "gradient replicas", "checkpoint", "learning rate", "samples", "sample replicas")
    skipped = sorted(
        {row.quantity for row in rows if not row.quantity.startswith(covered) and row.quantity not in always}
    )
    for row in rows:
        if row.quantity in skipped:
            row.tolerance, row.detail = float("inf"), "shown, not judged: " + stated[1]
    judged = ", ".join([*covered, "learning rate", "replicas", "checkpoint"])
    return f"{stated[1]}; judged within {stated[0]:.0e}: {judged}; shown only: {', '.join(skipped)}"


def _tolerance(
    settings: VerifySettings, precision: str, stated: tuple[float, str, tuple[str, ...]] | None
) -> tuple[float, str]:
    if settings.tolerance is not None:
        return settings.tolerance, "given"
    precision = settings.precision_override or precision
    by_dtype = default_tolerance(precision)
    if stated is not None and stated[0] > by_dtype:
        return stated[0], stated[1]
    return by_dtype, f"the default for {precision}"


def _run(workdir: Path, role: str, timeout: float, report: VerifyReport) -> list[dict[str, Any]] | None:
    """Launch ``role``'s run; its ranks' records, or ``None`` with ``report.failure`` saying why there are none."""
    env = {k: v for k, v in os.environ.items() if k not in _ENV_OF_A_LAUNCH}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    log = workdir / f"{role}.log"
    command = [sys.executable, "-m", "lightning_dist.verification.phase", str(workdir), role]
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = None
    report.run_seconds[role] = time.perf_counter() - start
    ranks = load_records(workdir / role)
    if code == 0 and ranks:
        return ranks
    what = "the strategy's run" if role == "candidate" else "the reference run"
    if code is None:
        report.failure = f"{what} did not finish in {timeout:.0f} s (log: {log})"
    else:
        report.failure = f"{what} failed: {last_error(log.read_text(errors='replace'))} (log: {log})"
    return None


def _reference_digest(settings: VerifySettings, key: str, workdir: Path, role: dict[str, Any]) -> str:
    """What the reference's run depends on: the module and data (``key``), the initial weights, the settings that
    shape the runs, and its processes and batch."""
    digest = hashlib.sha256(key.encode())
    digest.update(hashlib.sha256((workdir / "initial.pt").read_bytes()).digest())
    shaping = {k: getattr(settings, k) for k in ("steps", "dtype", "against", "keep_dropout", "seed")}
    digest.update(json.dumps([shaping, role], sort_keys=True).encode())
    return digest.hexdigest()[:24]


def _cached_reference(settings: VerifySettings, key: str, workdir: Path, role: dict[str, Any]) -> Path | None:
    if not (settings.reference_cache and key) or settings.anchored:
        return None
    folder = Path(settings.reference_cache) / _reference_digest(settings, key, workdir, role)
    return folder if any(folder.glob("rank*.pt")) else None


def _keep_reference(run: Path, settings: VerifySettings, key: str, workdir: Path, role: dict[str, Any]) -> None:
    assert settings.reference_cache is not None
    cache = Path(settings.reference_cache)
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / _reference_digest(settings, key, workdir, role)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".incoming-"))
    for path in run.glob("rank*.pt"):
        shutil.copy2(path, staging / path.name)
    try:
        os.rename(staging, target)  # whole or not at all; another check may have kept the same run first
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def last_error(log: str) -> str:
    """The last exception line of a run's output (``Type: message``), or its last line."""
    errors = re.findall(r"^(?:[\w.]+(?:Error|Exception|Exit)|[\w.]*Misconfiguration\w*)\b:? ?.*$", log, re.MULTILINE)
    if errors:
        return errors[-1].strip()
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _checkpoint_row(module: nn.Module, path: Path, ours: list[dict[str, Any]]) -> Row:
    """The checkpoint saved under the strategy, loaded into the module in this one process (strictly), against the
    weights the strategy's run ended with: they must be equal."""
    try:
        state = load_full_checkpoint(path)["state_dict"]
        loaded = copy.deepcopy(module)
        dtypes = {v.dtype for v in state.values() if torch.is_floating_point(v)}
        if len(dtypes) == 1:
            loaded.to(dtypes.pop())
        loaded.load_state_dict(state, strict=True)
    except Exception as error:  # noqa: BLE001  (any failure to load is what this row reports)
        return Row("checkpoint", "end", float("inf"), 0.0, [], f"could not load it in one process: {error}")
    params, _ = merge_ranks([r["params"] for r in ours])
    diffs = {n: tensor_difference(p.detach(), params.get(n)) for n, p in loaded.named_parameters()}
    worst = sorted(diffs.items(), key=lambda item: -item[1])[:5]
    return Row("checkpoint", "end", max(diffs.values(), default=0.0), 0.0, worst, "saved, then loaded in one process")
