"""Tests of the benchmark suite's own accounting: formulas, statistics, memory and comm aggregation, the report.

The comm counter and ``state_bytes`` themselves are tested in ``test_profiling.py``; here we test what the
benchmark adds on top. ``test_benchmark_smoke_run`` runs the real suite once (tiny model, 2 ranks) and checks its
measured bytes against the closed-form theory exactly.
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint

from benchmarks.common import (
    SIZES,
    ActivationCounter,
    ModelSize,
    StepTimer,
    comm_breakdown,
    comm_totals,
    flops_per_token,
    gpt_parameter_count,
    group_label,
    interleaved_order,
    lookup_peak,
    ratio_stats,
    spread,
    throughput,
)
from benchmarks.suite import (
    BY_NAME,
    TIME_COMPARISONS,
    WORKLOADS,
    Workload,
    analyze,
    availability,
    choose_device,
    layout_for,
    plot,
    theory,
    to_markdown,
    write_report,
)
from examples.gpt import GPT
from lightning_dist.profiling import CommRecord

ROOT = Path(__file__).resolve().parents[1]
FP32 = theory.CommDtypes(gather=4, reduce=4)

# ---------------------------------------------------------------------------------------------------------- theory


def test_zero3_fsdp2_and_ddp_formulas() -> None:
    # P = 1000 fp32 parameters (M = 4000 bytes) over n = 4: (n-1)/n = 3/4.
    assert theory.zero3_bytes(1000, 4, FP32) == 3 * 4000 * 3 / 4
    assert theory.ddp_bytes(1000, 4, FP32) == 2 * 4000 * 3 / 4
    # 800 block parameters gathered twice, 200 root parameters once, all 1000 reduce-scattered.
    assert theory.fsdp2_exact_bytes(800, 200, 4, FP32) == (2 * 800 + 200 + 1000) * 4 * 3 / 4
    assert theory.fsdp2_exact_bytes(1000, 0, 4, FP32) == theory.zero3_bytes(1000, 4, FP32)
    assert theory.zero3_bytes(1000, 1, FP32) == 0
    # bf16-mixed: parameters gathered in 2 bytes, gradients reduced in 4.
    mixed = theory.comm_dtypes("bf16-mixed")
    assert (mixed.gather, mixed.reduce) == (2, 4)
    assert theory.zero3_bytes(1000, 2, mixed) == (2 + 2 + 4) * 1000 / 2
    assert theory.comm_dtypes("32-true") == FP32
    assert theory.comm_dtypes("bf16-true") == theory.CommDtypes(2, 2)
    assert theory.comm_dtypes("64-true") == theory.CommDtypes(8, 8)


def test_cross_node_and_zeropp_formulas() -> None:
    assert theory.cross_node_fraction(4, 2) == theory.Fraction(1, 2)
    assert theory.cross_node_fraction(8, 8) == 0 and theory.cross_node_fraction(8, None) == 0
    assert theory.zero3_cross_node_bytes(1000, 4, 2, FP32) == 3 * 4000 / 2
    # 1.5 bytes per parameter (int8 qwZ + int4 qgZ), half of it cross-node with 2 nodes x 2 ranks.
    assert theory.zeropp_cross_node_bytes(1000, 4, 2) == 1500 / 2
    # The paper's 0.75M / 3M against a 16-bit ZeRO-3, and half of that against fp32.
    assert theory.zeropp_over_zero3(theory.CommDtypes(2, 2)) == 0.25
    assert theory.zeropp_over_zero3(FP32) == 0.125
    ratio = theory.zeropp_cross_node_bytes(1000, 4, 2) / theory.zero3_cross_node_bytes(1000, 4, 2, FP32)
    assert ratio == pytest.approx(theory.zeropp_over_zero3(FP32))


def test_tensor_parallel_formula() -> None:
    # L=2 blocks, B=4, S=8, H=16, fp32, t=2: each all-reduce of B*S*H*4 = 2048 bytes sends 2*(1/2)*2048 = 2048.
    assert theory.tensor_parallel_bytes(2, 4, 8, 16, 4, 2) == 2 * 4 * 2048
    assert theory.tensor_parallel_bytes(2, 4, 8, 16, 4, 2, all_reduces_per_block=6) == 2 * 6 * 2048
    assert theory.tensor_parallel_bytes(2, 4, 8, 16, 4, 1) == 0
    assert theory.ideal_sharded_bytes(1000, 4) == 250


# ---------------------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_parameter_counts_match_the_example_gpt(size: ModelSize) -> None:
    model = GPT(**size.gpt_kwargs())
    assert gpt_parameter_count(size) == sum(p.numel() for p in model.parameters())
    matmul = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)
    )  # every Linear weight, including the head
    assert size.num_matmul_parameters == matmul
    assert size.n_head % 2 == 0 and size.d_model % size.n_head == 0  # tensor parallel over 2 ranks per node


def test_flops_and_peak_lookup() -> None:
    size = ModelSize("x", d_model=8, n_layer=1, n_head=2, vocab_size=10, seq_len=4)
    # N = 12*8*8 + 8*10 = 848 matmul parameters; attention 12*L*H*S = 12*1*8*4 = 384.
    assert flops_per_token(size) == 6 * 848 + 384
    assert lookup_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert lookup_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert lookup_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert lookup_peak("NVIDIA H200", "tf32") == 494.5e12
    assert lookup_peak("Some Other GPU", "bf16") is None
    out = throughput(size, tokens_per_step_per_device=1000, step_seconds=0.5, peak=1e9)
    assert out["tokens_per_s_per_device"] == 2000
    assert out["mfu"] == pytest.approx(2000 * flops_per_token(size) / 1e9)
    assert throughput(size, 1000, 0.5, None)["mfu"] is None


# ---------------------------------------------------------------------------------------------------------- timing


def test_spread_ratio_and_interleaving() -> None:
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert s["q1"] == 1.75 and s["q3"] == 4.75
    assert spread([5.0])["q1"] == 5.0
    with pytest.raises(ValueError):
        spread([])
    stats = ratio_stats([2.0, 4.0, 3.0], [1.0, 2.0, 4.0])
    assert stats["ratio_of_medians"] == 3.0 / 2.0
    assert (stats["pair_min"], stats["pair_median"], stats["pair_max"]) == (0.75, 2.0, 2.0)
    with pytest.raises(ValueError):
        ratio_stats([1.0], [1.0, 2.0])
    names = ["a", "b", "c"]
    orders = [interleaved_order(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {o[0] for o in orders} == set(names)  # every configuration runs first once


def test_step_timer_excludes_warmup() -> None:
    timer = StepTimer(torch.device("cpu"), warmup=2)
    for _ in range(5):
        timer.start()
        timer.stop()
    assert len(timer.all_times) == 5 and timer.times == timer.all_times[2:]
    assert len(timer.cpu_times) == 3 and all(t >= 0 for t in timer.cpu_times)
    with pytest.raises(AssertionError):
        timer.stop()


# ---------------------------------------------------------------------------------------------------------- memory


def test_activation_counter_on_a_known_model() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with ActivationCounter(mlp) as acts:
        mlp(torch.randn(3, 8)).sum().backward()
    # Saved: the input of the first Linear (3x8) and the ReLU output (3x16), which the second Linear also saves (one
    # storage); not the second Linear's weight.t() (a view of a parameter).
    assert acts.saved_bytes == (3 * 8 + 3 * 16) * 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_activation_counter_with_checkpointing() -> None:
    blocks = nn.Sequential(_Block(), _Block(), _Block())
    x = torch.randn(3, 8)
    with ActivationCounter(blocks) as plain:
        blocks(x).sum().backward()
    # Per block, the Linear input (= previous ReLU output) and the ReLU output: x, out1, out2, out3.
    assert plain.saved_bytes == 4 * 3 * 8 * 4
    for block in blocks:
        checkpoint(block)
    with ActivationCounter(blocks) as ckpt:
        blocks(x).sum().backward()
    # Only the inputs each checkpoint keeps to recompute from: x, out1, out2.
    assert ckpt.saved_bytes == 3 * 3 * 8 * 4


# ---------------------------------------------------------------------------------------------------------- comm


def _record(op: str, sent: int, cross: int = 0, ranks: tuple[int, ...] = (0, 1), phase: str = "forward") -> CommRecord:
    return CommRecord(
        op=op,
        api="c10d",
        group_size=len(ranks),
        group_ranks=ranks,
        rank=0,
        dtype=torch.float32,
        tensor_bytes=2 * sent,
        sent_bytes=sent,
        cross_node_bytes=cross,
        phase=phase,
        async_op=False,
    )


def test_comm_breakdown_groups_by_op_group_phase_and_dtype() -> None:
    records = [
        _record("all_gather_into_tensor", 100),
        _record("all_gather_into_tensor", 50),
        _record("all_gather_into_tensor", 70, phase="backward"),
        _record("all_reduce", 8, cross=4, ranks=(0, 2)),
    ]
    assert group_label(records[-1]) == "2:[0,2]"
    rows = comm_breakdown(records)
    assert [(r["op"], r["phase"], r["group"], r["count"], r["sent_bytes"]) for r in rows] == [
        ("all_gather_into_tensor", "forward", "2:[0,1]", 2, 150),
        ("all_gather_into_tensor", "backward", "2:[0,1]", 1, 70),
        ("all_reduce", "forward", "2:[0,2]", 1, 8),
    ]
    assert rows[0]["dtype"] == "float32" and rows[0]["tensor_bytes"] == 300
    assert comm_totals(rows) == {"count": 4, "tensor_bytes": 456, "sent_bytes": 228, "cross_node_bytes": 4}


# ---------------------------------------------------------------------------------------------------------- workloads


def test_workload_registry_and_availability() -> None:
    names = [w.name for w in WORKLOADS]
    assert len(names) == len(set(names))
    assert {"fsdp2", "mp_fsdp", "raw_fsdp", "ddp", "tensor_parallel", "mp_tp", "zeropp"} <= set(names)
    for ours, base in TIME_COMPARISONS:
        assert ours in BY_NAME and base in BY_NAME
    assert availability(BY_NAME["fsdp2"]) is None and availability(BY_NAME["ddp"]) is None
    assert availability(BY_NAME["mp_fsdp"]) is None
    missing = Workload("x", "registered", "zero3", "not a strategy", strategy="no_such_strategy_name")
    assert "not available in this build" in availability(missing)
    assert layout_for(4).num_nodes == 2 and layout_for(4).ranks_per_node == 2
    assert layout_for(2).num_nodes == 1 and layout_for(1).ranks_per_node == 1
    assert layout_for(4, "cuda").num_nodes == 1  # on CUDA every rank needs its own GPU: no simulated nodes


def test_a_cuda_benchmark_with_more_ranks_than_gpus_is_refused_up_front():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit, match=f"needs one GPU per rank, and {gpus} GPU\\(s\\) are visible"):
        choose_device("cuda", [1, gpus + 1])
    assert choose_device("cpu", [gpus + 4]) == "cpu"
    assert choose_device("auto", [1]) == ("cuda" if gpus else "cpu")


# ---------------------------------------------------------------------------------------------------------- report


def _comm(op: str, group: str, phase: str, count: int, sent: int, cross: int = 0) -> dict[str, Any]:
    return {"op": op, "group": group, "phase": phase, "dtype": "float32", "count": count, "tensor_bytes": 2 * sent,
            "sent_bytes": sent, "cross_node_bytes": cross}  # fmt: skip


def _known_results() -> dict[str, Any]:
    """A hand-made result set: P = 1000 parameters (800 in blocks), N = 4 on 2 nodes x 2 ranks, fp32."""
    state4 = {"parameters": 1000, "gradients": 1000, "optimizer_state": 2000, "buffers": 0, "total": 4000}
    measure = {"mode": "measure", "size": "s", "world_size": 4, "num_nodes": 2, "parallel": "dp_shard=4",
               "peak_memory": {"rss_at_step_start": 100 * 2**20, "peak_rss": 103 * 2**20, "cuda": None}}  # fmt: skip
    runs = [
        {**measure, "workload": "fsdp2", "state": state4, "activations": {"saved_bytes": 4096},
         "comm": [_comm("all_gather_into_tensor", "4:[0,1,2,3]", "forward", 2, 3000, 2000),
                  _comm("all_gather_into_tensor", "4:[0,1,2,3]", "backward", 1, 2400, 1600),
                  _comm("reduce_scatter_tensor", "4:[0,1,2,3]", "backward", 2, 3000, 2000)]},
        {**measure, "workload": "fsdp2_ac", "state": state4, "activations": {"saved_bytes": 1024},
         "comm": []},
        {**measure, "workload": "zeropp", "state": {**state4, "parameters": 1100}, "activations": {"saved_bytes": 1},
         "comm": [_comm("all_gather_into_tensor", "4:[0,1,2,3]", "forward", 2, 1000, 500),
                  _comm("all_to_all_single", "4:[0,1,2,3]", "backward", 2, 1000, 500)]},
        {**measure, "workload": "ddp", "error": "RuntimeError: boom"},
    ]  # fmt: skip
    for repeat, (a, b) in enumerate([(1.0, 1.0), (1.2, 1.0), (0.9, 1.0)]):
        runs.append({"mode": "time", "workload": "fsdp2", "size": "s", "world_size": 4, "repeat": repeat,
                     "step_times": [a, a, a], "step_cpu_times": [a / 2] * 3})  # fmt: skip
        runs.append({"mode": "time", "workload": "mp_fsdp", "size": "s", "world_size": 4, "repeat": repeat,
                     "step_times": [b, 5 * b, b], "step_cpu_times": [b / 4] * 3})  # fmt: skip
    workloads = {
        w.name: {"description": w.description, "family": w.family, "available": True, "reason": None} for w in WORKLOADS
    }
    workloads["tensor_parallel"].update(available=False, reason="not available in this build (test)")
    return {
        "meta": {"command": "python -m benchmarks.run --test", "started": "now", "elapsed_s": 1.0, "torch": "t",
                 "lightning": "l", "device": "cpu", "device_name": "CPU", "cpu_count": 2, "peak_flops": None},
        "config": {"sizes": ["s"], "timing_sizes": ["s"], "repeats": 3, "warmup": 1, "steps": 3, "batch_size": 2,
                   "precision": "32-true", "param_bytes": 4},
        "sizes": {"s": {"d_model": 8, "n_layer": 2, "n_head": 2, "vocab_size": 10, "seq_len": 4,
                        "num_parameters": 1000, "block_parameters": 800}},
        "world_sizes": [4],
        "layouts": {"4": {"world_size": 4, "num_nodes": 2, "ranks_per_node": 2}},
        "workloads": workloads,
        "comparisons": [["fsdp2", "mp_fsdp"], ["tensor_parallel", "mp_tp"]],
        "launch_errors": {},
        "runs": runs,
    }  # fmt: skip


def test_analysis_of_a_known_result_set() -> None:
    results = _known_results()
    analysis = analyze(results)
    (time_row, tp_row) = analysis["overhead"]
    # Per-repeat medians: ours 1.0, 1.2, 0.9; baseline 1.0 each (the 5x outlier step is not the median).
    assert time_row["ratio_of_medians"] == pytest.approx(1.0)
    assert (time_row["pair_min"], time_row["pair_max"]) == (pytest.approx(0.9), pytest.approx(1.2))
    assert time_row["met"] is True and time_row["n"] == 3
    assert time_row["cpu"]["ratio_of_medians"] == pytest.approx(2.0)  # CPU seconds: a/2 against b/4
    assert (time_row["cpu"]["pair_min"], time_row["cpu"]["pair_max"]) == (pytest.approx(1.8), pytest.approx(2.4))
    assert tp_row["status"].startswith("tensor_parallel: not available in this build")

    memory = {r["workload"]: r for r in analysis["memory"]}
    assert memory["fsdp2"]["full"] == 16000 and memory["fsdp2"]["ideal"] == 4000
    assert memory["fsdp2"]["ratio_to_ideal"] == 1.0 and memory["fsdp2"]["met"] is True
    assert memory["zeropp"]["ratio_to_ideal"] == pytest.approx(4100 / 4000) and memory["zeropp"]["met"] is True
    assert memory["fsdp2"]["peak_increase"] == 3 * 2**20
    assert "ddp" not in memory  # failed runs are listed, not tabulated

    (acts,) = analysis["activations"]
    assert (acts["without_ac"], acts["with_ac"], acts["ratio"]) == (4096, 1024, 0.25)

    comm = {r["workload"]: r for r in analysis["comm"]}
    assert comm["fsdp2"]["sent"] == 8400 and comm["fsdp2"]["cross_node"] == 5600 and comm["fsdp2"]["collectives"] == 5
    assert comm["fsdp2"]["theory_sent"] == theory.zero3_bytes(1000, 4, FP32) == 9000
    assert comm["fsdp2"]["ratio_to_theory"] == pytest.approx(8400 / 9000)
    assert comm["fsdp2"]["theory"]["FSDP2 (root kept gathered)"] == theory.fsdp2_exact_bytes(800, 200, 4, FP32)
    assert comm["fsdp2"]["cross_ratio_to_theory"] == pytest.approx(5600 / 6000)
    assert comm["zeropp"]["cross_vs_fsdp2"] == pytest.approx(1000 / 5600)
    assert comm["zeropp"]["met"] is True and comm["zeropp"]["expected_vs_fsdp2"] == 0.125
    assert comm["zeropp"]["cross_ratio_to_theory"] == pytest.approx(1000 / 750)

    (tput,) = [r for r in analysis["throughput"] if r["workload"] == "fsdp2"]
    assert tput["tokens_per_s_per_device"] == "not measured (CPU)" and tput["mfu"] == "not measured (CPU)"


def test_markdown_report_states_targets_gaps_and_failures() -> None:
    results = _known_results()
    text = to_markdown(results)
    assert "`fsdp2` / `mp_fsdp` | **1.000**" in text
    assert "| 2.000 (1.800 – 2.400) |" in text
    assert "≤ 1.05 ✅ met" in text
    assert "tensor_parallel: not available in this build (test)" in text
    assert "`ddp` s N=4 (measure): RuntimeError: boom" in text
    assert "zeropp cross-node bytes ≤ 0.3 of fsdp2: s N=4: 0.179 ✅ met" in text
    assert "not measured (CPU)" in text
    # A missed target is reported as missed, with the figure.
    for run in results["runs"]:
        if run["mode"] == "time" and run["workload"] == "fsdp2":
            run["step_times"] = [2.0, 2.0, 2.0]
    assert "❌ missed in 1 of 1 configurations (ratios N=4 s: 2.000" in to_markdown(results)


def test_report_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    results = _known_results()
    message = plot(results, analyze(results), tmp_path / "x.png")
    assert message is not None and "matplotlib is not installed" in message
    paths = write_report(results, tmp_path)
    assert "plot" not in paths and not (tmp_path / "scaling.png").exists()
    assert "no plot: matplotlib is not installed" in paths["report"].read_text()


# ---------------------------------------------------------------------------------------------------------- smoke


@pytest.mark.slow
def test_benchmark_smoke_run(tmp_path: Path) -> None:
    """The real suite on the tiny GPT over 2 ranks: bytes and state match the closed-form theory exactly."""
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path), "--world-sizes", "2", "--accelerator", "cpu",
           "--sizes", "tiny", "--repeats", "1", "--warmup", "1", "--steps", "2", "--workloads", "fsdp2,mp_fsdp,raw_fsdp,ddp"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads((tmp_path / "results.json").read_text())
    report = (tmp_path / "report.md").read_text()
    assert all("error" not in r for r in results["runs"]), [r.get("error") for r in results["runs"]]

    size = SIZES["tiny"]
    params = size.num_parameters
    blocks = params - (2 * size.vocab_size * size.d_model + size.seq_len * size.d_model + 2 * size.d_model)
    measured = {r["workload"]: r for r in results["runs"] if r["mode"] == "measure"}
    loss_allreduce = 4 * 2 * 1 // 2  # the logged fp32 loss, all-reduced over 2 ranks: 2*(n-1)/n * 4 bytes

    def sent(name: str) -> int:
        return sum(c["sent_bytes"] for c in measured[name]["comm"])

    exact = theory.fsdp2_exact_bytes(blocks, params - blocks, 2, FP32)
    assert sent("mp_fsdp") - loss_allreduce == exact
    assert sent("raw_fsdp") - loss_allreduce == exact
    # fsdp2 matches, or re-gathers the root's parameters once more in backward (see the report's notes).
    assert sent("fsdp2") - loss_allreduce in (exact, exact + (params - blocks) * 4 / 2)
    ddp_allreduce = sum(c["sent_bytes"] for c in measured["ddp"]["comm"] if c["op"] == "all_reduce")
    assert ddp_allreduce - loss_allreduce == theory.ddp_bytes(params, 2, FP32)
    for name in ("fsdp2", "mp_fsdp", "raw_fsdp"):  # every parameter shards evenly over 2 ranks: exactly 1/2
        state = measured[name]["state"]
        assert state["parameters"] == state["gradients"] == params * 4 // 2
        assert state["optimizer_state"] - 2 * params * 4 // 2 == 4 * len(list(GPT(**size.gpt_kwargs()).parameters()))
    assert measured["ddp"]["state"]["parameters"] == params * 4
    timed = [r for r in results["runs"] if r["mode"] == "time"]
    assert {r["workload"] for r in timed} == {"fsdp2", "mp_fsdp", "raw_fsdp", "ddp"}
    assert all(len(r["step_times"]) == len(r["step_cpu_times"]) == results["config"]["steps"] for r in timed)
    assert "| tiny | 2 | `fsdp2` / `mp_fsdp` | **" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot: matplotlib is not installed" in report
    else:
        assert (tmp_path / "scaling.png").stat().st_size > 0


def test_performance_section_replaces_only_the_marked_block(tmp_path: Path) -> None:
    from benchmarks.suite import SECTION_END, SECTION_START, performance_section, update_performance_doc

    results = _known_results()
    section = performance_section(results)
    assert section.startswith(SECTION_START) and section.endswith(SECTION_END)
    assert "`fsdp2` / `mp_fsdp` | **1.000**" in section and "python -m benchmarks.run --test" in section
    doc = tmp_path / "performance.md"
    doc.write_text(f"# title\n\nbefore\n{SECTION_START}\nold table\n{SECTION_END}\nafter\n")
    assert update_performance_doc(results, doc)
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# title\n\nbefore\n") and text.endswith("\nafter\n")
    assert text.count(SECTION_START) == 1 and "`fsdp2` / `mp_fsdp`" in text
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    assert not update_performance_doc(results, plain) and plain.read_text() == "no markers\n"


def test_tensor_parallel_bytes_against_megatron() -> None:
    results = _known_results()
    # Model "s": L=2, B=2 per rank, S=4, H=8, fp32: one activation all-reduce over t=4 ranks sends
    # 2*(3/4)*(2*4*8*4) = 384 bytes; Megatron's 4 per block over 2 blocks: 3072 bytes per step.
    results["runs"].append(
        {**results["runs"][0], "workload": "mp_tp",
         "comm": [_comm("all_reduce", "4:[0,1,2,3]", "forward", 4, 1536),
                  _comm("all_reduce", "4:[0,1,2,3]", "backward", 8, 3072),
                  {**_comm("all_reduce", "4:[0,1,2,3]", "forward", 1, 6), "tensor_bytes": 4}]}
    )  # fmt: skip
    (row,) = [r for r in analyze(results)["comm"] if r["workload"] == "mp_tp"]
    assert row["tp_size"] == 4  # read off the measured groups, not the 2 ranks per node
    assert row["tp_allreduce_sent"] == 1536 + 3072 + 6
    assert row["theory"]["Megatron 4 all-reduces/block"] == 3072
    assert row["theory"]["unfused q,k,v: 6/block"] == 4608
    assert row["ratio_to_theory"] == pytest.approx((4608 + 6) / 3072)


def test_memory_table_shows_cuda_peaks_when_measured() -> None:
    from benchmarks.suite import memory_rows, memory_table

    results = _known_results()
    assert "CUDA max allocated" not in memory_table(memory_rows(results))
    results["runs"][0]["peak_memory"]["cuda"] = {"max_allocated": 5 * 2**20}
    table = memory_table(memory_rows(results))
    assert "CUDA max allocated MiB" in table and "| 5.0 |" in table


def test_checkpoint_integrity_benchmark_times_both_sides() -> None:
    from benchmarks.studies import measure_checksum_cost as measure

    result = measure(mib=8, repeats=1)
    assert result["save_with_checksums_s"] > 0 and result["save_plain_s"] > 0 and result["load_plain_s"] > 0
    assert result["save_ratio"] == result["save_with_checksums_s"] / result["save_plain_s"]
    assert result["load_ratio"] == result["load_verified_s"] / result["load_plain_s"]


def test_lora_finetune_benchmark_runs_the_loop_and_loads_every_folder(tmp_path: Path) -> None:
    """A smoke run of ``python -m benchmarks.lora_finetune`` (one layer): every step timed, its peak measured, the
    bf16 export half the fp32 one."""
    from benchmarks.studies import run_lora_finetune

    out = tmp_path / "lora.json"
    assert (
        run_lora_finetune(["--layers", "1", "--hidden", "64", "--vocab", "200", "--steps", "1", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 4 and all(s["seconds"] > 0 and s["peak_bytes"] > 0 for s in result["steps"].values())
    sizes = result["bytes"]
    assert sizes["merged --dtype bfloat16"] * 2 == sizes["merged (as trained, fp32)"] > 0
    assert result["initial_weights_seconds"] is not None and result["export_at_fit_end_seconds"] is not None


# ---------------------------------------------------------------------------------------------------------- pipeline


def _small_gpt() -> GPT:
    return GPT(vocab_size=16, seq_len=8, d_model=16, n_layer=4, n_head=2)


def test_pipeline_benchmark_counts_each_ranks_parameters_exactly() -> None:
    from benchmarks.studies import bytes_per_rank

    counted = bytes_per_rank(sizes=(2, 4), schedules=(("1f1b", "auto"), ("1f1b", "even")), build=_small_gpt)
    model = _small_gpt()
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert counted["whole"] == whole
    for (split, pp), rows in _group(counted["rows"]).items():
        assert [r["rank"] for r in rows] == list(range(pp))
        assert sum(r["bytes"] for r in rows) == whole  # no tied weights: every parameter on exactly one rank
        for row in rows:  # each rank's bytes, counted again from the unchanged model's modules of its stages
            names = [n.strip() for n in row["modules"].split(",")]
            assert row["bytes"] == sum(_module_bytes(model, name) for name in names), (split, pp, row)
    even4 = {r["rank"]: r["modules"] for r in counted["rows"] if r["split"] == "even" and r["pp"] == 4}
    assert even4 == {0: "tok_emb, pos_emb, blocks.0", 1: "blocks.1", 2: "blocks.2", 3: "blocks.3, ln_f, head"}


def _group(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault((row["split"], row["pp"]), []).append(row)
    return out


def _module_bytes(model: nn.Module, name: str) -> int:
    """Bytes of ``name`` (``blocks.1-3`` is a range of blocks), counted on the whole model."""
    if name.startswith("blocks.") and "-" in name:
        first, last = map(int, name.removeprefix("blocks.").split("-"))
        return sum(_module_bytes(model, f"blocks.{i}") for i in range(first, last + 1))
    return sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters())


def _bubble_worker(rank: int, port: int, out: str) -> None:
    from benchmarks.studies import measure_bubble

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = measure_bubble(rank, 2, 4, steps=1, schedules=["1f1b", "zbv_zero_bubble"], build=_small_gpt)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def test_pipeline_bubble_instrument_on_two_processes(tmp_path: Path) -> None:
    """The benchmark's bubble instrument on 2 real gloo processes (tiny GPT, one timed step per schedule)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "bubble.json"
    mp.start_processes(_bubble_worker, args=(port, str(out)), nprocs=2, join=True, start_method="fork")
    result = json.loads(out.read_text())
    assert result["1f1b"]["formula"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1) with p=2, m=4
    assert result["zbv_zero_bubble"]["formula"] == pytest.approx(1 / 9)  # the interleaved figure, v=2, shown for scale
    assert result["zbv_zero_bubble"]["stages_per_rank"] == 2
    for row in result.values():
        assert len(row["per_rank"]) == 2 and all(0 <= x < 1 for x in row["per_rank"]) and row["step_ms"] > 0
        assert row["measured"] == pytest.approx(sum(row["per_rank"]) / 2)


def test_pipeline_benchmark_tables_from_a_known_result() -> None:
    from benchmarks.studies import pipeline_markdown as to_markdown

    bubble = {"measured": 0.25, "per_rank": [0.3, 0.2], "step_ms": 10.0, "formula": 0.2, "stages_per_rank": 1}
    times = {"pipeline": {"wall": [0.2, 0.3, 0.2], "cpu": [0.2, 0.2, 0.2]},
             "ddp": {"wall": [0.1, 0.1, 0.1], "cpu": [0.1, 0.1, 0.1]}}  # fmt: skip
    result = {
        "world": 2, "load_start": "1.00, 1.00, 1.00", "load_end": "2.00, 2.00, 2.00",
        "bubble": {"4": {"1f1b": bubble, "zbv_zero_bubble": {**bubble, "formula": 1 / 9, "stages_per_rank": 2},
                         "dualpipev": {"error": "m too small", "stages_per_rank": 2}}},
        "bytes": {"whole": 100, "rows": [{"schedule": "1f1b", "split": "auto", "pp": 2, "rank": r, "stages": [r],
                                          "modules": "m", "bytes": 50} for r in range(2)]},
        "held_by_trainer": {"pipeline": [50, 50]}, "microbatches": {"pipeline": 4}, "times": times,
        "config": {"bubble_steps": 1, "microbatch_size": 2, "global_batch": 16, "warmup": 1, "steps": 3, "repeats": 3,
                   "cpus": 2},
    }  # fmt: skip
    table = to_markdown(result)
    assert "| `1f1b` | 1 | 4 | **25.0%** | 20.0% | (p−1)/(m+p−1) | 30.0% / 20.0% | 10.0 |" in table
    assert "| `zbv_zero_bubble` | 2 | 4 | **25.0%** | ≈ 0 (11.1%) |" in table
    assert "| `dualpipev` | 2 | 4 | not run: m too small |" in table
    assert "| `1f1b` | auto | 2 | 1 | 1 | m | 50 | **0.500** | 0.500 | 50 |" in table
    assert "| `pipeline` / `ddp` | **2.000** | 2.000 – 3.000 (n=3) | 200.0 | 100.0 | 2.000 |" in table
    assert "CPU/gloo — not a GPU figure" in table and "load average (1/5/15 min) 1.00, 1.00, 1.00" in table


def test_context_parallel_step_time_table_from_a_known_result() -> None:
    from benchmarks.studies import TIMED, TIMED_MODEL, time_markdown

    times = {name: {"wall": [0.6, 0.6], "cpu": [0.5, 0.5]} for name in TIMED}
    times["one_process"] = {"wall": [1.0, 1.2], "cpu": [1.0, 1.0]}
    result = {
        "times": times, "world": 2, "load_start": "0.50, 0.50, 0.50", "load_end": "0.70, 0.60, 0.50",
        "config": {"model": TIMED_MODEL, "global_batch": 4, "warmup": 1, "steps": 2, "repeats": 2, "cpus": 2},
    }  # fmt: skip
    table = time_markdown(result)
    assert (
        "| `context_parallel_ulysses` / `one_process` | **0.545** | 0.500 – 0.600 (n=2) | 600.0 | 1100.0 | 0.500 |"
        in table
    )
    assert "CPU/gloo — not a GPU figure" in table and "ideal ratio 0.5" in table
    assert table.count("/ `one_process` |") == 3
