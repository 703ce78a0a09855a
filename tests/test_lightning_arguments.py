"""Lightning ``FSDPStrategy``'s arguments given to ``FSDP2Strategy`` (issue 55): each maps onto the option that does
what Lightning's does, arguments with no meaning under FSDP2 are accepted with a note, the rest refused by name with
the way to say it (``lightning_dist/strategies/lightning_arguments.py``)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from examples.gpt import Block
from lightning_dist import FSDP2Strategy, FullStateCheckpointIO, ZeroPPStrategy


@pytest.mark.parametrize(
    ("given", "sharding", "reshard"),
    [("FULL_SHARD", "full", None), ("SHARD_GRAD_OP", "grad_op", None), ("NO_SHARD", "no_shard", None),
     ("HYBRID_SHARD", "hybrid", None), (ShardingStrategy.HYBRID_SHARD, "hybrid", None),
     (ShardingStrategy._HYBRID_SHARD_ZERO2, "hybrid", False), ("full_shard", "full", None)],
)  # fmt: skip
def test_sharding_strategy_strings_and_enum_map_onto_sharding(given, sharding, reshard):
    strategy = FSDP2Strategy(sharding_strategy=given)
    assert (strategy.sharding, strategy.reshard_after_forward) == (sharding, reshard)


def test_wrap_checkpointing_state_dict_offload_and_mesh_map_onto_our_options():
    strategy = FSDP2Strategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, state_dict_type="sharded")
    assert strategy.wrap_modules == [Block] and strategy.activation_checkpointing == (Block,)
    assert not isinstance(strategy.checkpoint_io, FullStateCheckpointIO)
    strategy = FSDP2Strategy(auto_wrap_policy=ModuleWrapPolicy({Block}), state_dict_type="full",
                             cpu_offload=CPUOffload(offload_params=True), device_mesh=(2, 4))  # fmt: skip
    assert strategy.wrap_modules == [Block] and not strategy.activation_checkpointing
    assert isinstance(strategy.checkpoint_io, FullStateCheckpointIO) and strategy.cpu_offload is True
    assert (strategy.data_parallel_replicate_size, strategy.data_parallel_shard_size) == (2, 4)
    only_checkpointing = FSDP2Strategy(activation_checkpointing_policy={torch.nn.Linear})  # any classes, as Lightning
    assert only_checkpointing.wrap_modules is None and only_checkpointing.activation_checkpointing == (torch.nn.Linear,)
    older_spelling = FSDP2Strategy(activation_checkpointing=Block)  # Lightning's earlier name of the policy
    assert older_spelling.activation_checkpointing == (Block,)
    assert ZeroPPStrategy(auto_wrap_policy={Block}, quantized_weights=False).wrap_modules == [Block]


def test_arguments_without_meaning_are_accepted_with_a_note(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        FSDP2Strategy(limit_all_gathers=True, use_orig_params=True, sync_module_states=True)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fsdp2:")]
    assert len(notes) == 3 and any("use_orig_params=True accepted without effect" in n for n in notes), notes


@pytest.mark.parametrize(
    ("given", "message"),
    [({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=100)},
      r"auto_wrap_policy=.*a size-based or custom callable policy cannot be mapped.*wrap_modules=\[Block\]"),
     ({"mixed_precision": MixedPrecision(param_dtype=torch.int8)}, r"mixed_precision=.*precision='bf16-mixed'"),
     ({"sharding_strategy": "ZERO3"}, r"sharding_strategy='ZERO3' is not one of FSDP's"),
     ({"sharding_strategy": "FULL_SHARD", "sharding": "grad_op"}, r"disagree: give one"),
     ({"state_dict_type": "local"}, r"state_dict_type='local' is not 'full' or 'sharded'"),
     ({"device_mesh": "2x4"}, r"device_mesh='2x4': give it as Lightning's \(replicate, shard\) sizes tuple")],
)  # fmt: skip
def test_what_cannot_be_mapped_is_refused_by_name_with_our_way_to_say_it(given, message):
    with pytest.raises(ValueError, match=message):
        FSDP2Strategy(**given)


def test_a_deepspeed_zeropp_config_sets_zeropps_options(tmp_path, caplog):
    """``ZeroPPStrategy(config=...)``, a dict or a JSON file: the ZeRO++ keys set the options (DeepSpeed's hpZ size 1
    is hpZ off), tuning and Trainer keys are noted, anything else is refused by name. (The bytes it moves:
    tests/test_zeropp_parity.py.)"""
    import json

    config = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 8,
                                    "zero_quantized_gradients": False, "overlap_comm": True},
              "bf16": {"enabled": True}, "gradient_clipping": 1.0}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        for given in (config, str(tmp_path / "ds.json")):
            strategy = ZeroPPStrategy(config=given)
            assert (strategy.quantized_weights, strategy.hpz_partition_size, strategy.quantized_gradients) == (
                True, 8, False)  # fmt: skip
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zeropp: config key")]
    assert any("'bf16' accepted without effect: set by Trainer(precision='bf16-mixed')" in n for n in notes), notes
    assert any("'zero_optimization.overlap_comm' accepted without effect" in n for n in notes), notes
    off = ZeroPPStrategy(config={"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1,
                                                       "offload_optimizer": {"device": "cpu"}}})  # fmt: skip
    assert (off.quantized_weights, off.hpz_partition_size, off.quantized_gradients, off.cpu_offload) == (
        False, None, False, True)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "message"),
    [({"zero_optimization": {"stage": 2}}, r"zero_optimization.stage=2: ZeRO\+\+ is ZeRO stage 3.*sharding='grad_op'"),
     ({"zero_optimization": {"stage": 3, "zero_quantised_weights": True}},
      r"'zero_optimization.zero_quantised_weights' has no meaning for ZeroPPStrategy"),
     ({"zero_optimization": {"stage": 3}, "amp": {"enabled": True}}, r"'amp' has no meaning"),
     ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, r"offload to \['nvme'\]"),
     ("missing.json", r"config='missing.json': not a readable DeepSpeed JSON config")],
)  # fmt: skip
def test_a_deepspeed_config_key_without_meaning_here_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        ZeroPPStrategy(config=config)


def test_mixed_precision_sets_fsdp2s_policy_through_the_precision_plugin():
    """``MixedPrecision(param_dtype=bf16, reduce_dtype=...)`` becomes the plugin that sets FSDP2's
    ``MixedPrecisionPolicy`` (bf16 compute, gradients reduced in the given dtype), which the Trainer keeps, as
    Lightning's FSDPStrategy keeps its own over the precision flag."""
    import lightning as L

    from lightning_dist import ZeroPPPrecision

    for reduce in (torch.float32, torch.bfloat16):
        strategy = FSDP2Strategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        plugin = trainer.strategy.precision_plugin
        assert isinstance(plugin, ZeroPPPrecision) and plugin.precision == "bf16-mixed"
        assert (plugin.mp_policy.param_dtype, plugin.mp_policy.reduce_dtype) == (torch.bfloat16, reduce)
