"""One option set: the FSDP-family options are defined once (the base's ``__init__``) and taken by every strategy
with the same name and meaning; ``reshard_after_forward`` defaults to off under a pipeline; ``data_parallel_size``
is a deprecated alias on ``tensor_parallel``; one ``describe()`` writes the "what parallelize did" lines."""

from __future__ import annotations

import lightning as L
import pytest
from jsonargparse import ArgumentParser
from launch import FULL_MATRIX, max_abs_diff, run_scenarios

from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)
from lightning_dist.parallel.describe import describe
from lightning_dist.parallel.fsdp import FSDPConfig
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims
from lightning_dist.parallel.parallelize import ParallelizeConfig, ParallelizeRecord

STRATEGIES = [
    FSDP2Strategy,
    ZeroPPStrategy,
    TensorParallelStrategy,
    PipelineStrategy,
    ContextParallelStrategy,
    Hybrid3DStrategy,
]
SHARED = {
    "wrap_modules": ["examples.gpt.Block"],
    "wrap_regex": r"blocks\.\d+",
    "activation_checkpointing": True,
    "accumulation_sync": "last",
    "compile": True,
}


@pytest.mark.parametrize("cls", STRATEGIES)
def test_every_strategy_takes_the_shared_options_from_python_and_yaml(cls):
    options = dict(SHARED, **({} if cls is ZeroPPStrategy else {"reshard_after_forward": False}))
    strategy = cls(**options)
    assert strategy.wrap_modules == ["examples.gpt.Block"] and strategy.wrap_regex == r"blocks\.\d+"
    assert strategy.activation_checkpointing is True and strategy.accumulation_sync == "last"
    assert strategy.compile_options == {}
    if cls is not ZeroPPStrategy:  # ZeRO++'s form of it is hpz_partition_size
        assert strategy.reshard_after_forward is False
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "strategy")
    yaml = "strategy:\n" + "".join(f"  {k}: {v!r}\n".replace("'", '"') for k, v in options.items())
    built = parser.instantiate_classes(parser.parse_string(yaml.replace("True", "true").replace("False", "false")))
    assert built.strategy.accumulation_sync == "last" and built.strategy.wrap_regex == r"blocks\.\d+"


@pytest.mark.parametrize("cls", [c for c in STRATEGIES if c is not ZeroPPStrategy])
def test_reshard_after_forward_is_checked_alike_everywhere(cls):
    with pytest.raises(TypeError, match="reshard_after_forward='no' must be True, False, None"):
        cls(reshard_after_forward="no")
    with pytest.raises(ValueError, match="reshard_after_forward=1: an int must be a group size of at least 2"):
        cls(reshard_after_forward=1)
    assert cls(reshard_after_forward=2).reshard_after_forward == 2


def _resolved(strategy, devices):
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False)
    return trainer.strategy.fsdp_reshard_after_forward()


def test_reshard_after_forward_defaults_to_off_under_a_pipeline_and_on_otherwise():
    assert _resolved(PipelineStrategy(data_parallel_shard_size=2), 4) is False
    assert _resolved(Hybrid3DStrategy(pipeline_parallel_size=2, data_parallel_shard_size=2), 4) is False
    assert _resolved(Hybrid3DStrategy(data_parallel_shard_size=2, tensor_parallel_size=2), 4) is True
    assert _resolved(TensorParallelStrategy(tensor_parallel_size=2, data_parallel_shard_size=2), 4) is True
    assert _resolved(ContextParallelStrategy(data_parallel_shard_size=2), 4) is True
    for name, implied in (("fsdp2", True), ("fsdp2_grad_op", False)):  # what sharding implies, as before
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert trainer.strategy.fsdp_config.reshard_after_forward is implied
    # an explicit value is honoured, under a pipeline too
    assert _resolved(PipelineStrategy(data_parallel_shard_size=2, reshard_after_forward=True), 4) is True
    assert _resolved(TensorParallelStrategy(tensor_parallel_size=2, reshard_after_forward=False), 2) is False


def test_an_int_reshard_after_forward_must_divide_the_sharding_group_on_every_strategy():
    with pytest.raises(MeshConfigError, match="reshard_after_forward=4 must be a divisor of the sharding group size 2"):
        L.Trainer(
            strategy=TensorParallelStrategy(
                tensor_parallel_size=2, data_parallel_shard_size=2, reshard_after_forward=4
            ),
            accelerator="cpu",
            devices=4,
        )


def test_accumulation_sync_is_refused_where_the_mesh_cannot_honour_it():
    with pytest.raises(MeshConfigError, match="accumulation_sync='last' cannot be combined with pipeline parallelism"):
        L.Trainer(strategy=PipelineStrategy(accumulation_sync="last"), accelerator="cpu", devices=2)
    with pytest.raises(MeshConfigError, match="'replicas_last'.*this mesh has none"):
        L.Trainer(strategy=ContextParallelStrategy(accumulation_sync="replicas_last"), accelerator="cpu", devices=2)


def test_data_parallel_size_is_lightnings_name_of_data_parallel_shard_size():
    """``ModelParallelStrategy``'s arguments, with its meaning and no warning (a project swaps the class name only);
    ``save_distributed_checkpoint=False`` saves one full-state file, as Lightning's does."""
    import warnings

    from lightning_dist import FullStateCheckpointIO

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=2)
    assert strategy.data_parallel_shard_size == strategy.data_parallel_size == 2
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    assert (trainer.strategy.parallel_dims.dp_shard, trainer.strategy.parallel_dims.tp) == (2, 2)
    both_auto = TensorParallelStrategy(tensor_parallel_size="auto", data_parallel_size="auto")
    with pytest.raises(MeshConfigError, match="tensor_parallel_size and data_parallel_size are both 'auto'"):
        L.Trainer(strategy=both_auto, accelerator="cpu", devices=2)
    with pytest.raises(MeshConfigError, match="data_parallel_size=2 and data_parallel_shard_size=4 name the same axis"):
        TensorParallelStrategy(data_parallel_size=2, data_parallel_shard_size=4)
    assert isinstance(TensorParallelStrategy(save_distributed_checkpoint=False).checkpoint_io, FullStateCheckpointIO)
    assert not isinstance(TensorParallelStrategy().checkpoint_io, FullStateCheckpointIO)


def test_describe_writes_the_same_lines_for_every_strategy():
    config = ParallelizeConfig(fsdp=FSDPConfig(reshard_after_forward=False), activation_checkpointing=True)
    record = ParallelizeRecord(checkpointed="2 × Block", units="2 × Block", outside=["tok_emb", "head"])
    dims = ParallelDims(pp=2, dp_shard=2, cp=2)
    lines = describe(config, record, dims, root="GPT", precision="32-true", per_stage=True, extras=["ring"])
    assert lines == [
        "activation checkpointing on 2 × Block per stage",
        (
            "FSDP2 sharded 2 × Block + [tok_emb, head] as one unit + root GPT over dp_shard=2 × cp=2 (gradients averaged"
            " over cp) per stage, reshard_after_forward=False, precision=32-true"
        ),
        "ring",
    ]
    hsdp = describe(config, record, ParallelDims(dp_replicate=2, dp_shard=2), root="GPT", precision="bf16-mixed")
    assert hsdp[1].startswith("HSDP (dp_replicate=2) sharded 2 × Block")
    no_fsdp = describe(ParallelizeConfig(), ParallelizeRecord(), ParallelDims(tp=2), root="GPT", precision="32-true")
    assert no_fsdp == ["nothing sharded (no data-parallel ranks), precision=32-true"]


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): reshard_after_forward runs under fsdp2 by default",
)
def test_reshard_after_forward_off_under_a_pipeline_gathers_less_and_trains_the_same(tmp_path):
    """pp=2 × dp_shard=2, 4 micro-batches: with resharding each micro-batch gathers the stage's parameters again."""
    runs = run_scenarios("reshard_runs.py", 4, tmp_path, ["on", "default"])
    on, default = runs["on"], runs["default"]
    assert (on["resolved"], default["resolved"]) == (True, False)
    assert max_abs_diff(on["losses"], default["losses"]) < 1e-10
    assert 0 < default["all_gather_bytes_per_step"] < on["all_gather_bytes_per_step"] / 3


def test_a_reused_model_is_checked_against_the_shared_options_too():
    """A second Trainer may reuse a parallelized model only with equal settings: the shared options count."""
    from lightning_dist.strategies.lifecycle.preflight import parallel_settings

    def settings(**options):
        trainer = L.Trainer(strategy=FSDP2Strategy(**options), accelerator="cpu", devices=2, logger=False)
        return parallel_settings(trainer.strategy)

    assert settings(activation_checkpointing=True) != settings()
    assert settings(wrap_regex=r"blocks\.\d+")["wrap_regex"] == repr(r"blocks\.\d+")
    assert settings(accumulation_sync="last")["accumulation_sync"] == "'last'"
