"""Rehearse a run of any size on one CPU: every role's real setup and a training step, on fake collectives.

    report = dry_run(["--config", "cfg.yaml"], world_size=1024, num_nodes=128, device_memory=80 * 2**30)
    print(report.table())          # per rank: peak memory by category, collectives issued
    report.agree, report.passed    # do ranks sharing a group issue the same collectives? does each fit?

How it goes:

1. **The mesh and the checks that need no rank** (:func:`checked_configuration`): the configuration is built as
   ``lightning-dist fit`` builds it, for rank 0 of ``world_size``; the strategy resolves its mesh (a size that does
   not fit fails here, as it would at launch; ``mesh="auto"`` is the planner's choice, fixed for every rank) and
   checks the model and the first batch against it (heads or a vocabulary the sizes do not divide, a micro-batch
   split): what every rank would refuse ends the dry run here, in seconds.
2. **The roles** (:mod:`.roles`): each pipeline stage's first rank and, per axis, the last rank on it; plus any rank
   asked for.
3. **Each rank** (:mod:`.rank_run`), in a process of its own (:mod:`.rank_process`: forked from a server that imported
   torch once; as many at a time as there are CPU cores, a pipeline's ranks all at once): torch's ``fake`` process
   group makes the process that rank of the world (:mod:`.fake_world`); the module is built on the meta device;
   ``trainer.fit`` runs the strategy's own setup and one optimizer step on fake tensors (the memory of the steps
   after it) (:mod:`.fake_values`, :mod:`.scope`), recording every collective
   (:class:`~lightning_dist.profiling.CommCounter`) and the live memory of the step
   (:class:`~lightning_dist.profiling.live_memory.LiveMemory`). No weight is read or written.
4. **Agreement** (:mod:`.agreement`): per shared group, the same kinds and sizes in the same order.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_dist.dryrun.agreement import Disagreement, disagreements
from lightning_dist.dryrun.fake_world import fake_rank
from lightning_dist.dryrun.rank_process import run_ranks
from lightning_dist.dryrun.rank_run import Collective, RankRecord, build_trainer, check_before_ranks, quiet
from lightning_dist.dryrun.report import DryRunReport
from lightning_dist.dryrun.roles import chains, choose_ranks
from lightning_dist.parallel.mesh import MESH_AXES, ParallelDims
from lightning_dist.strategies.base import MeshParallelStrategy

__all__ = ["Collective", "Disagreement", "DryRunError", "DryRunReport", "RankRecord", "dry_run", "mesh_of"]


class DryRunError(ValueError):
    """The configuration cannot be dry-run at all (its mesh does not fit the world size, the strategy is not one of
    lightning_dist's)."""


def mesh_of(cli_args: list[str], world_size: int, num_nodes: int = 1) -> ParallelDims:
    """The mesh the configuration's strategy makes of ``world_size`` ranks (once :func:`checked_configuration`'s
    checks pass)."""
    return checked_configuration(cli_args, world_size, num_nodes).dims


@dataclass(frozen=True)
class CheckedConfiguration:
    """The configuration as rank 0 builds it, checked: its mesh, the arguments that fix a planner's mesh
    (``mesh="auto"``) for every rank, and what the planner chose (``None``: the sizes were given)."""

    dims: ParallelDims
    rank_args: list[str]
    planned: str | None = None


def checked_configuration(cli_args: list[str], world_size: int, num_nodes: int = 1) -> CheckedConfiguration:
    """Build the configuration for rank 0 of ``world_size`` and run every check that needs no rank (the mesh against
    the world size, the model against the mesh — heads, vocabulary and blocks the sizes must divide —, the first
    batch against micro-batches and sequence shards): a configuration every rank would refuse ends here, in
    seconds, with :class:`DryRunError`. ``mesh="auto"`` is resolved by the planner, as ``fit`` resolves it."""
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise DryRunError(f"--world-size {world_size} must be a positive multiple of --num-nodes {num_nodes}.")
    with quiet(), fake_rank(0, world_size, world_size // num_nodes):
        try:
            cli = build_trainer(cli_args, world_size, num_nodes)
        except SystemExit as exit_:  # the CLI's own parse errors
            raise DryRunError(f"the configuration cannot be parsed (exit status {exit_.code}).") from None
        except Exception as error:  # noqa: BLE001 (whatever the Trainer refuses is the user's message)
            raise DryRunError(str(error)) from None
        strategy = cli.trainer.strategy
        if not isinstance(strategy, MeshParallelStrategy):
            raise DryRunError(
                f"trainer.strategy is {type(strategy).__name__}: a dry run rehearses lightning_dist's strategies"
                " (fsdp2, zeropp, tensor_parallel, context_parallel, hybrid3d)."
            )
        try:
            planned = not strategy.mesh_is_known()
            strategy.connect(cli.model)  # as fit connects it: mesh="auto" plans for it
            dims = strategy.parallel_dims
            check_before_ranks(strategy, cli.trainer, cli.model, cli.datamodule)
        except Exception as error:  # noqa: BLE001 (each is the message every rank would fail with)
            raise DryRunError(f"{type(error).__name__}: {error}") from None
    if not planned:
        return CheckedConfiguration(dims, [])
    shape = [[getattr(dims, axis) for axis in MESH_AXES], list(MESH_AXES)]
    rank_args = ["--trainer.strategy.init_args.mesh=null", f"--trainer.strategy.init_args.mesh_shape={shape}"]
    if dims.ep > 1:
        rank_args.append(f"--trainer.strategy.init_args.expert_parallel_size={dims.ep}")
    return CheckedConfiguration(dims, rank_args, f"mesh='auto': the planner chose {dims}, as fit would")


def dry_run(
    cli_args: list[str],
    world_size: int,
    num_nodes: int = 1,
    ranks: Iterable[int] = (),
    device_memory: int | None = None,
    all_ranks: bool = False,
    progress: bool = False,
) -> DryRunReport:
    """Dry-run the configuration of ``cli_args`` (``lightning-dist fit``'s arguments) on ``world_size`` ranks.

    Args:
        cli_args: ``--config cfg.yaml`` and any ``--model.*``/``--trainer.*`` overrides.
        world_size: Ranks of the real run (``devices × num_nodes``).
        num_nodes: Nodes of the real run (ranks per node = ``world_size / num_nodes``).
        ranks: Ranks to run besides the default roles.
        device_memory: Bytes each rank may use; a rank whose step peaks above fails the report.
        all_ranks: Run every rank (small worlds: what the truth checks compare with a real run).
        progress: Show the ranks done and the time left on stderr (:mod:`lightning_dist.progress`).
    """
    start = time.perf_counter()
    checked = checked_configuration(cli_args, world_size, num_nodes)
    dims, cli_args = checked.dims, [*cli_args, *checked.rank_args]
    roles = choose_ranks(dims, range(world_size) if all_ranks else ranks)
    # a pipeline's stages wait on each other's shapes: the ranks of one chain run at once, chain after chain
    pipelined = dims.pp > 1
    batches = chains(dims, list(roles)) if pipelined else [list(roles)]
    with tempfile.TemporaryDirectory(prefix="lightning-dist-dryrun-") as mailbox:
        tasks = [[{"cli_args": cli_args, "rank": rank, "role": roles[rank], "world_size": world_size,
                   "num_nodes": num_nodes, "mailbox": mailbox, "peers": batch if pipelined else [],
                   "log": os.path.join(mailbox, f"rank{rank}.log"), "result": os.path.join(mailbox, f"rank{rank}.json")}
                  for rank in batch] for batch in batches]  # fmt: skip
        workers = [len(batch) if pipelined else max(1, min(len(batch), os.cpu_count() or 1)) for batch in batches]
        ranked = run_ranks(tasks, workers, _python_path(), progress)
    ranked.sort(key=lambda record: record.rank)
    return DryRunReport(world_size, num_nodes, str(dims), ranked, disagreements(ranked), device_memory,
                        time.perf_counter() - start, dims, checked.planned)  # fmt: skip


def _python_path() -> str:
    """The caller's import path first (the configuration's ``class_path`` modules may live in the current folder)."""
    return os.pathsep.join([os.getcwd(), *sys.path[1:], os.environ.get("PYTHONPATH", "")])
