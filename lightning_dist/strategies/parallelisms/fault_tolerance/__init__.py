"""Fault tolerance across replica groups (torchft) in a strategy: :class:`FaultToleranceOption`, the
``fault_tolerance`` option of fsdp2 (and zeropp) and hybrid3d, and its :class:`FaultTolerancePart` in each step.

Each replica group is an ordinary Lightning job (its own ``MASTER_ADDR/PORT``, torchrun or SLURM step) whose mesh is
the group's; the replicate axis across groups is torchft's (:mod:`lightning_dist.parallel.fault_tolerance`). What
this module adds on the Lightning side:

- the first step's quorum at setup: a group that starts while others train copies their state (model, optimizers,
  schedulers, Lightning's loop counters and data position) before its dataloaders are read, then joins;
- each step: the quorum before the batch, the gradients averaged over the live groups after the backward, and the
  update applied only if torchft commits the step (see the step protocol's order);
- the sampler: ``num_replicas`` and ``rank`` span every group, so each group reads its own part of the global batch;
- checkpoints written by the first live group only; log lines and metrics (``fault_tolerance/quorum_size``,
  ``fault_tolerance/skipped_steps``, ``fault_tolerance/heals``).
"""

from lightning_dist.strategies.parallelisms.fault_tolerance.option import FaultToleranceOption, FaultToleranceSpec
from lightning_dist.strategies.parallelisms.fault_tolerance.part import FaultTolerancePart

__all__ = ["FaultToleranceOption", "FaultTolerancePart", "FaultToleranceSpec"]
