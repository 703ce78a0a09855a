"""One replica group's side of torchft: its ``Manager`` (the quorum of live groups at each step, the step's commit,
healing from a live group), the gradient all-reduce across groups, and counts of what happened.

A step, in order: :meth:`ReplicaGroups.start_step` before the forward (the quorum, synchronous, so that a group that
must heal copies the live state before it computes anything), the gradients averaged across groups during the
backward (:meth:`ReplicaGroups.reduce_in_backward`, FSDP2) or after it (:meth:`ReplicaGroups.average_gradients`), then :meth:`ReplicaGroups.commit`: the optimizer step is applied only if it returns ``True`` (on every
group that took part, or on none: a failure during the step makes every live group discard it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module

from lightning_dist.compat.torchft import manager_class, reconfigurable_process_group
from lightning_dist.parallel.fault_tolerance.gradients import (
    BackwardReduce,
    allreduce_gradients,
    local_tensor,
    reduce_in_backward,
)
from lightning_dist.parallel.fault_tolerance.lighthouse import LighthouseUnreachableError, unreachable_message
from lightning_dist.parallel.fault_tolerance.options import FaultToleranceOptions
from lightning_dist.parallel.fault_tolerance.state import ReplicaState


class ReplicaGroups:
    """This process's view of the replica groups.

    Args:
        options: The ``fault_tolerance`` option.
        state: What a healing group copies from this one (and receives when this one heals).
        group_rank: This process's rank inside its group's job; ``group_size``: the job's processes.
        backend: ``"gloo"`` or ``"nccl"``, for the process group across groups.
    """

    def __init__(
        self, options: FaultToleranceOptions, state: ReplicaState, group_rank: int, group_size: int, backend: str
    ) -> None:
        self.options = options
        self.state = state
        process_group = reconfigurable_process_group(backend, options.timeout)
        try:
            self.manager = manager_class()(
                pg=process_group,
                load_state_dict=state.load_state_dict,
                state_dict=state.state_dict,
                min_replica_size=options.min_replica_groups,
                use_async_quorum=False,  # heal before the forward, not during it
                timeout=timedelta(seconds=options.timeout),
                quorum_timeout=timedelta(seconds=options.quorum_timeout),
                connect_timeout=timedelta(seconds=options.connect_timeout),
                rank=group_rank,
                world_size=group_size,
                store_addr=os.environ.get("MASTER_ADDR"),
                store_port=int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None,
                lighthouse_addr=options.lighthouse,
                replica_id=options.replica_id,
                init_sync=False,  # every group starts from the same seeded weights; a sync would change them
            )
        except RuntimeError as err:
            raise LighthouseUnreachableError(
                unreachable_message(str(options.lighthouse), options.connect_timeout, err)
            ) from err
        self._step_open = False
        self._backward_reduce: BackwardReduce | None = None
        #: The groups in the current step's quorum, steps skipped (not committed) and committed, in this process.
        self.quorum_size = 0
        self.skipped_steps = 0
        self.committed_steps = 0

    @property
    def step_open(self) -> bool:
        """Whether a step's quorum is formed and its commit not yet decided."""
        return self._step_open

    def start_step(self) -> None:
        """The quorum of this step (once per step; a later call before :meth:`commit` does nothing). A group behind
        the others heals here: it receives the live state before returning."""
        if self._step_open:
            return
        try:
            self.manager.start_quorum()
        except TimeoutError as err:
            raise TimeoutError(
                f"fault_tolerance: no quorum within {self.options.quorum_timeout:g} s from the lighthouse at"
                f" {self.options.lighthouse} (did it stop? min_replica_groups={self.options.min_replica_groups}):"
                f" {err}"
            ) from err
        self._step_open = True
        self.quorum_size = self.manager.num_participants()

    def join(self) -> None:
        """The first step's quorum. At a cold start every group waits (up to ``join_timeout``) until all
        ``num_replica_groups`` are in it, so that they start together; a group that finds others already training
        heals from them and returns at once."""
        deadline = time.monotonic() + self.options.join_timeout
        while True:
            self.start_step()
            if self.quorum_size >= (self.options.num_replica_groups or 1) or self.state.heals or self.step > 0:
                return
            if time.monotonic() >= deadline:
                return
            self._step_open = False  # ask again: the quorum forms with the groups that asked meanwhile
            time.sleep(0.2)

    def check_same_start(self) -> None:
        """At a cold start (step 0, nothing healed), raise unless every group in the quorum starts from the same
        weights: groups do not copy weights at step 0, so groups built from other seeds would never agree. Each rank
        compares a fingerprint of its shards (their sum and sum of squares, in fp64) with the same rank of the other
        groups."""
        if self.state.heals or self.step > 0 or self.quorum_size < 2:
            return
        local = [t.detach().reshape(-1).double() for t in map(local_tensor, self.state.tensors.values())]
        flat = torch.cat(local) if local else torch.zeros(1, dtype=torch.float64)
        mine = torch.stack([flat.sum(), flat.square().sum()]).cpu()
        highest, lowest = mine.clone(), -mine
        for tensor in (highest, lowest):
            self.manager.allreduce(tensor, reduce_op=ReduceOp.MAX).wait()
        if self.manager.errored() is None and not (torch.equal(highest, mine) and torch.equal(-lowest, mine)):
            raise RuntimeError(
                f"fault_tolerance: replica group {self.options.replica_group_id} starts from other weights than the"
                f" other {self.quorum_size - 1} group(s) of the quorum. Replica groups do not copy weights at a cold"
                " start: build the model after the same seed_everything(...) in every group (or load the same"
                " initial_weights or ckpt_path), so that all start equal."
            )

    def average_gradients(self, parameters: Iterable[Tensor]) -> int:
        """Average the gradients over the groups in this step's quorum (starting it if needed); returns the bytes
        all-reduced. A group that died meanwhile makes the commit say no rather than raising here."""
        self.start_step()
        return allreduce_gradients(self.manager, parameters)

    def reduce_in_backward(self, model: Module) -> bool:
        """Average each FSDP2 unit's gradients over the quorum during backward (FSDP2's all-reduce hook), if FSDP2
        units hold every trainable parameter of ``model``; then :meth:`average_gradients` is not needed. Returns
        whether it does."""
        self._backward_reduce = reduce_in_backward(self.manager, model)
        return self._backward_reduce is not None

    @property
    def reduces_in_backward(self) -> bool:
        return self._backward_reduce is not None

    def commit(self) -> bool:
        """Whether this step's optimizer update is applied (every rank of the group gets the same answer)."""
        self.start_step()
        self._step_open = False
        committed = bool(self.manager.should_commit())
        if committed:
            self.committed_steps += 1
        else:
            self.skipped_steps += 1
        return committed

    @property
    def first_live_group(self) -> bool:
        """Whether this group is the first of the current quorum (the one that writes checkpoints)."""
        return self.manager.participating_rank() == 0

    @property
    def step(self) -> int:
        """Committed steps of the replica groups (torchft's step count, restored by healing)."""
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
