"""Checkpoints in real multi-process runs: exact resume with each checkpoint IO plugin, training during an async save,
a rank killed mid-save, resharding N → M ranks, cross-strategy resume, consolidation and inspection.

Tolerances: same world size in fp32 must be exact (≤ 1e-7; observed bitwise). Resharding and cross-strategy
resumes run in fp64 and must continue the uninterrupted trajectory to 1e-10 (only reduction order differs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import max_abs_diff, run_failing_scenario, run_scenarios

from examples.gpt import GPT
from lightning_dist.checkpoint.layout import CheckpointError
from lightning_dist.checkpoint.summary import summarize_checkpoint
from lightning_dist.checkpoint.validation import validate_checkpoint

pytestmark = pytest.mark.slow

SCRIPT = "checkpoint_runs.py"
FP32_EXACT = 1e-7
FP64_TOL = 1e-10
PLUGINS = ["dcp", "async", "full"]
SAVE_STEP = 3
# (saved with, on N ranks, resumed with, on M ranks): resharding both ways, and every strategy as source and target.
# tensor_parallel on 4 ranks is 2D (dp 2 × tp 2); zeropp_hpz is ZeRO++'s lossless technique over 2 nodes × 2 ranks.
# Pipeline and hybrid3d join here (and in checkpoint_runs.STRATEGIES) as they land.
RESUMES = [
    ("fsdp2", 2, "fsdp2", 4),
    ("fsdp2", 4, "fsdp2", 2),
    ("fsdp2", 2, "tensor_parallel", 2),
    ("tensor_parallel", 2, "fsdp2", 2),
    ("tensor_parallel", 2, "zeropp_hpz", 4),
    ("zeropp_hpz", 4, "tensor_parallel", 2),
]
SOURCES = sorted({(s, n) for s, n, _, _ in RESUMES})


def _resume_name(source: str, n: int, target: str) -> str:
    return f"resume_{source}_d{n}_as_{target}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def saved(workdir):
    fits = ["fit_dcp_fp32", "fit_async_fp32", "fit_full_fp32"] + [f"fit_{s}_fp64" for s, n in SOURCES if n == 2]
    return run_scenarios(SCRIPT, 2, workdir, fits)


@pytest.fixture(scope="module")
def crashed(workdir, saved):
    return run_failing_scenario(SCRIPT, 2, workdir, "crash_during_save")


@pytest.fixture(scope="module")
def four_ranks(workdir, saved):
    scenarios = [f"fit_{s}_fp64" for s, n in SOURCES if n == 4]
    scenarios += [_resume_name(s, n, t) for s, n, t, m in RESUMES if m == 4]
    return run_scenarios(SCRIPT, 4, workdir, scenarios)


@pytest.fixture(scope="module")
def resumed(workdir, saved, crashed, four_ranks):
    scenarios = [f"resume_{p}_fp32" for p in PLUGINS] + ["resume_after_crash"]
    scenarios += [_resume_name(s, n, t) for s, n, t, m in RESUMES if m == 2]
    return run_scenarios(SCRIPT, 2, workdir, scenarios)


@pytest.fixture(scope="module")
def one_device(workdir, saved):
    return run_scenarios(SCRIPT, 1, workdir, ["resume_full_fp32_one_device", "resume_dcp_fp32_one_device"])


def test_saving_does_not_change_training(saved):
    reference = saved["fit_dcp_fp32"]["losses"]
    assert len(reference) == 6
    for plugin in ("async", "full"):
        assert saved[f"fit_{plugin}_fp32"]["losses"] == reference


@pytest.mark.parametrize("plugin", PLUGINS)
def test_exact_resume_mid_epoch(saved, resumed, plugin):
    """Fit 6 steps straight vs fit 3 → save → new processes → resume: steps 4-6 are equal, and so is the LR."""
    straight = saved[f"fit_{plugin}_fp32"]
    run = resumed[f"resume_{plugin}_fp32"]
    assert run["global_step"] == 6
    assert max_abs_diff(run["losses"], straight["losses"][SAVE_STEP:]) <= FP32_EXACT
    assert run["final_lr"] == straight["final_lr"]


def test_async_save_lets_training_continue_before_the_write_finishes(saved, workdir):
    events = saved["fit_async_fp32"]["events"]
    returned = events.index(f"save_returned step={SAVE_STEP}")
    next_step = events.index(f"step_started step={SAVE_STEP + 1}")
    written = events.index("write_finished")
    assert returned < next_step < written, events
    # ... and what was written is the state at save time, complete and loadable
    validate_checkpoint(workdir / "async_fp32" / f"step={SAVE_STEP}.ckpt")


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(crashed, resumed, saved, workdir):
    assert crashed.returncode != 0, "the injected crash did not stop the run"
    folder = workdir / "crash"
    last = validate_checkpoint(folder / "last.ckpt")
    assert summarize_checkpoint(last).global_step == 2
    assert not (folder / "step=4.ckpt").exists()
    # the unfinished write: removed by rank 0 when its save failed, or (if rank 0 was ended first) left under a
    # hidden name that never passes for a checkpoint
    leftovers = list(folder.glob(".step=4.ckpt.tmp-*"))
    assert len(leftovers) <= 1 and not list(folder.glob(".*.old-*"))
    for leftover in leftovers:
        with pytest.raises(CheckpointError, match="not a complete checkpoint"):
            validate_checkpoint(leftover)
    # resuming from `last` continues the uninterrupted run exactly
    assert max_abs_diff(resumed["resume_after_crash"]["losses"], saved["fit_dcp_fp32"]["losses"][2:]) <= FP32_EXACT


def _fp64_run(request, devices: int) -> dict:
    return request.getfixturevalue("saved" if devices == 2 else "four_ranks")


@pytest.mark.parametrize(("strategy", "devices"), SOURCES, ids=[f"{s}-d{n}" for s, n in SOURCES])
def test_every_saving_run_matches_the_reference(request, saved, strategy, devices):
    """The uninterrupted runs agree with each other (fsdp2 on 2 ranks is the reference trajectory)."""
    reference = saved["fit_fsdp2_fp64"]["losses"]
    assert max_abs_diff(_fp64_run(request, devices)[f"fit_{strategy}_fp64"]["losses"], reference) <= FP64_TOL


@pytest.mark.parametrize(
    ("source", "n", "target", "m"), RESUMES, ids=[f"{s}-d{n}-as-{t}-d{m}" for s, n, t, m in RESUMES]
)
def test_resume_under_another_strategy_or_world_size_continues_the_run(request, saved, source, n, target, m):
    run = (request.getfixturevalue("four_ranks") if m == 4 else request.getfixturevalue("resumed"))[
        _resume_name(source, n, target)
    ]
    assert run["global_step"] == 6
    assert max_abs_diff(run["losses"], saved["fit_fsdp2_fp64"]["losses"][SAVE_STEP:]) <= FP64_TOL


@pytest.mark.parametrize("plugin", ["full", "dcp"])
def test_one_device_lightning_resumes_the_full_state_file_and_the_sharded_folder(saved, one_device, plugin):
    """Saved at the epoch boundary (step 4) by 2 ranks, resumed by Lightning's own one-device strategy and
    ``TorchCheckpointIO``: from the one-file checkpoint, and from the sharded folder itself (read as one file when
    lightning_dist is imported; before, ``torch.load`` of the folder raised ``IsADirectoryError``)."""
    run = one_device[f"resume_{plugin}_fp32_one_device"]
    assert run["global_step"] == 6
    assert max_abs_diff(run["losses"], saved[f"fit_{plugin}_fp32"]["losses"][4:]) <= 1e-5


def _probe(workdir: Path, name: str) -> torch.Tensor:
    return torch.load(workdir / f"{name}_probe.pt")


def _forward(model: GPT) -> torch.Tensor:
    from checkpoint_runs import probe_input  # type: ignore[import-not-found]

    model.eval()
    with torch.no_grad():
        return model(probe_input(model.hparams.vocab_size))


@pytest.fixture(scope="module")
def scenario_imports():
    sys.path.insert(0, str(Path(__file__).parent / "scenarios"))
    yield
    sys.path.remove(str(Path(__file__).parent / "scenarios"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The console script, in a new process (as a user runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_dist.cli", *args], capture_output=True, text=True, check=False
    )


def _tool(*args: str) -> None:
    """The same entry point in this process (saves a Python start per call)."""
    from lightning_dist.cli import main

    main(list(args))


def test_consolidated_checkpoint_reproduces_the_forward_exactly(saved, workdir, scenario_imports):
    sharded = workdir / "dcp_fp32" / "step=6.ckpt"
    out = workdir / "consolidated.ckpt"
    proc = _cli("consolidate", str(sharded), str(out))
    assert proc.returncode == 0, proc.stderr
    checkpoint = torch.load(out, weights_only=False)  # plain torch.load
    assert checkpoint["global_step"] == 6 and checkpoint["optimizer_states"][0]["state"]
    model = GPT.load_from_checkpoint(out)
    assert torch.equal(_forward(model), _probe(workdir, "dcp_fp32"))

    _tool("consolidate", "--weights-only", str(sharded), str(workdir / "weights.ckpt"))
    weights = torch.load(workdir / "weights.ckpt", weights_only=False)
    assert "optimizer_states" not in weights and "loops" not in weights
    assert torch.equal(_forward(GPT.load_from_checkpoint(workdir / "weights.ckpt")), _probe(workdir, "dcp_fp32"))

    from safetensors.torch import load_file  # the `test` extra installs it

    _tool("consolidate", str(sharded), str(workdir / "model.safetensors"))
    tensors = load_file(str(workdir / "model.safetensors"))
    assert tensors.keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(tensors[k], v) for k, v in checkpoint["state_dict"].items())


def test_load_from_checkpoint_reads_the_sharded_folder(saved, workdir, scenario_imports):
    """``GPT.load_from_checkpoint(folder)`` on the sharded checkpoint of a 2-rank run, in this process (no process
    group): the forward equals the run's own, bitwise; ``map_location`` is honoured."""
    folder = workdir / "dcp_fp32" / "step=6.ckpt"
    assert folder.is_dir()
    assert torch.equal(_forward(GPT.load_from_checkpoint(folder)), _probe(workdir, "dcp_fp32"))
    assert torch.equal(_forward(GPT.load_from_checkpoint(str(folder), map_location="cpu")), _probe(workdir, "dcp_fp32"))


def test_full_state_file_loads_in_one_process(saved, workdir, scenario_imports):
    path = workdir / "full_fp32" / "step=6.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert set(checkpoint["optimizer_states"][0]["state"]) == set(range(len(checkpoint["state_dict"])))
    assert torch.equal(_forward(GPT.load_from_checkpoint(path)), _probe(workdir, "full_fp32"))


def test_inspect_reports_how_a_checkpoint_was_saved(saved, workdir, capsys):
    proc = _cli("inspect", "--json", str(workdir / "dcp_fp32" / f"step={SAVE_STEP}.ckpt"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["global_step"] == SAVE_STEP and summary["format"] == "sharded (DCP)"
    assert summary["saved_with"]["world_size"] == 2 and summary["saved_with"]["mesh"]["dp_shard"] == 2
    entries = {t["key"]: t for t in summary["tensors"]}
    emb = entries["state_dict.tok_emb.weight"]
    assert emb["dtype"] == "float32" and emb["bytes"] == emb["shape"][0] * emb["shape"][1] * 4
    with pytest.raises(SystemExit) as exit_info:
        _tool("inspect", str(workdir / "crash" / "missing.ckpt"))
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err
