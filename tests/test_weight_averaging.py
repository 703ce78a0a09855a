"""Lightning's weight averaging under the strategies: ``WeightAveraging`` (EMA through torch's
``get_ema_multi_avg_fn``) and ``StochasticWeightAveraging`` match one process, checkpoints hold what one process
saves, resumes continue as one process does, and the averaged copies hold this rank's shards only.

Fast tests (no launch): the sharded copy and its averaging against torch's ``AveragedModel``, the averaged model
states through a sharded checkpoint and back, optimizer options a scheduler adds later. Slow: one reference process
and one 2-process launch (fsdp2, tensor_parallel, pipeline, and two resumes), fp64, 1e-10. zeropp,
context_parallel and hybrid3d run the same code (their copies are FSDP2 shards or tensor-parallel DTensors) and are
in the scenario script under ``LIGHTNING_DIST_FULL_MATRIX=1``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from launch import FULL_MATRIX, run_scenarios
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lightning_dist import DistributedCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.checkpoint.layout import PROVENANCE_KEY, read_metadata
from lightning_dist.checkpoint.state_paths import CURRENT_MODEL_STATE, MODEL_STATE, callback_state_path
from lightning_dist.parallel.averaged_copy import ShardedAveragedModel, sharded_copy

TOL = 1e-10
SCRIPT = "averaging_runs.py"
# the same code as fsdp2 and tensor_parallel (FSDP2 shards, tensor-parallel DTensors): LIGHTNING_DIST_FULL_MATRIX=1 only
MORE_STRATEGIES = ["zeropp", "context_parallel", "hybrid3d"]
STRATEGIES = ["fsdp2", "tensor_parallel", "pipeline", *(MORE_STRATEGIES if FULL_MATRIX else [])]
# resumes: fsdp2 from its own sharded step-3 checkpoint, tensor_parallel from the one-process single-file one; the
# pipeline from its own under LIGHTNING_DIST_FULL_MATRIX=1
RESUMES = ["fsdp2_resume", "tensor_parallel_from_reference", *(["pipeline_resume"] if FULL_MATRIX else [])]


def _module() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(4, 3), shared, nn.BatchNorm1d(3), shared)
    model.register_buffer("table", torch.arange(4.0), persistent=False)
    return model


def _step(model: nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.sin(torch.arange(p.numel(), dtype=p.dtype) + step + i).view_as(p))
        for b in model.buffers():
            if b.is_floating_point():
                b.mul_(1.5)


def test_the_sharded_copy_has_the_models_names_order_and_sharing():
    model = _module()
    copied = sharded_copy(model)
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in copied.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert list(copied.state_dict()) == list(model.state_dict())  # "table" is left out of both
    assert copied.get_submodule("1") is copied.get_submodule("3")  # shared in the model, shared in the copy
    for (name, p), c in zip(model.named_parameters(), copied.parameters()):
        assert torch.equal(p, c) and c.data_ptr() != p.data_ptr() and not c.requires_grad, name


@pytest.mark.parametrize(
    "averaging",
    [{"multi_avg_fn": get_ema_multi_avg_fn(0.9)}, {"avg_fn": get_ema_avg_fn(0.9)}, {}],
    ids=["multi_avg_fn", "avg_fn", "swa"],
)
@pytest.mark.parametrize("use_buffers", [True, False])
def test_sharded_averaging_is_torchs(averaging, use_buffers):
    model = _module()
    reference = AveragedModel(model, use_buffers=use_buffers, **averaging)
    ours = ShardedAveragedModel.replacing(reference, sharded_copy(model))
    for step in range(4):
        _step(model, step)
        reference.update_parameters(model)
        ours.update_parameters(model)
    assert list(ours.state_dict()) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    with pytest.raises(RuntimeError, match="differently parallelized model"):
        ours.update_parameters(nn.Linear(2, 2))


def test_weight_averaging_states_go_through_a_sharded_checkpoint(tmp_path):
    """What WeightAveraging (averaged weights in state_dict, the model's in current_model_state) and
    StochasticWeightAveraging (its copy in its callback state) leave in Lightning's checkpoint dict: every model
    state is written as shards (not into meta.pt), loaded into the module it belongs to, and consolidated back into
    Lightning's one-process layout."""
    current, ema, swa = _module(), _module(), _module()
    _step(ema, 1)
    _step(swa, 2)
    swa_key = "StochasticWeightAveraging"
    checkpoint = {
        "state_dict": model_state.model_state(ema, full=False),
        "current_model_state": model_state.model_state(current, full=False),
        "averaging_state": {"n_averaged": torch.tensor(3)},
        "callbacks": {swa_key: {"n_averaged": 2, "average_model_state": model_state.model_state(swa, full=False)}},
        "global_step": 5,
    }
    path = tmp_path / "a.ckpt"
    DistributedCheckpointIO().save_checkpoint(checkpoint, path)
    meta = read_metadata(path)
    assert "state_dict" not in meta and "current_model_state" not in meta
    assert meta["callbacks"][swa_key] == {"n_averaged": 2}  # the copy's weights are shards, the rest stays
    assert meta[PROVENANCE_KEY]["model_states"] == [
        ["state_dict"],
        ["current_model_state"],
        list(callback_state_path(swa_key)),
    ]

    model, ema_copy, swa_copy = _module(), sharded_copy(_module()), sharded_copy(_module())
    for module in (model, ema_copy, swa_copy):
        _step(module, 7)  # different from every saved state
    targets = {CURRENT_MODEL_STATE: model, MODEL_STATE: ema_copy, callback_state_path(swa_key): swa_copy}
    offered: list = []

    def choose(saved):
        offered.extend(saved)
        return targets

    loaded = model_state.load_checkpoint_into(path, model, [], strict=True, targets=choose)
    assert offered == [MODEL_STATE, CURRENT_MODEL_STATE, callback_state_path(swa_key)]
    assert loaded["averaging_state"]["n_averaged"] == 3 and loaded["global_step"] == 5
    for source, target in ((current, model), (ema, ema_copy), (swa, swa_copy)):
        for key, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[key], value), key

    consolidated = load_full_checkpoint(path)  # Lightning's one-process layout
    for key, value in ema.state_dict().items():
        assert torch.equal(consolidated["state_dict"][key], value)
        assert torch.equal(consolidated["current_model_state"][key], current.state_dict()[key])
        assert torch.equal(consolidated["callbacks"][swa_key]["average_model_state"][key], swa.state_dict()[key])


def test_a_full_state_load_leaves_out_options_a_later_scheduler_adds():
    """StochasticWeightAveraging's SWALR adds ``swa_lr`` to the optimizer's param groups; a resumed run builds its
    SWALR only when its first epoch starts. Under a process group, torch's ``set_optimizer_state_dict`` raised
    ``KeyError: 'param_groups.0.swa_lr'`` on such a state (``tensor_parallel_from_reference`` below resumes one);
    the options the optimizer does not have are now left out, as a sharded load leaves them out."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][0]["swa_lr"] = 0.05
    saved["param_groups"][0]["lr"] = 0.07
    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [saved]}
    model_state.load_full(checkpoint, fresh, [fresh_optimizer], strict=True, where="'mem'")
    assert fresh_optimizer.param_groups[0]["lr"] == 0.07 and "swa_lr" not in fresh_optimizer.param_groups[0]


# ------------------------------------------------------------------------------------------------ real processes
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("averaging")


@pytest.fixture(scope="module")
def reference(workdir):
    return run_scenarios(SCRIPT, 1, workdir, ["reference"])


@pytest.fixture(scope="module")
def runs(workdir, reference):
    scenarios = [*STRATEGIES, *RESUMES, "fsdp2_meta_init"]
    return run_scenarios(SCRIPT, 2, workdir, scenarios)


def _largest_difference(workdir, run: str, expected: str) -> dict[str, float]:
    ours, theirs = torch.load(workdir / f"{run}.pt"), torch.load(workdir / f"{expected}.pt")
    out = {}
    for state in ("ema", "swa", "current"):
        assert sorted(ours[state]) == sorted(theirs[state]), state
        out[state] = max((ours[state][k] - theirs[state][k]).abs().max().item() for k in theirs[state])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_averaged_weights_match_one_process(workdir, reference, runs, strategy):
    ours, ref = runs[strategy], reference["reference"]
    assert ours["ema_copy_type"] == "ShardedAveragedModel"
    assert ours["ema_updates"] == ref["ema_updates"] == 6 and ours["swa_updates"] == ref["swa_updates"] == 2
    # validation swaps the EMA weights in: its losses are the EMA's
    assert max(abs(a - b) for a, b in zip(ours["val_losses"], ref["val_losses"], strict=True)) <= TOL
    differences = _largest_difference(workdir, strategy, "reference")
    assert all(d <= TOL for d in differences.values()), differences
    reference_states = torch.load(workdir / "reference.pt")  # the averages differ from the model: a real check
    assert (
        max((reference_states["ema"][k] - reference_states["current"][k]).abs().max() for k in reference_states["ema"])
        > 1e-3
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoints_hold_what_one_process_saves(workdir, runs, strategy):
    """The step-3 checkpoint (mid-epoch, both averages running), consolidated, against the one-process file."""
    ref = torch.load(workdir / "reference" / "step=3.ckpt", weights_only=False)
    ours = load_full_checkpoint(workdir / strategy / "step=3.ckpt")
    assert set(ours) - set(ref) == {PROVENANCE_KEY} and set(ref) <= set(ours)
    assert int(ours["averaging_state"]["n_averaged"]) == int(ref["averaging_state"]["n_averaged"]) == 3
    swa_ref, swa_ours = ref["callbacks"]["StochasticWeightAveraging"], ours["callbacks"]["StochasticWeightAveraging"]
    for key in ("n_averaged", "latest_update_epoch", "scheduler_state"):
        assert swa_ours[key] == swa_ref[key], key
    for states in (
        ("state_dict",),
        ("current_model_state",),
        ("callbacks", "StochasticWeightAveraging", "average_model_state"),
    ):
        a, b = ref, ours
        for key in states:
            a, b = a[key], b[key]
        assert sorted(a) == sorted(b), states
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= TOL, states


@pytest.mark.slow
@pytest.mark.parametrize("run", RESUMES)
def test_a_resume_restores_what_one_process_saved(workdir, runs, run):
    """Right after resuming from the step-3 checkpoint, the model holds the weights it trained to, the EMA copy and
    the SWA copy their averages, with their counts, exactly as in the one-process checkpoint; then a step trains
    (with SWA's scheduler state kept for its SWALR: loading it into the module's scheduler raised KeyError)."""
    ckpt = torch.load(workdir / "reference" / "step=3.ckpt", weights_only=False)
    swa = ckpt["callbacks"]["StochasticWeightAveraging"]
    expected = {"current": ckpt["current_model_state"], "ema": ckpt["state_dict"], "swa": swa["average_model_state"]}
    restored = torch.load(workdir / f"{run}_restored.pt")
    for state, values in restored.items():
        assert sorted(values) == sorted(k for k in expected[state] if k in values) and values, state
        assert max((values[k] - expected[state][k]).abs().max().item() for k in values) <= TOL, state
    counts = runs[run]["restored"]
    assert counts["ema_n_averaged"] == int(ckpt["averaging_state"]["n_averaged"]) == 3
    assert (counts["swa_n_averaged"], counts["swa_latest_update_epoch"]) == (
        swa["n_averaged"],
        swa["latest_update_epoch"],
    )
    assert counts["swa_scheduler_state"] and counts["schedulers"] == 0
    assert runs[run]["ema_updates"] == 4  # one more step, averaged


@pytest.mark.slow
def test_the_averaged_copies_hold_this_ranks_shards(reference, runs):
    whole = reference["reference"]["bytes"]
    for strategy in ("fsdp2", "tensor_parallel"):
        per_rank = runs[strategy]["bytes"]
        # as much as the model's parameters and buffers on the rank, about half of a whole copy (replicated norms
        # and, under FSDP2, shard padding make up the rest)
        assert per_rank["ema_copy"] == per_rank["swa_copy"] <= per_rank["model"], strategy
        assert per_rank["ema_copy"] <= 0.55 * whole["ema_copy"], (strategy, per_rank, whole)


@pytest.mark.slow
def test_swa_after_fit_on_an_fsdp2_sharded_model_is_refused_on_every_rank(runs):
    errors = runs["fsdp2"]["test_after_fit"]
    assert len(errors) == 2 and errors[0] == errors[1] and errors[0] is not None
    assert "StochasticWeightAveraging copies the LightningModule (copy.deepcopy)" in errors[0]
    assert "FSDP2 modules cannot be deep-copied" in errors[0]


@pytest.mark.slow
def test_a_model_created_on_the_meta_device_is_averaged(runs):
    """``Trainer.init_module(empty_init=True)``: WeightAveraging's setup failed moving its copy off the meta device
    ("Cannot copy out of meta tensor"); the copy is now made on meta and replaced after materialization."""
    result = runs["fsdp2_meta_init"]
    assert result["copy_type"] == "ShardedAveragedModel" and result["updates"] == 3 and result["device_given_back"]
    assert result["largest_difference"] <= TOL < result["moved"]
