"""CUDA tests: one process on one GPU each. They skip, saying so, where no GPU is visible (this CPU CI machine);
run them on a GPU machine with ``python -m pytest -q -m cuda``."""

from __future__ import annotations

import pytest
import torch
from launch import run_scenarios

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible on this machine"),
]


def _resumed_matches(result: dict) -> float:
    straight, resumed = result["straight"]["losses"], result["resumed"]["losses"]
    assert len(straight) == 6 and len(resumed) == 3
    return max(abs(a - b) for a, b in zip(straight[3:], resumed))


def test_fsdp2_bf16_mixed_trains_and_resumes_exactly_from_the_async_plugin_with_pinned_memory(tmp_path):
    result = run_scenarios("cuda_runs.py", 1, tmp_path, ["bf16_async_resume"])["bf16_async_resume"]
    assert _resumed_matches(result) == 0.0
    assert result["straight"]["placement"]["parameters"] == ["cuda"]


def test_fsdp2_cpu_offload_keeps_state_on_the_cpu_trains_and_resumes(tmp_path):
    result = run_scenarios("cuda_runs.py", 1, tmp_path, ["offload_resume"])["offload_resume"]
    assert _resumed_matches(result) == 0.0
    placement = result["straight"]["placement"]
    assert placement["parameters"] == ["cpu"] and placement["gradients"] == ["cpu"]
    assert placement["optimizer_state"] == ["cpu"]
    assert result["straight"]["peak_cuda_bytes"] < result["without_offload_peak_cuda_bytes"]
    print(
        f"peak CUDA memory: offload {result['straight']['peak_cuda_bytes'] / 2**20:.1f} MiB,"
        f" no offload {result['without_offload_peak_cuda_bytes'] / 2**20:.1f} MiB"
    )


def test_fp16_mixed_skips_a_non_finite_step(tmp_path):
    result = run_scenarios("cuda_runs.py", 1, tmp_path, ["fp16_skip"])["fp16_skip"]
    assert result == {"skipped": 1, "unchanged": True}
