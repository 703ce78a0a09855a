"""PipelineStrategy: the unchanged example GPT in a real Trainer at pp=2 (1f1b and gpipe) trains, clips, validates
and predicts exactly as one process does (fp64, 1e-10), every rank logging and returning the loss stage's loss; and
bad settings are refused before anything runs."""

from __future__ import annotations

import lightning as L
import pytest
from launch import max_abs_diff, run_scenarios

from lightning_dist import PipelineStrategy
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims

TOL = 1e-10  # fp64: the same operations in another order across two processes
SCHEDULES = ["1f1b", "gpipe"]
REFERENCE = {"1f1b": "reference", "gpipe": "reference", "1f1b_accumulate": "reference_accumulate"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pipeline_strategy")
    reference = run_scenarios("pipeline_strategy_runs.py", 1, workdir, sorted(set(REFERENCE.values())))
    return {**reference, **run_scenarios("pipeline_strategy_runs.py", 2, workdir, list(REFERENCE))}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(REFERENCE))
def test_pp2_matches_one_process(runs, schedule):
    """1f1b and gpipe, and 1f1b with accumulate_grad_batches=2 (gradients summed over two pipeline steps)."""
    reference = runs[REFERENCE[schedule]]
    assert min(reference["grad_norms"]) > 0.05  # every step was clipped (by the norm over both stages)
    ranks = runs[schedule]["per_rank"]
    assert not set(ranks[0]["keys"]) & set(ranks[1]["keys"])  # each rank holds only its stage's parameters
    for rank in ranks:
        assert max_abs_diff(rank["losses"], reference["losses"]) <= TOL  # the step output, on every rank
        assert max_abs_diff(rank["logged"], reference["logged"]) <= TOL  # the logged train_loss, on every rank
        assert rank["param_diff"] <= TOL
        assert abs(rank["val_loss"] - reference["val_loss"]) <= TOL  # validation through the forward-only pass
    # predict: the outputs, in batch order, on the rank of the last stage only
    assert [r["has_predictions"] for r in ranks] == [False, True]
    assert ranks[1]["predictions_equal"]


def _dims(world: int, pp: int | str = "auto", dp: int = 1) -> ParallelDims:
    return ParallelDims.resolve(world, pp=pp, dp_shard=dp)


def test_refuses_a_pipeline_of_one_stage():
    strategy = PipelineStrategy(data_parallel_shard_size=2)
    with pytest.raises(MeshConfigError, match="pipeline_parallel_size=1: pipeline parallelism"):
        strategy.validate_mesh(_dims(2, dp=2))


def test_refuses_an_unknown_schedule():
    with pytest.raises(ValueError, match="not a pipeline schedule"):
        PipelineStrategy(schedule="wavefront")


def test_refuses_a_batch_not_divisible_by_n_microbatches():
    strategy = PipelineStrategy(n_microbatches=3)
    strategy._dims = _dims(2)
    with pytest.raises(ValueError, match="not divisible by n_microbatches=3"):
        strategy.microbatches_for(8)
    assert PipelineStrategy()._dims is None
    strategy = PipelineStrategy()
    strategy._dims = _dims(2)
    assert strategy.microbatches_for(8) == 4  # the default: at least 4·(p − 1), a divisor of the batch


def test_registered_names_preset_the_schedule():
    for name, schedule, per_rank in [
        ("pipeline", "1f1b", 1),
        ("pipeline_gpipe", "gpipe", 1),
        ("pipeline_interleaved", "interleaved_1f1b", 2),
        ("pipeline_zero_bubble", "zbv_zero_bubble", 2),
    ]:
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, PipelineStrategy)
        assert (trainer.strategy.schedule, trainer.strategy.stages_per_rank) == (schedule, per_rank)
