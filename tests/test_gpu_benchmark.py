"""``python -m benchmarks.run --gpu``: argument parsing, the refusal without CUDA, and the model and table arithmetic.
The GPU run itself needs a CUDA machine (see benchmarks/gpu/throughput.py); every setup is run once on the CPU, tiny."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import FULL_MATRIX

from benchmarks.gpu import throughput as gpu
from benchmarks.suite import run

ROOT = Path(__file__).resolve().parents[1]


def test_arguments_and_their_errors():
    args = gpu.parse_args(["--gpu"])
    assert args.sizes == "0.5b,2.4b" and args.setups.split(",") == list(gpu.SETUPS)
    assert (args.seq_len, args.warmup, args.steps, args.precision) == (2048, 5, 25, "bf16-mixed")
    assert (
        gpu.parse_args(["--gpu", "--sizes", "0.5b", "--setups", "fsdp2,fsdp2_compile"]).setups == "fsdp2,fsdp2_compile"
    )
    for bad in (["--sizes", "7b"], ["--setups", "deepspeed"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--gpu", *bad])
    assert run.parse_args(["--gpu"]).gpu and not run.parse_args([]).gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("entry", [run.main, gpu.main])
def test_without_cuda_it_says_it_needs_a_gpu(entry, tmp_path):
    with pytest.raises(SystemExit, match=r"needs a CUDA GPU.*python -m benchmarks.run \[--quick\]"):
        entry(["--gpu", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("name", list(gpu.SIZES))
def test_parameter_count_is_the_transformers_model_s(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = gpu.SIZES[name]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**size.config_kwargs()))
    assert sum(p.numel() for p in model.parameters()) == size.num_parameters
    embedding = model.model.embed_tokens.weight.numel()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert size.num_matmul_parameters == size.num_parameters - embedding - norms


def test_table_ratios_are_against_auto_compile():
    rows = [
        {
            "setup": "auto_compile",
            "size": "0.5b",
            "tokens_per_s": 2000.0,
            "mfu": 0.4,
            "peak_memory_gib": 30.0,
            "first_step_s": 40.0,
        },
        {
            "setup": "fsdp2",
            "size": "0.5b",
            "tokens_per_s": 1500.0,
            "mfu": 0.3,
            "peak_memory_gib": 29.0,
            "first_step_s": 2.0,
        },
        {"setup": "fsdp2_compile", "size": "0.5b", "tokens_per_s": 2400.0, "first_step_s": 30.0},
        {"setup": "fsdp2_fp8_rowwise_compile", "size": "0.5b", "tokens_per_s": 2880.0, "first_step_s": 50.0},
        {"setup": "fsdp2_fp8_tensorwise_compile", "size": "0.5b", "skipped": "torchao is not installed"},
        {"setup": "fsdp2_compile", "size": "2.4b", "error": "out of memory"},
    ]
    assert gpu.ratios(rows) == {
        ("0.5b", "auto_compile"): 1.0,
        ("0.5b", "fsdp2"): 0.75,
        ("0.5b", "fsdp2_compile"): 1.2,
        ("0.5b", "fsdp2_fp8_rowwise_compile"): 1.44,
    }
    table = gpu.to_markdown(rows)
    assert "| 0.5b | fsdp2 | 1.5k | 30.0% | 29.0 | 2.0 | 0.75× |" in table
    assert "| 2.4b | fsdp2_compile | out of memory |" in table
    assert "| 0.5b | fsdp2_fp8_tensorwise_compile | skipped: torchao is not installed |" in table
    assert "- 0.5b: fsdp2_compile / auto_compile ≥ 1.15×: 1.20× ✅ met" in table
    assert "- 0.5b: fsdp2_fp8_rowwise_compile / fsdp2_compile ≥ 1.25×: 1.20× ❌ missed" in table
    assert (
        "- 0.5b: fsdp2_fp8_tensorwise_compile / fsdp2_compile ≥ 1.25×: not measured"
        " (fsdp2_fp8_tensorwise_compile: torchao is not installed)" in table
    )
    assert "- 2.4b: fsdp2_compile / auto_compile ≥ 1.15×: not measured (fsdp2_compile: out of memory)" in table


def test_fp8_rows_say_why_they_cannot_run() -> None:
    """The fp8 rows need torchao and the strategies' float8 option; without either they are skipped with the reason
    (on a GPU older than SM89 too), not run into an error."""
    import importlib.util

    class NoFloat8Option:  # a strategy class from before the float8 option
        def __init__(self, compile: bool = False) -> None: ...

    if importlib.util.find_spec("torchao") is None:
        assert "pip install 'lightning-dist[fp8]'" in gpu.fp8_skip_reason("rowwise", device="cpu")
        return
    assert "has no float8 option" in gpu.fp8_skip_reason("rowwise", NoFloat8Option, device="cpu")
    assert gpu.fp8_skip_reason("rowwise", device="cpu") is None  # this build has the option
    assert set(gpu.FP8_RECIPES) <= set(gpu.SETUPS) and set(gpu.FP8_RECIPES.values()) == {"rowwise", "tensorwise"}


SMOKE = """
import argparse, json, sys
from benchmarks.gpu import throughput as gpu
size = gpu.LlamaSize("tiny", 64, 2, 4, 2, 128, vocab_size=128, batch_size=2)
args = argparse.Namespace(batch_size=None, warmup=1, steps=2, seq_len=32, precision="32-true")
print(json.dumps([gpu.run_one(setup, size, args, device="cpu") for setup in sys.argv[1:]]))
"""
# Left out, as compiling on 2 cores is what costs here: fsdp2_user_compile (its model is auto_compile's, its strategy
# fsdp2's; a user-compiled model under fsdp2 is checked in test_compile) and auto_compile (Lightning's own path: the
# user's torch.compile in configure_model, the code fsdp2_user_compile shares).
# The fp8 rows too: FP8 is only fast compiled, and compiling emulated FP8 on 2 cores costs minutes (their
# numerics under fsdp2 are tested in test_float8). And fsdp2_ac_compile: whole-block checkpointing under fsdp2 is
# fsdp2_runs' "activation_checkpointing"; compiling it is the path fsdp2_sac_compile takes with a per-op policy.
SMOKE_SETUPS = [
    s for s in gpu.SETUPS if s not in ("fsdp2_user_compile", "auto_compile", "fsdp2_ac_compile", *gpu.FP8_RECIPES)
]


@pytest.mark.slow
def test_every_setup_trains_on_the_cpu_before_it_costs_gpu_time():
    """The same code the GPU run executes (the strategies, compile=True, the hand-written FSDP), on a tiny
    Llama in one process of its own: a setup that cannot train fails here, not on a lent GPU. The numbers are not
    compared: a CPU says nothing about GPU throughput."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SMOKE, *SMOKE_SETUPS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["setup"] for r in rows] == SMOKE_SETUPS
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["device"] == "cpu" and row["mfu"] is None, row
        assert row["flops_per_token"] > 0 and row["logged_tokens_per_s"] > 0 and row["logged_mfu"] is None, row
    assert "| tiny | fsdp2 |" in gpu.to_markdown(rows)


# ------------------------------------------------------------------ benchmarks/gpu/moe.py (several GPUs, MoE)
def test_the_moe_benchmark_needs_two_gpus_and_says_so():
    from benchmarks.gpu import moe as gpu_moe

    args = gpu_moe.parse_args([])
    assert args.sizes == "small" and args.setups.split(",") == ["fsdp2", "expert_parallel", "expert_parallel_overlap"]
    with pytest.raises(SystemExit):
        gpu_moe.parse_args(["--sizes", "huge"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        with pytest.raises(SystemExit, match=rf"needs at least 2 CUDA GPUs \(2 asked for\), and {gpus} are visible"):
            gpu_moe.resolve_devices(args)
    with pytest.raises(SystemExit, match=r"--devices 1: expert parallelism needs at least 2 processes"):
        gpu_moe.resolve_devices(gpu_moe.parse_args(["--accelerator", "cpu", "--devices", "1"]))


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): expert_parallel trains on CPU processes in test_expert_parallel.py",
)
def test_the_moe_benchmark_runs_on_two_cpu_processes(tmp_path):
    """The GPU script end to end on the CPU (gloo), toy size, its expert_parallel setup (fsdp2's is the same code
    with expert_parallel_size=1; the all-gather ratio of the two is asserted in tests/test_expert_parallel.py): it
    trains, counts its all-gather and all-to-all bytes, and writes the table."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_moe", "--accelerator", "cpu", "--devices", "2", "--sizes", "toy",
           "--setups", "expert_parallel", "--warmup", "1", "--steps", "1", "--precision", "32-true", "--seq-len", "32",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (row,) = json.loads((tmp_path / "gpu_moe_results.json").read_text())
    assert row["setup"] == "expert_parallel" and row["all_to_all_bytes"] > 0 and row["all_gather_bytes"] > 0, row
    assert row["tokens_per_s"] > 0 and row["expert_bytes"] > 0, row
    assert "| toy |" in (tmp_path / "gpu_moe_report.md").read_text()


def test_the_local_experts_benchmark_times_both_ways_and_they_agree_on_the_cpu(tmp_path):
    """``benchmarks.gpu_local_experts`` on the CPU, toy shape: both methods timed, the table written, and the
    grouped GEMM's results equal to the loop's (CPU grouped_mm)."""
    from benchmarks.gpu import local_experts as gpu_local_experts

    assert (
        gpu_local_experts.main(
            ["--device", "cpu", "--shapes", "toy", "--warmup", "0", "--iters", "1", "--out", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "gpu_local_experts.json").read_text())
    (row,) = result["rows"]
    assert row["loop_ms"] > 0 and row["grouped_ms"] > 0 and row["max_relative_difference"] < 1e-2
    assert "| toy | 4 | 64 | 96 | 256 |" in (tmp_path / "gpu_local_experts.md").read_text()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            gpu_local_experts.main(["--out", str(tmp_path)])


def test_the_benchmark_builds_its_model_as_users_do():
    """``LlamaConfig(...)`` with ``use_cache`` at its default (on), as users write it: the strategies turn the cache
    off for training themselves. (The benchmark once set ``use_cache=False``, a trick users do not know: on one H200
    it was the difference between 0.94× and 1.14× Lightning auto + compile.)"""
    with torch.device("meta"):
        module = gpu._lightning_module(gpu.SIZES["0.5b"], user_compile=False, hand=False)
    assert module.model.config.use_cache is True
