"""2 nodes × 2 ranks on one machine: two torchrun launches that meet by c10d rendezvous on loopback train the example
GPT under fsdp2, tensor_parallel_2d (tp inside a node, data parallel across) and zeropp (hpZ inside a node, qgZ
across), and give exactly what one node of 4 processes gives (zeropp declaring ``ranks_per_node=2`` there).

Exactly, bit for bit: losses, final parameters and zeropp's per-step bytes. torchrun runs each worker with one
intra-op thread; the single-node launch is given the same, since a different thread count changes the order of
floating-point sums inside matmuls.
"""

from __future__ import annotations

import pytest
from launch import FULL_MATRIX, run_on_loopback_nodes, run_scenarios

import lightning_dist  # noqa: F401  (registers the strategy names)

SCENARIOS = ["fsdp2", "tp2d", "zeropp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single = run_scenarios(
        "multinode_runs.py", 4, tmp_path_factory.mktemp("one_node"), SCENARIOS, env={"OMP_NUM_THREADS": "1"}
    )
    nodes = run_on_loopback_nodes("multinode_runs.py", 2, 2, tmp_path_factory.mktemp("two_nodes"), SCENARIOS)
    return single, nodes


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): two torchrun launches of 2 ranks each and a 4-rank one (~45 s)",
)
@pytest.mark.parametrize("name", SCENARIOS)
def test_two_loopback_nodes_train_exactly_as_one_node(runs, name):
    single, nodes = runs
    assert (single[name]["num_nodes"], nodes[name]["num_nodes"]) == (1, 2)
    assert nodes[name]["losses"] == single[name]["losses"] and len(single[name]["losses"]) == 3
    assert nodes[name]["params"] == single[name]["params"]


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): two torchrun launches of 2 ranks each and a 4-rank one (~45 s)",
)
def test_zeropp_finds_the_nodes_from_the_environment_and_sends_the_simulated_bytes(runs):
    single, nodes = runs
    assert nodes["zeropp"]["hpz"] == single["zeropp"]["hpz"] == 2  # hpZ over the ranks of one node, not declared
    assert nodes["zeropp"]["bytes"] == single["zeropp"]["bytes"]
    assert nodes["zeropp"]["bytes"]["reduce_scatter"] > 0  # qgZ's hop really crosses the nodes


SLURM_RANK_3_OF_2_NODES = {
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
}


@pytest.mark.parametrize(
    ("strategy", "sampler"),
    [("fsdp2", (4, 3)), ("tensor_parallel_2d", (2, 1)), ("zeropp", (4, 3))],
)
def test_slurm_variables_give_the_ranks_torchrun_would(monkeypatch, strategy, sampler):
    """srun's variables for the second task on the second of 2 nodes × 2: rank 3, node 1, local rank 1; the sampler
    and the mesh follow (tensor_parallel_2d: tp inside the node, so rank 3 is data-parallel replica 1)."""
    import lightning as L
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for key, value in SLURM_RANK_3_OF_2_NODES.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, logger=False)
    ours = trainer.strategy
    assert isinstance(ours.cluster_environment, SLURMEnvironment)
    ours.set_world_ranks()
    assert (ours.global_rank, ours.local_rank, ours.node_rank, ours.world_size) == (3, 1, 1, 4)
    kwargs = ours.distributed_sampler_kwargs
    assert (kwargs["num_replicas"], kwargs["rank"]) == sampler
    if strategy == "zeropp":
        assert ours.resolved_ranks_per_node == 2
