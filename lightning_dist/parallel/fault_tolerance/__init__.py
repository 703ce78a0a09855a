"""Fault tolerance across replica groups with torchft (pure PyTorch + torchft, no Lightning): each group is a job of
its own; a lighthouse keeps the quorum of live groups; gradients are averaged over the live groups at each step; a
group that (re)starts while others train copies their state over the network. See docs/fault_tolerance.md.

torchft is imported only when a :class:`ReplicaGroups` is built (``pip install 'lightning-dist[ft]'``)."""

from lightning_dist.parallel.fault_tolerance.gradients import allreduce_gradients, local_tensor
from lightning_dist.parallel.fault_tolerance.lighthouse import LighthouseUnreachableError, check_lighthouse
from lightning_dist.parallel.fault_tolerance.options import (
    LIGHTHOUSE_ENV,
    NUM_REPLICA_GROUPS_ENV,
    REPLICA_GROUP_ID_ENV,
    FaultToleranceOptions,
    resolve_fault_tolerance,
)
from lightning_dist.parallel.fault_tolerance.replica_groups import ReplicaGroups
from lightning_dist.parallel.fault_tolerance.state import ReplicaState

__all__ = [
    "LIGHTHOUSE_ENV",
    "NUM_REPLICA_GROUPS_ENV",
    "REPLICA_GROUP_ID_ENV",
    "FaultToleranceOptions",
    "LighthouseUnreachableError",
    "ReplicaGroups",
    "ReplicaState",
    "allreduce_gradients",
    "check_lighthouse",
    "local_tensor",
    "resolve_fault_tolerance",
]
