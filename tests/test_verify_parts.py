"""The parts of `lightning-dist verify` that need no processes: the reference's data, the comparison and its order,
the likely causes, the settings, and the work folder it may write."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from launch import REPO_ROOT
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_dist.verification.causes import likely_causes, rank_reads
from lightning_dist.verification.compare import Row, compare_runs, compare_tensors, merge_ranks, tensor_difference
from lightning_dist.verification.data import VerifyDataError, global_batches, reference_loaders, sample_fingerprints
from lightning_dist.verification.report import VerifyReport
from lightning_dist.verification.run import MARKER, VerifyError, compare_into, last_error, prepare_workdir
from lightning_dist.verification.settings import VerifySettings, default_tolerance, is_removed_callback


def test_the_reference_reads_the_strategys_global_batch_through_the_users_own_loaders():
    """One rule for every loader: the reference's ranks read the sum of the strategy's data-parallel ranks' batches,
    through the loader the user's hook returns in the reference, its sampler kept."""
    data = TensorDataset(torch.arange(64.0))
    # tensor, context and pipeline peers of one data-parallel rank are counted once
    assert global_batches([(0, [4, 2]), (1, [4, 2]), (0, [4, 2]), (1, [4, 2])]) == [8, 4]
    assert global_batches([(0, [4]), (1, [None])]) == [None]
    # Lightning puts in the sampler: the hook returns the per-rank batch in one process too, scaled to the global one
    plain = DataLoader(data, batch_size=4, shuffle=True, drop_last=True)
    scaled = reference_loaders(plain, [8], ranks=1, same_ranks=False)
    assert scaled.batch_size == 8 and scaled.drop_last and scaled.dataset is data and scaled.sampler is plain.sampler
    # the user's own sampler from distributed_sampler_kwargs: in one process the hook already returns the global batch
    own = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3))
    assert reference_loaders(own, [8], ranks=1, same_ranks=False) is own
    # a sampler that reads the world size (4 per rank on 2 ranks, 4 in one process): scaled, the sampler kept
    world = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=3))
    resized = reference_loaders({"a": world, "b": [own]}, [8, 8], ranks=1, same_ranks=False)
    assert resized["a"].batch_size == 8 and resized["a"].sampler is world.sampler and resized["b"][0] is own
    custom = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, False))
    assert reference_loaders(custom, [4], ranks=1, same_ranks=True) is custom  # its batch size is known: 4
    unknown = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    assert reference_loaders(unknown, [None], ranks=1, same_ranks=True) is unknown  # as many ranks: as it is
    with pytest.raises(VerifyDataError, match="custom batch_sampler"):
        reference_loaders(custom, [8], ranks=1, same_ranks=False)
    with pytest.raises(VerifyDataError, match="global batch of 3 samples per step cannot be split over the"):
        reference_loaders(DataLoader(data, batch_size=1), [3], ranks=2, same_ranks=False)


def test_the_samples_of_each_step_are_compared_and_data_the_reference_cannot_read_is_no_difference():
    """Per training batch, the strategy's data-parallel ranks together must have read the reference's samples, and
    peers of one data-parallel rank the same ones; a batch without per-sample rows is not compared."""
    batch = {"x": torch.arange(8.0).reshape(4, 2), "y": torch.tensor([0, 1, 2, 3])}
    prints = sample_fingerprints(batch)
    assert len(set(prints)) == 4 and sample_fingerprints({"x": batch["x"].double(), "y": batch["y"]}) == prints
    assert sample_fingerprints({"x": torch.ones(2, 3), "y": torch.ones(3)}) is None and sample_fingerprints("a") is None

    def ranks(*samples: list[str], dp: tuple[int, ...] = (0, 1)) -> list[dict]:
        return [
            {**_record(1.0, 0.5, 0.25), "samples": [s], "meta": {"data_parallel_rank": d}} for s, d in zip(samples, dp)
        ]

    ref = ranks(["a", "b", "c", "d"], dp=(0,))
    rows = compare_runs(ranks(["c", "a"], ["d", "b"]), ref, 1e-6)
    assert [r.quantity for r in rows][:2] == ["samples", "loss"] and all(r.ok for r in rows)
    rows = compare_runs(ranks(["a", "b"], ["a", "b"]), ref, 1e-6)
    first = next(r for r in rows if not r.ok)
    assert first.quantity == "samples" and first.difference == 0.5
    assert "read 4 samples together, the reference 4; 2 in common" in first.detail
    assert "every data-parallel rank read the same samples" in first.detail
    peers = compare_runs(ranks(["a", "b", "c", "d"], ["a", "b", "x", "d"], dp=(0, 0)), ref, 1e-6)
    first = next(r for r in peers if not r.ok)
    assert first.quantity == "sample replicas" and "ranks 0 and 1 share data-parallel rank 0" in first.detail
    assert "distributed_sampler_kwargs" in likely_causes(peers, None)[0]
    assert "samples" not in [r.quantity for r in compare_runs(ranks(None, ["a"]), ref, 1e-6)]


def test_a_reference_that_read_other_samples_is_not_verified_rather_than_different(tmp_path):
    def ranks(*samples: list[str]) -> list[dict]:
        meta = {"mesh": "dp_shard=2"}
        return [
            {**_record(1.0, 0.5, 0.25), "samples": [s], "meta": {**meta, "data_parallel_rank": d},
             "dropout_zeroed": []}
            for d, s in enumerate(samples)
        ]  # fmt: skip

    report = VerifyReport("fsdp2", "one process", 1e-6, "given", 1)
    compare_into(
        report, ranks(["a", "b"], ["c", "d"]), ranks(["a", "b", "x", "y"]), torch.nn.Linear(1, 1), tmp_path, None
    )
    assert report.summary().startswith("NOT VERIFIED: the reference did not read the samples the strategy's ranks")
    assert "train batch 0: the strategy's 2 data-parallel ranks read 4 samples together" in report.failure
    report = VerifyReport("fsdp2", "one process", 1e-6, "given", 1)
    compare_into(
        report, ranks(["a", "b"], ["c", "d"]), ranks(["a", "b", "c", "d"]), torch.nn.Linear(1, 1), tmp_path, None
    )
    assert not report.failure and report.first_difference.quantity == "checkpoint"  # no checkpoint was written here


def test_a_row_whose_every_element_was_left_out_says_so_and_a_step_without_a_loss_has_no_loss_row():
    """Gradients 2.1 apart make every element of the parameters noise-driven: that row must not read "ok"."""
    ours, ref = {"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([1.0, 2.0])}
    row = compare_tensors("parameters", "after step 0", ours, ref, 1e-6, {"w": torch.tensor([True, True])})
    assert not row.judged and row.ok and row.difference == 0.5 and "none of its 2 elements judged" in row.detail
    partly = compare_tensors("parameters", "after step 0", ours, ref, 1e-6, {"w": torch.tensor([False, True])})
    assert partly.judged and partly.ok and "not judged (of 2)" in partly.detail
    report = VerifyReport("fsdp2", "one process", 1e-6, "given", 1, rows=[row, Row("loss", "train batch 0", 0.1, 1)])
    line = next(line for line in report.table().splitlines() if "parameters" in line)
    assert line.endswith("not judged") and "5.00e-01" in line
    assert "largest relative difference 1.0e-01" in report.summary()  # the row not judged is not the largest
    assert report.to_json()["rows"][0]["judged"] is False
    manual = [{**_record(1.0, 0.5, 0.25), "losses": [None]}]  # manual optimization: training_step returns None
    assert "loss" not in [r.quantity for r in compare_runs(manual, manual, 1e-6)]


def test_differences_are_relative_to_the_largest_value_and_a_missing_side_is_infinite():
    assert tensor_difference(torch.tensor([1.0, 10.0]), torch.tensor([1.5, 10.0])) == 0.05
    assert tensor_difference(None, torch.ones(2)) == math.inf and tensor_difference(None, None) == 0
    assert tensor_difference(torch.ones(2), torch.ones(3)) == math.inf


def test_copies_of_a_parameter_on_two_ranks_must_agree():
    merged, rows = merge_ranks([{"w": torch.ones(2), "a": torch.zeros(1)}, {"w": torch.tensor([1.0, 2.0])}])
    assert set(merged) == {"w", "a"} and [r.worst[0][0] for r in rows] == ["w"] and not rows[0].ok


def _record(loss: float, grad: float, logged: float) -> dict:
    params = {"w": torch.tensor([1.0, grad])}
    step = {"optimizer": 0, "step": 0, "batch": 0, "lrs": [0.1], "grads": {"w": torch.tensor([grad, 1.0])}}
    logged_values = [{"when": "train batch 0", "step": 1, "values": {"acc": logged}}]
    optimizer = [{"w": {"exp_avg": torch.tensor([grad, 1.0]), "step": 1.0}}]
    return {"losses": [loss], "logged": logged_values, "steps": [step], "params": params, "optimizers": optimizer}


def test_the_first_difference_is_the_first_quantity_a_step_produces():
    ref = [_record(1.0, 0.5, 0.25)]
    rows = compare_runs([_record(1.0, 0.5, 0.25)], ref, 1e-6)
    assert [r.quantity for r in rows] == [
        "loss", "logged acc", "learning rate", "gradient norm", "gradients", "parameters", "optimizer state",
    ]  # fmt: skip
    assert all(r.ok for r in rows)
    rows = compare_runs([_record(1.0, 0.5, 0.5)], ref, 1e-6)
    first = next(r for r in rows if not r.ok)
    assert first.quantity == "logged acc"
    assert "sync_dist=True" in likely_causes(rows, None)[0]  # the loss matched: a value logged per rank
    rows = compare_runs([_record(1.0, 0.7, 0.25)], ref, 1e-6)
    assert next(r for r in rows if not r.ok).quantity == "gradient norm"


class _ReadsTheRank(torch.nn.Module):
    def forward(self, x):
        return x * self.global_rank


def test_the_modules_own_code_that_reads_the_rank_is_named_with_its_line():
    found = rank_reads(torch.nn.Sequential(_ReadsTheRank()))
    assert len(found) == 1 and found[0].startswith("test_verify_parts.py:") and "self.global_rank" in found[0]
    rows = [Row("loss", "train batch 0", 1.0, 1e-4)]
    assert "reads the rank" in likely_causes(rows, torch.nn.Sequential(_ReadsTheRank()))[0]


def test_tolerances_by_precision_and_the_strategys_own_statement():
    assert default_tolerance("64-true") == 1e-10 and default_tolerance("32-true") == 1e-4
    assert default_tolerance("bf16-mixed") == 2e-2 and default_tolerance("32-true", 5e-2) == 5e-2
    from lightning_dist import ZeroPPStrategy

    tolerance, why, judged = ZeroPPStrategy().verification_tolerance()
    assert tolerance == 5e-2 and "int8 weights and int4 gradients" in why and judged == ("loss", "logged")
    assert ZeroPPStrategy(quantized_weights=False, quantized_gradients=False).verification_tolerance() is None
    with pytest.raises(ValueError, match="at least one"):
        VerifySettings(steps=0)
    with pytest.raises(ValueError, match="float64"):
        VerifySettings(dtype="float16")


def test_checkpoint_and_early_stopping_callbacks_are_left_out_others_kept():
    assert is_removed_callback(ModelCheckpoint()) and is_removed_callback(EarlyStopping("x"))
    assert is_removed_callback({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"})
    assert not is_removed_callback(LearningRateMonitor())
    assert not is_removed_callback({"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"})


def test_a_work_folder_verify_did_not_make_is_never_written(tmp_path):
    (tmp_path / "mine.txt").write_text("the user's")
    with pytest.raises(VerifyError, match="is not empty and was not made by verify"):
        prepare_workdir(VerifySettings(workdir=str(tmp_path)))
    assert os.listdir(tmp_path) == ["mine.txt"]
    ours = tmp_path / "ours"
    (ours / "candidate").mkdir(parents=True)
    (ours / MARKER).write_text("")
    assert prepare_workdir(VerifySettings(workdir=str(ours))) == (ours, False)
    assert not (ours / "candidate").exists()


def test_the_error_line_of_a_failed_run_is_found():
    log = "noise\nTraceback (most recent call last):\n  ...\nlightning_dist.X.PooledOutputError: pooled\nmore\n"
    assert last_error(log) == "lightning_dist.X.PooledOutputError: pooled"


def test_a_bad_configuration_ends_the_check_before_any_run(tmp_path):
    config = str(REPO_ROOT / "configs" / "fsdp2.yaml")
    command = [sys.executable, "-m", "lightning_dist.cli", "verify", "--config", config, "--trainer.strategy=fsdp3"]
    command += ["--workdir", str(tmp_path / "w")]
    done = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "fsdp3" in done.stderr and "fsdp2" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "w").exists()


def test_a_stated_tolerance_judges_what_it_covers_and_shows_the_rest():
    from lightning_dist.verification.report import VerifyReport
    from lightning_dist.verification.run import _limit_to

    rows = [Row("loss", "train batch 0", 1e-3, 5e-2), Row("learning rate", "step 0", 0.0, 5e-2),
            Row("gradients", "step 0", 0.9, 5e-2), Row("checkpoint", "end", 0.0, 0.0)]  # fmt: skip
    note = _limit_to(rows, (5e-2, "int4 gradients on purpose", ("loss", "logged")))
    assert [row.ok for row in rows] == [True, True, True, True] and "shown only: gradients" in note
    report = VerifyReport("zeropp", "one process", 5e-2, "stated", 3, rows=rows)
    assert report.passed and "largest relative difference 1.0e-03" in report.summary()
    assert re.search(r"step 0 +gradients +9.00e-01  shown", report.table())


def test_what_verify_takes_from_a_float8_strategy():
    from lightning_dist import FSDP2Strategy, ZeroPPStrategy
    from lightning_dist.verification import FLOAT8_TOLERANCE, strategy_facts

    stated, extras = strategy_facts(FSDP2Strategy(float8="tensorwise", float8_skip=["head"]))
    assert stated[0] == FLOAT8_TOLERANCE and stated[2] == ("loss", "logged")
    assert extras == {"float8": {"recipe": "tensorwise", "skip": ["head"]}}
    assert strategy_facts(FSDP2Strategy(float8="rowwise"))[0] is None
    assert strategy_facts("fsdp2") == (None, {})
    stated, _ = strategy_facts(ZeroPPStrategy(float8="tensorwise"))
    assert stated[0] == 5e-2 and "ZeRO++" in stated[1] and "tensorwise" in stated[1]


def test_elements_whose_gradient_is_rounding_are_judged_by_their_gradient_not_their_final_value():
    """Adam turns a rounding-level gradient (here 1e-9 against a difference of 1e-10 between the runs) into an update
    of any size up to the learning rate: that element's final value is not judged; the others still are."""

    def record(grad_noise: float, final: list[float]) -> dict:
        grads = {"w": torch.tensor([1.0, 1e-9 + grad_noise])}
        step = {"optimizer": 0, "step": 0, "batch": 0, "lrs": [0.1], "grads": grads}
        return {"losses": [1.0], "logged": [{"when": "train batch 0", "step": 1, "values": {}}], "steps": [step],
                "params": {"w": torch.tensor(final)}, "optimizers": []}  # fmt: skip

    ref = [record(0.0, [1.0, 0.01])]
    rows = compare_runs([record(1e-10, [1.0, -0.01])], ref, 1e-4)
    parameters = next(r for r in rows if r.quantity == "parameters")
    assert parameters.ok and "1 elements whose gradient was at the runs' rounding level" in parameters.detail
    rows = compare_runs([record(1e-10, [1.01, -0.01])], ref, 1e-4)  # the element with a real gradient differs
    assert not next(r for r in rows if r.quantity == "parameters").ok


def _anchored(grad: float, after_step: float) -> tuple[dict, dict]:
    """Two steps of the strategy's run and of an anchored reference: the reference's state after step 0 is
    ``after_step`` where the strategy's own is 1.0 (its record keeps it as the anchor of train batch 1)."""

    def step(index: int) -> dict:
        return {"optimizer": 0, "step": index, "batch": index, "lrs": [0.1], "grads": {"w": torch.tensor([grad])}}

    def state(value: float) -> dict:
        return {"params": {"w": torch.tensor([value])}, "optimizers": [{"w": {"exp_avg": torch.tensor([grad])}}]}

    logged = [{"when": f"train batch {i}", "step": i + 1, "values": {}} for i in range(2)]
    ours = {"losses": [1.0, 1.0], "logged": logged, "steps": [step(0), step(1)], **state(2.0)}
    ours["anchors"] = {"train batch 1": state(1.0)}
    ref = {"losses": [1.0, 1.0], "logged": logged, "steps": [step(0), step(1)], **state(2.0)}
    ref["after"] = [
        {"moment": "train batch 1", "steps": [(0, 0)], **state(after_step)},
        {"moment": "end of training", "steps": [(0, 1)], **state(2.0)},
    ]
    return ours, ref


def test_an_anchored_reference_compares_the_state_after_every_step_before_the_next_batch():
    ours, ref = _anchored(0.5, 1.0)
    rows = compare_runs([ours], [ref], 1e-6)
    assert [(r.when, r.quantity) for r in rows] == [
        ("train batch 0", "loss"), ("step 0", "learning rate"), ("step 0", "gradient norm"), ("step 0", "gradients"),
        ("after step 0", "parameters"), ("after step 0", "optimizer state"),
        ("train batch 1", "loss"), ("step 1", "learning rate"), ("step 1", "gradient norm"), ("step 1", "gradients"),
        ("after step 1", "parameters"), ("after step 1", "optimizer state"),
    ]  # fmt: skip
    assert all(r.ok for r in rows)
    ours, ref = _anchored(0.5, 1.5)  # the same gradients, another update: the optimizer step differs
    rows = compare_runs([ours], [ref], 1e-6)
    first = next(r for r in rows if not r.ok)
    assert (first.when, first.quantity) == ("after step 0", "parameters")
    assert "the optimizer's update differs" in likely_causes(rows, None)[0]


def test_the_strategys_state_is_merged_over_its_ranks_and_loaded_into_the_reference_by_name():
    from lightning_dist.verification.tensors import (
        full_optimizer_state,
        full_parameters,
        load_training_state,
        merge_anchors,
    )

    def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        return model, optimizer

    source, source_opt = trained(0)
    params, states = full_parameters(source), full_optimizer_state(source, source_opt)
    halves = [  # two pipeline ranks, each holding one layer's names
        {"anchors": {"train batch 1": {"params": {k: v for k, v in params.items() if k.startswith(str(i))},
                                       "optimizers": [{k: v for k, v in states.items() if k.startswith(str(i))}]}}}
        for i in range(2)
    ]  # fmt: skip
    merged = merge_anchors(halves)["train batch 1"]
    target, target_opt = trained(1)
    load_training_state(target, [target_opt], merged)
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))
    for p, q in zip(source.parameters(), target.parameters()):
        assert torch.equal(source_opt.state[p]["exp_avg_sq"], target_opt.state[q]["exp_avg_sq"])
        assert float(source_opt.state[p]["step"]) == float(target_opt.state[q]["step"])


UNPICKLE_SCRIPT = """
import json, pickle, sys
import torch
from lightning_dist.compat.hugging_face import restore_output_capture
model = pickle.load(open(sys.argv[1], "rb"))
tokens = torch.arange(12).reshape(2, 6) % 64
before = model(input_ids=tokens).aux_loss
restored = restore_output_capture(model)
after = model(input_ids=tokens).aux_loss
print(json.dumps({"before": float(before) if torch.is_tensor(before) else repr(before),
                  "after": float(after) if torch.is_tensor(after) else repr(after), "restored": restored}))
"""


def test_a_transformers_model_unpickled_in_a_new_process_computes_its_router_loss_again(tmp_path):
    """verify's Python API pickles the model to its runs. transformers registers a model class's recordable
    outputs (router logits) when a model is constructed, so an unpickled Mixtral's forward skipped them: aux_loss
    was the int 0 in every run (a crash, or an auxiliary loss silently gone). restore_output_capture registers them
    again: the loss is the constructing process's."""
    import pickle

    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True)  # fmt: skip
    model = MixtralForCausalLM(config)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    expected = float(model(input_ids=torch.arange(12).reshape(2, 6) % 64).aux_loss)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", UNPICKLE_SCRIPT, str(tmp_path / "model.pkl")], capture_output=True,
                          text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "MixtralModel" in result["restored"] and result["after"] == expected, (result, expected)
