"""Lightning's ``Tuner`` and callbacks as users bring them, under the strategies (scenarios in
``tests/scenarios/lightning_tools_runs.py``)."""

from __future__ import annotations

import time

from launch import run_failing_scenario, run_scenarios

TOOLS = "lightning_tools_runs.py"


def _gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


def test_lr_find_equals_ddp_and_one_process_and_training_goes_on(tmp_path):
    """``Tuner(trainer).lr_find(model)`` on a module with a bare AdamW, then ``trainer.fit`` on the same Trainer, fp64.
    Before: the finder's restore failed under every strategy ("Missing key ... param_groups.0.initial_lr": the
    finder's scheduler adds the option after its save), and the save before the first step had stepped AdamW once
    with lr 0 (torch's state-dict call), so every loss the finder recorded after its first differed from DDP's
    (up to 0.02). Now: the finder's losses (rank 0's, as Lightning records them), its suggestion, the restored
    weights and the fit that follows equal DDP's under fsdp2 and zeropp, and one process's under tensor_parallel
    (tp peers see the whole batch) and pipeline (pp2, whose optimizer state is keyed per parameter: torch's loader of
    that layout reads every option, so the ones the checkpoint lacks are put back and removed after); its temporary
    checkpoint is deleted."""
    names = ["lr_find_fsdp2", "lr_find_zeropp", "lr_find_ddp", "lr_find_tensor_parallel", "lr_find_pipeline"]
    runs = {k.removeprefix("lr_find_"): v for k, v in run_scenarios(TOOLS, 2, tmp_path, names).items()}
    one = run_scenarios(TOOLS, 1, tmp_path, ["lr_find_one_process"])["lr_find_one_process"]
    ddp = runs["ddp"]
    for name, reference in (("fsdp2", ddp), ("zeropp", ddp), ("tensor_parallel", one), ("pipeline", one)):
        run = runs[name]
        assert run["lrs"] == reference["lrs"], name
        assert _gap(run["losses"], reference["losses"]) <= 1e-10, name
        assert run["suggestion"] == reference["suggestion"] == run["hparams_lr"], name
        assert run["restored_gap"] == 0.0 and run["left_behind"] == [], name
        assert _gap(run["fit_losses"], reference["fit_losses"]) <= 1e-10, name
    assert one["restored_gap"] == 0.0 and one["suggestion"] is not None


def test_finetuning_callbacks_equal_one_process(tmp_path):
    """One fit with BackboneFinetuning (the backbone thaws at epoch 1 and joins the optimizer as a new param group),
    GradientAccumulationScheduler (2 from epoch 2), ReduceLROnPlateau on val_loss, EarlyStopping,
    LearningRateMonitor and ModelCheckpoint(monitor="val_loss", save_top_k=2), then test(ckpt_path="best"), fp64:
    every step's loss and gradient norm, the param groups and rates, the best score, the kept checkpoints and the
    test loss equal one process's under fsdp2, zeropp and tensor_parallel. Before: tensor_parallel failed when the
    backbone thawed (Lightning compares parameters with torch.equal, which refuses a plain tensor beside a DTensor).
    (Under ddp the same fit differs from one process by 0.036 in loss once the backbone thaws: DDP reduces only the
    parameters that were trainable when it was built.)"""
    names = ["callbacks_fsdp2", "callbacks_zeropp", "callbacks_tensor_parallel"]
    runs = run_scenarios(TOOLS, 2, tmp_path, names)
    one = run_scenarios(TOOLS, 1, tmp_path, ["callbacks_one_process"])["callbacks_one_process"]
    assert one["group_sizes"] == [5, 36] and max(one["lrs"]) < 0.01  # the backbone joined; the plateau halved
    assert len(one["losses"]) == 12 and len(one["grad_norms"]) == 10  # 4 + 4 + 4 batches, 2 accumulated at the end
    for name, run in runs.items():
        assert _gap(run["losses"], one["losses"]) <= 1e-10, name
        assert _gap(run["grad_norms"], one["grad_norms"]) <= 1e-10, name
        assert run["group_sizes"] == one["group_sizes"] and _gap(run["lrs"], one["lrs"]) <= 1e-12, name
        assert abs(run["best_score"] - one["best_score"]) <= 1e-10 and run["kept"] == one["kept"], name
        assert abs(run["test_loss"] - one["test_loss"]) <= 1e-10, name


def test_sync_batchnorm_reaches_the_model_over_the_ranks_that_split_the_batch(tmp_path):
    """``Trainer(sync_batchnorm=True)``: before, the mesh strategies ignored it (Lightning applies its layer sync in
    its DDP and FSDP strategies only), so BatchNorm normalized over each rank's part of the batch. Now every BatchNorm
    is a SyncBatchNorm over the loss group (dp2 here) when the fit starts, under fsdp2 and zeropp. On the CPU the
    first step then ends in torch's own refusal (SyncBatchNorm syncs on accelerators only), as DDP refuses the same
    layer when it wraps the model; without the flag the layer stays a BatchNorm and trains."""
    names = ["sync_batchnorm_fsdp2", "sync_batchnorm_zeropp", "sync_batchnorm_ddp", "batchnorm_fsdp2"]
    runs = run_scenarios(TOOLS, 2, tmp_path, names)
    assert runs["batchnorm_fsdp2"] == {"kinds": [["BatchNorm", 0]], "error": None}
    assert runs["sync_batchnorm_ddp"]["error"] == "SyncBatchNorm layers only work with GPU modules"
    for name in names[:2]:
        assert runs[name]["kinds"] == [["SyncBatchNorm", 2]], name
        assert runs[name]["error"].startswith("SyncBatchNorm expected input tensor to be on GPU"), name


def test_detect_anomaly_trains_as_one_process_and_names_the_nan(tmp_path):
    """``Trainer(detect_anomaly=True)``, fp64. Before: tensor_parallel failed at the first backward ("Operator
    aten._is_any_true.default does not have a sharding strategy registered": autograd tests every gradient for NaN,
    and DTensor had no rule for that test), and pipeline at its first step with "Function 'LogSoftmaxBackward0'
    returned nan values" (torch's pipelining infers stage shapes by running them on uninitialized tensors). Now
    both train and their losses equal one process's; a backward that makes a NaN is named as on one device and
    every rank ends soon after."""
    runs = run_scenarios(TOOLS, 2, tmp_path, ["anomaly_tensor_parallel", "anomaly_pipeline"])
    one = run_scenarios(TOOLS, 1, tmp_path, ["anomaly_one_process"])["anomaly_one_process"]
    assert len(one["losses"]) == 3
    for name, run in runs.items():
        assert _gap(run["losses"], one["losses"]) <= 1e-10, name
    for scenario in ("anomaly_nan_tensor_parallel", "anomaly_nan_pipeline"):
        started = time.time()
        proc = run_failing_scenario(TOOLS, 2, tmp_path, scenario, timeout=120)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0 and time.time() - started < 90, output[-3000:]
        assert "Function 'SqrtBackward0' returned nan values in its 0th output" in output, output[-3000:]
