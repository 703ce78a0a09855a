"""Drop-in from Lightning's strategies (issue 55): a module written for Lightning's ``ModelParallelStrategy``
(``configure_model`` parallelizing by hand over ``self.device_mesh["tensor_parallel"]`` and ``["data_parallel"]``)
trains unchanged under ``TensorParallelStrategy`` given the same arguments, with Lightning's losses, and each
strategy resumes the other's checkpoint (``tests/scenarios/drop_in_runs.py``)."""

from __future__ import annotations

import pytest
from launch import run_scenarios

pytestmark = pytest.mark.slow
TOL = 1e-10  # the module is fp64 (ModelParallelStrategy refuses precision="64-true"; the model casts itself)
SAVED_AT = 3


@pytest.mark.parametrize(("devices", "mesh"), [(2, "dp1_tp2"), (4, "dp2_tp2")])
def test_a_module_written_for_model_parallel_strategy_trains_and_resumes_under_ours(tmp_path, devices, mesh):
    names = [f"lightning_{mesh}", f"ours_{mesh}", f"ours_resumes_lightning_{mesh}", f"lightning_resumes_ours_{mesh}"]
    runs = run_scenarios("drop_in_runs.py", devices, tmp_path, names)
    lightning, ours = runs[f"lightning_{mesh}"]["losses"], runs[f"ours_{mesh}"]["losses"]
    assert len(lightning) == len(ours) == 6
    assert max(abs(a - b) for a, b in zip(lightning, ours)) <= TOL, (lightning, ours)
    assert any("applied its own tensor parallelism and fully_shard" in line for line in runs[f"ours_{mesh}"]["log"])
    for resumed in (f"ours_resumes_lightning_{mesh}", f"lightning_resumes_ours_{mesh}"):
        losses = runs[resumed]["losses"]
        assert len(losses) == 6 - SAVED_AT and max(abs(a - b) for a, b in zip(losses, lightning[SAVED_AT:])) <= TOL


def test_lightning_fsdp_strategy_arguments_train_as_one_process_and_do_what_lightnings_do(tmp_path):
    """The example GPT under ``FSDP2Strategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block},
    activation_checkpointing_policy={Block}, state_dict_type="full", cpu_offload=CPUOffload(...),
    limit_all_gathers=True)``, Lightning's FSDP docs' arguments: the losses of one process (fp64), each Block an FSDP
    unit and checkpointed, and the checkpoint one full-state file."""
    ours = run_scenarios("drop_in_runs.py", 2, tmp_path, ["fsdp_arguments"])["fsdp_arguments"]
    one = run_scenarios("drop_in_runs.py", 1, tmp_path, ["one_process"])["one_process"]
    assert len(ours["losses"]) == 3 and max(abs(a - b) for a, b in zip(ours["losses"], one["losses"])) <= TOL
    assert "fsdp2: activation checkpointing on 4 × Block" in ours["log"], ours["log"]
    assert any("sharding='full': sharded 4 × Block" in line for line in ours["log"]), ours["log"]
    assert ours["file"] and not ours["folder"]  # state_dict_type="full"


def test_a_hugging_face_model_trained_with_its_own_shipped_plan_equals_one_process(tmp_path):
    """A stock ``LlamaForCausalLM`` under ``TensorParallelStrategy(tensor_parallel_size=2, plan="model")``: its
    ``base_model_tp_plan`` and head plan (transformers' styles ``colwise``, ``rowwise``, ``embedding_rowwise``,
    ``colwise_gather_output``) applied as shipped, compared in the log with the automatic plan; losses equal one
    process's (fp64)."""
    ours = run_scenarios("drop_in_runs.py", 2, tmp_path, ["hugging_face_plan"])["hugging_face_plan"]
    one = run_scenarios("drop_in_runs.py", 1, tmp_path, ["hugging_face_plan"])["hugging_face_plan"]
    assert len(ours["losses"]) == 3 and max(abs(a - b) for a, b in zip(ours["losses"], one["losses"])) <= TOL
    assert any("the model's own plan (plan='model'; the same as the automatic plan) over tp=2" in line
               for line in ours["log"]), ours["log"]  # fmt: skip


def test_activation_checkpointing_every_kth_unit_selective_or_by_class_trains_as_one_process(tmp_path):
    """``activation_checkpointing=2`` (every 2nd block), ``"selective"`` (each block keeping its matmul and attention
    outputs) and ``["MLP"]`` (by class, as Lightning's policy) under fsdp2: one process's losses (fp64), the log
    saying what was checkpointed; the dry run's activation peak of the example config ranks none > selective >
    every block (exact byte counts on fake tensors)."""
    from lightning_dist.dryrun import dry_run

    names = [f"checkpointing_{mode}" for mode in ("every_2nd", "selective", "by_class")]
    runs = run_scenarios("drop_in_runs.py", 2, tmp_path, names)
    one = run_scenarios("drop_in_runs.py", 1, tmp_path, ["one_process"])["one_process"]
    said = {"every_2nd": "activation checkpointing on 2 × Block (every 2nd of 4 units)",
            "selective": "on 4 × Block (selective: their matmul and attention outputs kept, the rest recomputed)",
            "by_class": "activation checkpointing on 4 × MLP"}  # fmt: skip
    for mode, expected in said.items():
        run = runs[f"checkpointing_{mode}"]
        assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"], strict=True)) <= TOL, mode
        assert any(expected in line for line in run["log"]), (mode, run["log"])
    config = ["--config", "tests/dryrun_configs/fsdp2.yaml", "--trainer.strategy=lightning_dist.FSDP2Strategy"]
    peak = {
        mode: dry_run([*config, f"--trainer.strategy.init_args.activation_checkpointing={mode}"], 2).ranks[0]
        for mode in ("false", "selective", "true")
    }
    assert all(rank.error is None for rank in peak.values()), peak
    none, selective, every = (peak[m].memory["activations"] for m in ("false", "selective", "true"))
    assert none > selective > every, (none, selective, every)
