"""The processes of a lightning_dist strategy (a mixin of the shared base): devices, the launcher (with the checks
before launch), the process group and the mesh built on it, and teardown."""

from __future__ import annotations

import atexit
import functools
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_dist.compat.lightning import default_process_group_backend, init_process_group, set_device_mesh
from lightning_dist.compat.torch import flatten_mesh
from lightning_dist.parallel.runtime.process_group_exit import destroy_process_groups
from lightning_dist.parallel.runtime.random_state import share_random_state
from lightning_dist.strategies.lifecycle.failure_handling import (
    explain_exception,
    restart_store_kwargs,
    start_watchdog,
    stop_watchdogs,
)
from lightning_dist.strategies.lifecycle.finetuning_callbacks import restore_lightning_comparison
from lightning_dist.strategies.lifecycle.preflight import PreflightLauncher, PreflightSubprocessLauncher

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class ProcessSetup(_Base):
    """Processes, devices and the mesh of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks that differ only in pp, cp or tp get the same samples: replicas are the ``batch`` group."""
        dims = self.parallel_dims
        return {"num_replicas": dims.batch, "rank": dims.batch_rank(self.global_rank)}

    #: Set by a rehearsal of the launch (the dry run) that checks, as the launching process would, in a process
    #: that looks like a rank torchrun started.
    rehearses_launch: bool = False

    @property
    def reads_data_before_launch(self) -> bool:
        """Whether this process reads the entry point's first batch for the checks before launch: the one that
        launches the others does (ranks that torchrun or SLURM created check their first batch after launch,
        together, so that no rank refuses alone), and so does a rehearsal of the launch."""
        return self.rehearses_launch or not self.cluster_environment.creates_processes_externally

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            self._launcher = PreflightLauncher(self)
        else:
            self._launcher = PreflightSubprocessLauncher(
                self, self.cluster_environment, self.num_processes, self.num_nodes
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.num_processes and self.mesh_is_known():
            # The Trainer calls this while it is being constructed: a mesh that cannot fit fails here, before any
            # process is launched, instead of in every launched process.
            self._dims = None
            _ = self.parallel_dims

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.start_processes()
        assert self.lightning_module is not None
        if is_overridden("configure_model", self.lightning_module, pl.LightningModule):
            name_lightning_mesh_dims(self._mesh.world)  # a configure_model written for ModelParallelStrategy
        set_device_mesh(self.lightning_module, self._mesh.world)

    def start_processes(self) -> None:
        """The process group (gloo on CPU, NCCL on CUDA), the shared random state, the failure watchdog and the mesh;
        the Trainer's set-up and a Fabric strategy (:mod:`lightning_dist.fabric`) both call it."""
        self.set_world_ranks()  # also validates the mesh sizes, before any process group exists
        self._process_group_backend = self._process_group_backend or default_process_group_backend(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        init_process_group(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=device_id,
            **restart_store_kwargs(self.cluster_environment, self._timeout),
        )
        _destroy_process_groups_at_exit()
        # Not Lightning's `reset_seed()`, which rewinds each rank to where the user seeded: rank 0's random state is
        # one process's when it starts training (see parallel/runtime/random_state.py)
        share_random_state(self.root_device)
        self._watchdog = start_watchdog(self)
        self.agree_on_mesh()
        dims = self.parallel_dims
        if self._mesh is None:  # fit → test on one Trainer reuses the mesh (and its process groups)
            self._mesh = dims.build_mesh(self.root_device.type)
            self.log_decision(f"mesh {dims} over {self.world_size} processes ({self._process_group_backend})")

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self._close_train_context()
        self.finish_watchdog()
        restore_lightning_comparison()
        try:
            self.checkpoint_io.teardown()  # first: a save still in flight is awaited, and its failure raised
        finally:
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()

    def finish_watchdog(self) -> None:
        """A normal end: stop watching for failed ranks; rank 0 keeps the store until every rank has finished."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog.finish()
            self._watchdog = None

    @override
    def on_exception(self, exception: BaseException) -> None:
        explain_exception(self, exception)
        super().on_exception(exception)


@functools.cache
def _destroy_process_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits (registered once per process).

    Groups still alive when the process exits have their worker threads running through the C++ teardown, which
    can abort a finished run in a rank whose peers exit first ("terminate called without an active exception": a
    non-zero exit code that schedulers read as a failed job). Teardown keeps them alive on purpose: ``fit`` then
    ``test`` on one Trainer reuses the mesh. Background checkpoint writers are joined in ``teardown`` before this runs.
    """

    def release() -> None:
        stop_watchdogs()
        destroy_process_groups()

    atexit.register(release)


#: The dimension names of Lightning's ``ModelParallelStrategy`` mesh, as our axes: a ``configure_model`` written for
#: it indexes ``self.device_mesh["data_parallel"]`` and ``["tensor_parallel"]``.
LIGHTNING_MESH_DIMS = {"data_parallel": ("dp_replicate", "dp_shard"), "tensor_parallel": ("tp",)}


def name_lightning_mesh_dims(world: Any) -> None:
    """Let ``world`` (the mesh the LightningModule sees) answer to Lightning's dimension names too (flattening the
    same dims under a name again returns the mesh made the first time)."""
    for name, axes in LIGHTNING_MESH_DIMS.items():
        flatten_mesh(world[axes], name)
