"""Checkpoint files without process launches: layout validation, atomic publishing, fit checks with clear messages,
optimizer-state formats and the IO plugins' configuration."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

import lightning_dist
from lightning_dist import AsyncDistributedCheckpointIO, DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.checkpoint.empty_param_groups import empty_groups_set_aside, holds_parameters
from lightning_dist.checkpoint.layout import COMPLETE_MARKER, CheckpointError, publish, temporary_path
from lightning_dist.checkpoint.model_fit import check_fit, compare_shapes
from lightning_dist.checkpoint.optimizer_format import names_to_positions, positions_to_names
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.strategies.lifecycle.preflight import check_checkpoint_callbacks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}])
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return optimizer


def _save_sharded(tmp_path: Path, name: str = "a.ckpt") -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = _trained(model)
    checkpoint = {
        "state_dict": model_state.model_state(model, full=False),
        "optimizer_states": [model_state.optimizer_state(model, optimizer, full=False)],
        "global_step": 7,
    }
    path = tmp_path / name
    DistributedCheckpointIO().save_checkpoint(checkpoint, path)
    return path, model, optimizer


def test_missing_partial_and_empty_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint(tmp_path / "nope.ckpt")
    path, _, _ = _save_sharded(tmp_path)
    validate_checkpoint(path)
    (path / COMPLETE_MARKER).unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint.*did not finish"):
        validate_checkpoint(path)
    (path / COMPLETE_MARKER).write_text("ok\n")
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="no DCP index file"):
        validate_checkpoint(path)
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    with pytest.raises(CheckpointError, match="empty file"):
        validate_checkpoint(empty)


def test_publish_replaces_only_when_the_new_checkpoint_is_complete(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "old").write_text("previous")
    tmp = temporary_path(target, "t1")
    tmp.mkdir()
    (tmp / "new").write_text("next")
    assert target.exists() and (target / "old").exists()  # before publishing, the old one is intact
    publish(tmp, target)
    assert (target / "new").exists() and not (target / "old").exists() and not tmp.exists()
    assert not list(tmp_path.glob(".last.ckpt.*"))


def test_a_publish_interrupted_between_its_renames_is_recovered(tmp_path):
    path, _, _ = _save_sharded(tmp_path, "last.ckpt")
    aside = tmp_path / ".last.ckpt.old-1234abcd"
    os.replace(path, aside)  # the state a crash between the two renames leaves
    assert validate_checkpoint(path) == path
    assert (path / COMPLETE_MARKER).exists() and not aside.exists()


def test_sharded_round_trip_and_consolidation_in_one_process(tmp_path):
    path, model, optimizer = _save_sharded(tmp_path)
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = torch.optim.AdamW([{"params": fresh[0].parameters()}, {"params": fresh[2].parameters(), "lr": 0.1}])
    _trained(fresh)  # give the optimizer state to overwrite
    model_state.load_sharded(path, fresh, [fresh_opt], strict=True)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[1]["lr"] == 0.1
    full = load_full_checkpoint(path)
    assert full["global_step"] == 7
    assert full["optimizer_states"][0]["param_groups"][1]["params"] == [2, 3]  # position-keyed, as torch does
    reference = optimizer.state_dict()
    for idx, state in reference["state"].items():
        assert torch.equal(full["optimizer_states"][0]["state"][idx]["exp_avg"], state["exp_avg"])


def test_shape_mismatch_names_the_key_and_both_shapes(tmp_path):
    path, _, _ = _save_sharded(tmp_path)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(CheckpointError, match=r"0\.weight: model \(16, 4\) vs checkpoint \(8, 4\)"):
        model_state.load_sharded(path, other, [], strict=True)


def test_strict_and_non_strict_loading(tmp_path):
    path, model, _ = _save_sharded(tmp_path)
    bigger = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['3.weight', '3.bias'\].*strict_loading"):
        model_state.load_sharded(path, bigger, [], strict=True)
    before = bigger[3].weight.detach().clone()
    model_state.load_sharded(path, bigger, [], strict=False)  # loads what fits, keeps the rest
    assert torch.equal(bigger[0].weight, model[0].weight) and torch.equal(bigger[3].weight, before)
    report = compare_shapes({"a": torch.Size([2])}, {"a": torch.Size([2]), "b": torch.Size([1])})
    with pytest.raises(CheckpointError, match=r"not in the model: \['b'\]"):
        check_fit(report, strict=True, where="x")
    check_fit(report, strict=False, where="x")


def test_full_state_into_a_model_checks_shapes_and_converts_optimizer_positions():
    model = _model()
    optimizer = _trained(model)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    fresh = _model()
    fresh_opt = torch.optim.AdamW([{"params": fresh[0].parameters()}, {"params": fresh[2].parameters(), "lr": 0.1}])
    _trained(fresh)
    model_state.load_full(checkpoint, fresh, [fresh_opt], strict=True, where="'mem'")
    for idx, state in optimizer.state_dict()["state"].items():
        assert torch.equal(fresh_opt.state_dict()["state"][idx]["exp_avg_sq"], state["exp_avg_sq"])
    with pytest.raises(CheckpointError, match="holds 0 optimizer state"):
        model_state.load_full({"state_dict": model.state_dict()}, fresh, [fresh_opt], strict=True, where="'w'")


def test_optimizer_positions_round_trip():
    named = {
        "state": {"b.w": {"step": 1}, "a.w": {"step": 2}},
        "param_groups": [{"params": ["b.w"], "lr": 1}, {"params": ["a.w", "c.w"], "lr": 2}],
    }
    positions = names_to_positions(named)
    assert positions["param_groups"][1]["params"] == [1, 2] and positions["state"][1] == {"step": 2}
    assert positions_to_names(positions, [["b.w"], ["a.w", "c.w"]]) == named
    with pytest.raises(ValueError, match="configured differently"):
        positions_to_names(positions, [["b.w", "a.w", "c.w"]])


def test_an_optimizer_without_per_parameter_state_reads_back_from_shards():
    """SGD without momentum keeps no state, and DCP writes no "state" entry for it (found by lightning-dist verify:
    its checkpoint round trip of a context-parallel SGD run raised KeyError)."""
    positions = names_to_positions({"param_groups": [{"params": ["a.w", "b.w"], "lr": 0.1}]})
    assert positions == {"state": {}, "param_groups": [{"params": [0, 1], "lr": 0.1}]}


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "one_file"])
def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_unstepped(tmp_path, full):
    """torch's get/set_optimizer_state_dict step an optimizer without state with lr 0 (Adam: zero moments, step 1),
    so a save before the first step (Lightning's lr_find saves and restores one) made the run's first real step
    Adam's second. The optimizer stays unstepped, the checkpoint holds its param groups only, as
    ``Optimizer.state_dict`` writes them, and a load of it leaves the loading optimizer unstepped too; the next step
    equals one never checkpointed."""
    model, reference = _model(), _model()
    optimizer, reference_opt = (torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, reference))
    state = model_state.optimizer_state(model, optimizer, full=full)
    assert not optimizer.state and state["state"] == {} and state["param_groups"][0]["lr"] == 0.1
    checkpoint = {"state_dict": model_state.model_state(model, full=full), "optimizer_states": [state]}
    path = tmp_path / "before_first_step.ckpt"
    (FullStateCheckpointIO() if full else DistributedCheckpointIO()).save_checkpoint(checkpoint, path)
    resumed = _model()
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    _trained_with(resumed, resumed_opt)  # a state the load must replace with none
    model_state.load_checkpoint_into(path, resumed, [resumed_opt], strict=True)
    assert not resumed_opt.state and resumed_opt.param_groups[0]["lr"] == 0.1
    for m, opt in ((model, optimizer), (reference, reference_opt), (resumed, resumed_opt)):
        _trained_with(m, opt)
    for a, b, c in zip(model.parameters(), reference.parameters(), resumed.parameters()):
        assert torch.equal(a, b) and torch.equal(c, b)


def _trained_with(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_param_group_option_added_after_the_save_is_left_out_of_the_load(tmp_path):
    """Lightning's lr_find saves, then its scheduler adds ``initial_lr`` to the param groups, then it restores the
    checkpoint: the load asked DCP for ``param_groups.0.initial_lr`` and failed with "Missing key". The group is
    loaded as saved, as ``Optimizer.load_state_dict`` does."""
    path, model, _ = _save_sharded(tmp_path)
    fresh = _model()
    fresh_opt = torch.optim.AdamW([{"params": fresh[0].parameters()}, {"params": fresh[2].parameters(), "lr": 0.1}])
    torch.optim.lr_scheduler.LinearLR(fresh_opt)  # sets initial_lr in every group
    model_state.load_sharded(path, fresh, [fresh_opt], strict=True)
    assert "initial_lr" not in fresh_opt.param_groups[0] and fresh_opt.param_groups[1]["lr"] == 0.1
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_an_empty_param_group_round_trips_through_a_state_keyed_per_parameter():
    """A pipeline stage's optimizer holds an empty param group where the group's parameters live on other stages.
    torch (2.13) reads a group's options from its first parameter when it loads a state keyed per parameter (what
    pipeline checkpoints hold), and fails on an empty group: the group is set aside while torch loads, and put back
    where it was (its options come from another stage, see share_group_options)."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _model()
    optimizer = torch.optim.AdamW([{"params": [], "lr": 0.5}, {"params": model.parameters()}], lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    with empty_groups_set_aside(optimizer) as empty:
        state = get_optimizer_state_dict(model, optimizer, options=flat)
    assert empty == [0] and len(optimizer.param_groups) == 2
    fresh = _model()
    fresh_opt = torch.optim.AdamW([{"params": [], "lr": 0.5}, {"params": fresh.parameters(), "lr": 0.2}], lr=0.1)
    with pytest.raises(IndexError):  # torch's own load
        set_optimizer_state_dict(fresh, fresh_opt, state, options=flat)
    with empty_groups_set_aside(fresh_opt):
        set_optimizer_state_dict(fresh, fresh_opt, state, options=flat)
    assert [len(g["params"]) for g in fresh_opt.param_groups] == [0, 4]
    assert [g["lr"] for g in fresh_opt.param_groups] == [0.5, 0.1]  # the saved group's learning rate, restored
    exp_avg = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    assert all(torch.equal(fresh_opt.state[p]["exp_avg"], e) for p, e in zip(fresh.parameters(), exp_avg))
    assert not holds_parameters(torch.optim.SGD([{"params": []}], lr=0.1))


@pytest.mark.parametrize("io_cls", [DistributedCheckpointIO, AsyncDistributedCheckpointIO, FullStateCheckpointIO])
def test_every_plugin_is_accepted_from_plugins_and_checkpoint_io(io_cls):
    trainer = L.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, plugins=[io_cls()], logger=False)
    assert type(trainer.strategy.checkpoint_io) is io_cls
    strategy = lightning_dist.FSDP2Strategy(checkpoint_io=io_cls())
    assert type(strategy.checkpoint_io) is io_cls


def test_a_plugin_that_cannot_write_shards_is_refused():
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    with pytest.raises(TypeError, match="FullStateCheckpointIO"):
        lightning_dist.FSDP2Strategy(checkpoint_io=TorchCheckpointIO())


def test_yaml_config_selects_a_plugin(tmp_path):
    from yaml_configs import cli_from_config

    cli = cli_from_config("configs/fsdp2_async_checkpoints.yaml", "--trainer.devices=2")
    assert isinstance(cli.trainer.strategy.checkpoint_io, AsyncDistributedCheckpointIO)


class _FailingWriteIO(AsyncDistributedCheckpointIO):
    fail = False

    def _storage_writer(self, folder: Path):
        writer = super()._storage_writer(folder)
        if self.fail:

            def write_data(plan, planner):
                raise OSError("disk full (injected)")

            writer.write_data = write_data
        return writer


def test_async_save_keeps_the_old_checkpoint_when_the_new_one_fails(tmp_path):
    model = _model()
    io = _FailingWriteIO()
    io.save_checkpoint({"state_dict": model_state.model_state(model, full=False), "global_step": 1}, tmp_path / "a")
    io.wait()
    validate_checkpoint(tmp_path / "a")
    io.fail = True
    io.save_checkpoint({"state_dict": model_state.model_state(model, full=False), "global_step": 2}, tmp_path / "b")
    io.remove_checkpoint(tmp_path / "a")  # what ModelCheckpoint does right after saving a better checkpoint
    with pytest.raises(CheckpointError, match="disk full.*|previous checkpoint is still in place"):
        io.teardown()
    validate_checkpoint(tmp_path / "a")  # the deletion was dropped with the failed save
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.tmp-*/COMPLETE"))


def test_async_save_deletes_the_old_checkpoint_once_the_new_one_is_published(tmp_path):
    model = _model()
    io = AsyncDistributedCheckpointIO()
    io.save_checkpoint({"state_dict": model_state.model_state(model, full=False)}, tmp_path / "a")
    io.save_checkpoint({"state_dict": model_state.model_state(model, full=False)}, tmp_path / "b")
    io.remove_checkpoint(tmp_path / "a")
    assert (tmp_path / "a").exists()  # not before "b" is published
    io.teardown()
    assert not (tmp_path / "a").exists()
    validate_checkpoint(tmp_path / "b")


def test_async_plugin_refuses_a_last_link():
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = L.Trainer(
        strategy="fsdp2",
        accelerator="cpu",
        devices=2,
        plugins=[AsyncDistributedCheckpointIO()],
        callbacks=[ModelCheckpoint(save_last="link")],
        logger=False,
    )
    with pytest.raises(ValueError, match="save_last='link'.*AsyncDistributedCheckpointIO"):
        check_checkpoint_callbacks(trainer)


def test_mid_epoch_skip_accounts_for_another_number_of_replicas():
    import copy

    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_dist.strategies.lifecycle.data_position import skip_trained_batches

    data = list(range(64))
    position = {"epoch": 0, "batches_processed": 3, "batches_per_epoch": 8, "batch_sizes": [2], "replicas": 4}
    # saved on 4 replicas × 2 samples: 24 samples consumed; on 2 replicas × 4 samples each rank skips 12
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=3))
    assert skip_trained_batches(loader, position, index=0, replicas=2)
    full_order = list(DistributedSampler(data, num_replicas=1, rank=0, seed=3))
    assert next(iter(loader)).tolist() == full_order[24:32:2]  # rank 0 of 2 continues at global sample 24
    assert len(list(loader)) == 8  # the skip happens once
    copy.deepcopy(loader.batch_sampler.sampler)  # the wrapper stays copyable


def test_mid_epoch_skip_warns_where_it_cannot_skip():
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_dist.strategies.lifecycle.data_position import skip_trained_batches

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(100))

    position = {"epoch": 0, "batches_processed": 2, "batches_per_epoch": 10, "batch_sizes": [2], "replicas": 1}
    with pytest.warns(UserWarning, match="cannot skip the 2 batches.*IterableDataset"):
        assert not skip_trained_batches(DataLoader(Stream(), batch_size=2), position, index=0, replicas=1)
