"""FSDP2Strategy configuration: registration, precision conversion, unit selection and early errors.

These construct Trainers but launch no processes; every error here must surface at Trainer construction.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_dist
from examples.gpt import GPT, Block
from lightning_dist import FSDP2Precision, FSDP2Strategy
from lightning_dist.parallel.mesh import MeshConfigError
from lightning_dist.parallel.module_selection import find_repeated_blocks, select_modules


def test_import_registers_the_names_with_descriptions():
    for name in ("fsdp2", "fsdp2_grad_op", "fsdp2_no_shard", "fsdp2_hybrid", "fsdp2_cpu_offload"):
        assert StrategyRegistry[name]["strategy"] is FSDP2Strategy
        assert StrategyRegistry[name]["description"]
    assert StrategyRegistry["fsdp2_hybrid"]["init_params"] == {"sharding": "hybrid"}
    lightning_dist.strategies.registry.register_strategies()  # a second registration is a no-op


@pytest.mark.parametrize(
    ("name", "sharding", "cpu_offload"),
    [("fsdp2", "full", False), ("fsdp2_grad_op", "grad_op", False), ("fsdp2_hybrid", "hybrid", False)],
)
def test_trainer_resolves_registered_names(name, sharding, cpu_offload):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy)
    assert (trainer.strategy.sharding, trainer.strategy.cpu_offload) == (sharding, cpu_offload)
    assert trainer.strategy.is_distributed
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


@pytest.mark.parametrize(
    ("flag", "expected", "param_dtype"),
    [
        ("32-true", "32-true", None),
        ("64-true", "64-true", None),
        ("bf16-mixed", "bf16-mixed", torch.bfloat16),
        ("bf16-true", "bf16-true", None),
        ("16-true", "16-true", None),
    ],
)
def test_precision_flag_becomes_fsdp2_precision(flag, expected, param_dtype):
    trainer = L.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, precision=flag, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, FSDP2Precision) and plugin.precision == expected
    assert plugin.mp_policy.param_dtype == param_dtype
    if param_dtype is not None:
        assert plugin.mp_policy.reduce_dtype == torch.float32


def test_sixteen_mixed_plugin_has_a_loss_scaler():
    trainer = L.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, plugins=[FSDP2Precision("16-mixed")])
    plugin = trainer.strategy.precision_plugin
    assert plugin.scaler is not None and plugin.mp_policy.param_dtype == torch.float16


def test_unsupported_precision_plugin_fails_at_construction_listing_supported_flags():
    with pytest.raises(ValueError, match=r"DeepSpeedPrecision.*cannot be used.*32-true, 64-true, bf16-mixed"):
        L.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, plugins=[DeepSpeedPrecision("16-mixed")])
    with pytest.raises(ValueError, match=r"precision='8-mixed' is not supported.*Supported: 32-true"):
        FSDP2Precision("8-mixed")  # type: ignore[arg-type]


def test_wrong_mesh_fails_at_trainer_construction():
    with pytest.raises(
        MeshConfigError,
        match=r"data_parallel_replicate_size=1, data_parallel_shard_size=3 make a mesh of 3 ranks, but 2 processes",
    ):
        L.Trainer(strategy=FSDP2Strategy(data_parallel_shard_size=3), accelerator="cpu", devices=2)
    with pytest.raises(MeshConfigError, match=r"reshard_after_forward=3 must be a divisor"):
        L.Trainer(strategy=FSDP2Strategy(reshard_after_forward=3), accelerator="cpu", devices=4)


def test_cpu_offload_on_the_cpu_accelerator_is_refused_at_construction():
    assert StrategyRegistry["fsdp2_cpu_offload"]["init_params"] == {"cpu_offload": True}
    with pytest.raises(ValueError, match=r"cpu_offload=True .* already uses the CPU accelerator"):
        L.Trainer(strategy="fsdp2_cpu_offload", accelerator="cpu", devices=2)


def test_hybrid_defaults_to_one_replica_group_per_node():
    trainer = L.Trainer(strategy="fsdp2_hybrid", accelerator="cpu", devices=2, num_nodes=2)
    dims = trainer.strategy.parallel_dims
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)


def test_unknown_wrap_class_fails_at_construction():
    with pytest.raises(ValueError, match=r"Could not import the module class 'examples.gpt.NoSuchBlock'"):
        FSDP2Strategy(wrap_modules=["examples.gpt.NoSuchBlock"])
    with pytest.raises(ValueError, match=r"Cannot shard \['Blok'\].*Classes in the model: \[.*'Block'"):
        select_modules(GPT(n_layer=2), ["Blok"], what="shard")


def test_invalid_options():
    with pytest.raises(ValueError, match=r"sharding='zero3' is not one of"):
        FSDP2Strategy(sharding="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cannot be combined with sharding='no_shard'"):
        FSDP2Strategy(sharding="no_shard", cpu_offload=True)


class _HFLike(nn.Module):
    """Hugging Face decoder layout: model.layers ModuleList, plus an MoE-style nested ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(8, 8) for _ in range(2))}) for _ in range(3)
        )
        self.lm_head = nn.Linear(8, 10)


def test_repeated_blocks_are_found_outermost_first():
    assert [n for n, _ in find_repeated_blocks(GPT(n_layer=3))] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in find_repeated_blocks(_HFLike())] == ["layers.0", "layers.1", "layers.2"]


def test_units_by_class_path_name_and_regex():
    model = GPT(n_layer=2)
    by_class = select_modules(model, [Block])
    by_path = select_modules(model, ["examples.gpt.Block"])
    by_name = select_modules(model, ["Block"])
    by_regex = select_modules(model, fqn_regex=r"blocks\.\d+\.mlp")
    assert [n for n, _ in by_class] == [n for n, _ in by_path] == [n for n, _ in by_name] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in by_regex] == ["blocks.0.mlp", "blocks.1.mlp"]
    with pytest.raises(ValueError, match="matches no module name"):
        select_modules(model, fqn_regex=r"layers\.\d+")
