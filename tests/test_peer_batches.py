"""Tensor, context and pipeline peers read the same batch (scenarios in ``tests/scenarios/peer_batch_runs.py``)."""

from __future__ import annotations

import torch
from launch import run_scenarios

from lightning_dist.parallel.batch_fingerprint import batch_fingerprint

SCRIPT = "peer_batch_runs.py"


def test_a_loader_that_splits_data_over_peers_is_refused_at_the_first_batch(tmp_path):
    """An IterableDataset sharded by torch.distributed.get_rank()/get_world_size(). Before: tensor_parallel,
    pipeline and context_parallel trained on it without a word, each peer on other samples (tp summed partial
    results of different inputs, the pipeline's last stage scored one batch's outputs against another's labels).
    Now every rank stops at the first batch, naming the ranks and the fix; under fsdp2, where every rank is a
    data-parallel rank, the same loader trains."""
    names = ["rank_stream_tensor_parallel", "rank_stream_pipeline", "rank_stream_context_parallel", "rank_stream_fsdp2"]
    runs = run_scenarios(SCRIPT, 2, tmp_path, names)
    assert runs["rank_stream_fsdp2"] == {"error": None, "steps": 3}
    for name, mesh in (("tensor_parallel", "tp=2"), ("pipeline", "pp=2"), ("context_parallel", "cp=2")):
        run = runs[f"rank_stream_{name}"]
        assert run["steps"] == 0, name
        assert run["error"].startswith("Ranks 0 and 1 read different batches in their first training step"), name
        assert f"(data-parallel rank 0 of the mesh {mesh})" in run["error"], name
        assert "trainer.strategy.distributed_sampler_kwargs" in run["error"], name


def test_seeded_workers_draw_the_same_random_transforms_on_peers(tmp_path):
    """seed_everything(0, workers=True) with a random augmentation drawn in a dataloader worker, fp64. Lightning seeds
    each worker from the global rank, so tensor-parallel peers augmented differently (and trained on the mismatch);
    workers are now seeded from the data-parallel rank, and the run equals one process's."""
    run = run_scenarios(SCRIPT, 2, tmp_path, ["worker_seeds_tensor_parallel"])["worker_seeds_tensor_parallel"]
    one = run_scenarios(SCRIPT, 1, tmp_path, ["worker_seeds_one_process"])["worker_seeds_one_process"]
    assert len(one["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"])) <= 1e-10


def test_seeded_workers_draw_the_same_random_transforms_on_peers_in_a_fabric_loop(tmp_path):
    """The same under Fabric, whose setup_dataloaders seeds workers from the global rank before the strategy sees the
    loader: tensor-parallel peers read the same batches and the losses equal one process's (fp64)."""
    name = "fabric_worker_seeds_tensor_parallel"
    run = run_scenarios(SCRIPT, 2, tmp_path, [name])[name]
    one = run_scenarios(SCRIPT, 1, tmp_path, ["fabric_worker_seeds_one_process"])["fabric_worker_seeds_one_process"]
    assert run["digests"][0] == run["digests"][1] == one["digests"][0] and len(set(one["digests"][0])) == 3
    assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"])) <= 1e-10


def test_the_batch_fingerprint_tells_batches_apart_and_forgives_float_rounding():
    def same(a: object, b: object) -> bool:
        return batch_fingerprint(a).same_batch(batch_fingerprint(b))

    batch = {"input_ids": torch.arange(6).view(2, 3), "names": ["a", "b"], "scale": 0.5}
    assert same(batch, {"input_ids": torch.arange(6).view(2, 3), "names": ["a", "b"], "scale": 0.5})
    assert not same(batch, {**batch, "input_ids": torch.arange(6).view(3, 2)})
    assert not same(batch, {**batch, "input_ids": torch.arange(6.0).view(2, 3)})
    assert not same(batch, {**batch, "names": ["a", "c"]})
    assert not same(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))
    assert 0 <= batch_fingerprint(batch).exact < 2**63
    image = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert same(image, image * (1 + 1e-7))  # rounded differently (another CPU): the same batch
    assert not same(image, image.flip(-1))  # a random flip on one rank: same sums, another batch
    assert not same(image, torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)))
