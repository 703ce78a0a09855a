"""ZeroPPStrategy configuration: names, options, precision and every error/warning at Trainer construction."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist import FSDP2Precision, ZeroPPPrecision, ZeroPPStrategy
from lightning_dist.parallel.mesh import MeshConfigError


def _trainer(strategy, devices=4, **kwargs):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)


@pytest.mark.parametrize(
    ("name", "qwz", "hpz", "qgz"),
    [
        ("zeropp", True, 2, True),
        ("zeropp_qwz", True, None, False),
        ("zeropp_hpz", False, 2, False),
        ("zeropp_qgz", False, None, True),
    ],
)
def test_registered_names(name, qwz, hpz, qgz):
    assert StrategyRegistry[name]["strategy"] is ZeroPPStrategy and StrategyRegistry[name]["description"]
    init = dict(StrategyRegistry[name]["init_params"])
    strategy = ZeroPPStrategy(ranks_per_node=2, **init)
    _trainer(strategy)
    assert (strategy.quantized_weights, strategy._hpz, strategy.quantized_gradients) == (qwz, hpz, qgz)
    assert strategy.fsdp_config.reshard_after_forward == (hpz if hpz else True)


def test_precision_flag_becomes_zeropp_precision_and_reduce_dtype_is_selectable():
    plugin = _trainer("zeropp", precision="bf16-mixed").strategy.precision_plugin
    assert isinstance(plugin, ZeroPPPrecision) and plugin.precision == "bf16-mixed"
    assert plugin.mp_policy.param_dtype == torch.bfloat16 and plugin.mp_policy.reduce_dtype == torch.float32
    bf16_both_ways = ZeroPPPrecision("bf16-mixed", reduce_dtype="bf16")
    assert bf16_both_ways.mp_policy.reduce_dtype == torch.bfloat16
    assert bf16_both_ways.root_mp_policy.output_dtype == torch.float32
    explicit = FSDP2Precision("16-mixed")
    assert _trainer("zeropp", plugins=[explicit]).strategy.precision_plugin is explicit
    with pytest.raises(ValueError, match="reduce_dtype='int8'"):
        ZeroPPPrecision("bf16-mixed", reduce_dtype="int8")  # type: ignore[arg-type]


def test_ranks_per_node_defaults_to_devices_and_one_node_warns_that_hpz_and_qgz_save_nothing():
    with pytest.warns(UserWarning, match="hpZ is a no-op") as record:
        strategy = _trainer("zeropp").strategy
    assert any("qgZ's cross-node hop is a no-op" in str(w.message) for w in record)
    assert strategy.resolved_ranks_per_node == 4 and strategy._hpz is None
    assert strategy.fsdp_config.reshard_after_forward is True


def test_two_declared_nodes_need_no_warning(recwarn):
    strategy = _trainer(ZeroPPStrategy(ranks_per_node=2)).strategy
    assert strategy._hpz == 2
    assert not [w for w in recwarn if "no-op" in str(w.message)]


def test_a_secondary_partition_spanning_nodes_warns():
    with pytest.warns(UserWarning, match="hpz_partition_size=4 does not divide ranks_per_node=2"):
        strategy = _trainer(ZeroPPStrategy(ranks_per_node=2, hpz_partition_size=4), devices=8).strategy
    assert strategy._hpz == 4


def test_leftover_modules_become_units_unless_tied():
    from examples.gpt import GPT
    from lightning_dist.parallel.zeropp import leftover_param_modules

    model = GPT(n_layer=2)
    assert [n for n, _ in leftover_param_modules(model, list(model.blocks))] == ["tok_emb", "pos_emb", "ln_f", "head"]
    model.head.weight = model.tok_emb.weight  # tied: both stay with the root
    assert [n for n, _ in leftover_param_modules(model, list(model.blocks))] == ["pos_emb", "ln_f"]
    model.pos_weight = model.pos_emb.weight  # shared with a parameter of the root itself
    assert [n for n, _ in leftover_param_modules(model, list(model.blocks))] == ["ln_f"]


def test_impossible_combinations_fail_at_construction():
    with pytest.raises(ValueError, match="hpZ keeps a secondary partition.*hpz_partition_size=None"):
        ZeroPPStrategy(cpu_offload=True, hpz_partition_size=2)
    ZeroPPStrategy(cpu_offload=True)  # "auto" may resolve to no hpZ (one node): checked once the mesh is known
    ZeroPPStrategy(cpu_offload=True, hpz_partition_size=None)  # offload without hpZ is fine (on an accelerator)
    with pytest.raises(ValueError, match="ranks_per_node=2.0 must be an int of at least 1"):
        ZeroPPStrategy(ranks_per_node=2.0)
    with pytest.raises(ValueError, match="weight_bits: bits=6 is not supported"):
        ZeroPPStrategy(weight_bits=6)
    with pytest.raises(ValueError, match="gradient_bits: bits=2 is not supported"):
        ZeroPPStrategy(gradient_bits=2)
    with pytest.raises(ValueError, match="gradient_block_size: block_size=7"):
        ZeroPPStrategy(gradient_block_size=7)
    with pytest.raises(ValueError, match="hpz_partition_size=1"):
        ZeroPPStrategy(hpz_partition_size=1)
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        ZeroPPStrategy(ranks_per_node=0)
    with pytest.raises(MeshConfigError, match="hpz_partition_size=3 must divide the sharding group size 4"):
        _trainer(ZeroPPStrategy(hpz_partition_size=3))
    with pytest.raises(MeshConfigError, match="hpz_partition_size=4 must divide the sharding group size 4 and be"):
        _trainer(ZeroPPStrategy(hpz_partition_size=4))
    with pytest.raises(MeshConfigError, match="ranks_per_node=3 does not divide the 4 ranks"):
        _trainer(ZeroPPStrategy(ranks_per_node=3))


def test_one_rank_per_node_turns_hpz_off_instead_of_keeping_weights_gathered():
    with pytest.warns(UserWarning, match="one rank per node.*hpZ is off"):
        trainer = _trainer(ZeroPPStrategy(ranks_per_node=1))
    assert trainer.strategy.fsdp_config.reshard_after_forward is True  # ZeRO-3, not an int 1 (= never reshard)
