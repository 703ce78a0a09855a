"""Options are type-checked where they are given: a mistyped or contradictory option fails (or warns) at
construction, from Python and from YAML, instead of silently meaning something else."""

from __future__ import annotations

import re

import lightning as L
import pytest
from jsonargparse import ArgumentParser

from lightning_dist import FSDP2Strategy, TensorParallelStrategy, ZeroPPStrategy
from lightning_dist.parallel.tensor_parallel import TensorParallelPlanError

BOOL_OPTIONS = [
    (FSDP2Strategy, "cpu_offload"),
    (TensorParallelStrategy, "sequence_parallel"),
    (TensorParallelStrategy, "loss_parallel"),
    (ZeroPPStrategy, "quantized_weights"),
    (ZeroPPStrategy, "quantized_gradients"),
]


@pytest.mark.parametrize(("cls", "option"), BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["no", "False", 1, 0, None])
def test_bool_options_refuse_anything_but_a_bool(cls, option, value):
    with pytest.raises(TypeError, match=f"{option}={value!r} must be True or False"):
        cls(**{option: value})


@pytest.mark.parametrize(("cls", "option"), BOOL_OPTIONS)
def test_bool_options_from_yaml(cls, option):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "strategy")
    parsed = parser.parse_string(f"strategy:\n  {option}: false\n")
    assert getattr(parser.instantiate_classes(parsed).strategy, option) is False
    with pytest.raises(Exception, match=f"strategy.{option}"):
        parser.parse_string(f"strategy:\n  {option}: 1\n")


def test_a_wrap_regex_that_does_not_compile_fails_at_construction():
    with pytest.raises(ValueError, match=r"wrap_regex=.blocks.\(. is not a valid regular expression: missing \)"):
        FSDP2Strategy(wrap_regex="blocks.(")
    with pytest.raises(ValueError, match=r"wrap_regex='\['"):
        ZeroPPStrategy(wrap_regex="[")


def test_a_bad_plan_layout_fails_at_construction_naming_the_entry():
    with pytest.raises(TensorParallelPlanError, match=r"plan\['blocks\.\*\.mlp\.up'\]: Unknown layout 'shard\(x\)'"):
        TensorParallelStrategy(plan={"blocks.*.mlp.up": {"style": "colwise", "output_layouts": "shard(x)"}})


def test_full_sharding_that_shards_nothing_warns_which_size_to_change():
    with pytest.warns(UserWarning, match="data_parallel_replicate_size=2 leaves one rank per sharding group"):
        L.Trainer(strategy=FSDP2Strategy(data_parallel_replicate_size=2), accelerator="cpu", devices=2, logger=False)


@pytest.mark.parametrize("cls", [FSDP2Strategy, TensorParallelStrategy, ZeroPPStrategy])
def test_lightning_arguments_forwarded_to_the_base_are_options_in_yaml(cls):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "strategy")
    parsed = parser.parse_string("strategy:\n  process_group_backend: gloo\n")
    assert parser.instantiate_classes(parsed).strategy.process_group_backend == "gloo"
    with pytest.raises(Exception, match="process_group_backnd"):  # a misspelt option is refused, not swallowed
        parser.parse_string("strategy:\n  process_group_backnd: gloo\n")


def test_zeropp_refuses_the_fsdp2_options_it_sets_itself():
    with pytest.raises(TypeError, match="reshard_after_forward"):
        ZeroPPStrategy(reshard_after_forward=2)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ZeroPPStrategy, "strategy")
    with pytest.raises(Exception, match="reshard_after_forward"):
        parser.parse_string("strategy:\n  reshard_after_forward: 2\n")


@pytest.mark.parametrize("cls", [FSDP2Strategy, TensorParallelStrategy, ZeroPPStrategy])
def test_activation_checkpointing_takes_a_bool_an_every_kth_int_selective_or_classes(cls):
    from examples.gpt import MLP

    for value, kept in [(True, True), (False, False), (1, True), (3, 3), ("selective", "selective"),
                        ([MLP, "Block"], (MLP, "Block"))]:  # fmt: skip
        assert cls(activation_checkpointing=value).activation_checkpointing == kept
    for value in ["no", "False", 0, -2, None, [1]]:
        with pytest.raises(TypeError, match=re.escape(f"activation_checkpointing={value!r} must be True or False")):
            cls(activation_checkpointing=value)
