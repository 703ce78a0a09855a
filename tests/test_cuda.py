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


def _experts_case(transposed: bool, counts: list[int], dtype: torch.dtype, device: str, seed: int = 0):
    """One rank's stacked experts (Mixtral layout, or gpt-oss's transposed layout with biases) and rows for them."""
    from lightning_dist.parallel.expert_parallel.local_experts import StackedWeights

    g = torch.Generator().manual_seed(seed)
    experts, hidden, inner = len(counts), 256, 384
    gate_up_shape = (experts, hidden, 2 * inner) if transposed else (experts, 2 * inner, hidden)
    down_shape = (experts, inner, hidden) if transposed else (experts, hidden, inner)
    tensors = {
        "gate_up": torch.randn(gate_up_shape, generator=g) / hidden**0.5,
        "down": torch.randn(down_shape, generator=g) / inner**0.5,
        "gate_up_bias": torch.randn(experts, 2 * inner, generator=g) if transposed else None,
        "down_bias": torch.randn(experts, hidden, generator=g) if transposed else None,
    }
    rows = torch.randn(sum(counts), hidden, generator=g)
    leaves = {k: v.to(device, dtype).requires_grad_() for k, v in tensors.items() if v is not None}
    weights = StackedWeights(**{k: leaves.get(k) for k in tensors}, transposed=transposed)
    return rows.to(device, dtype).requires_grad_(), weights, leaves


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("transposed", [False, True], ids=["mixtral_layout", "gpt_oss_layout_with_biases"])
def test_grouped_gemm_local_experts_are_as_accurate_as_the_per_expert_loop(transposed):
    """bf16 on CUDA: expert parallel's grouped GEMM (experts with no rows included) against the per-expert loop,
    both measured against an fp64 computation from the same bf16 values, outputs and every gradient."""
    from lightning_dist.parallel.expert_parallel.local_experts import (
        grouped_gemm_ok,
        run_grouped_gemm,
        run_per_expert_loop,
    )

    counts = [37, 0, 129, 64, 1, 0, 250, 31]
    results = {}
    for name, fn, dtype in (
        ("grouped", run_grouped_gemm, torch.bfloat16),
        ("loop", run_per_expert_loop, torch.bfloat16),
        ("fp64", run_per_expert_loop, torch.float64),
    ):
        rows, weights, leaves = _experts_case(transposed, counts, torch.bfloat16, "cuda")
        if dtype == torch.float64:
            rows = rows.detach().double().requires_grad_()
            leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
            weights = type(weights)(
                **{k: leaves.get(k) for k in ("gate_up", "down", "gate_up_bias", "down_bias")}, transposed=transposed
            )
        else:
            assert grouped_gemm_ok(rows, weights) == (torch.cuda.get_device_capability() >= (8, 0))
        out = fn(rows, counts, weights, _swiglu)
        out.float().square().sum().backward()
        results[name] = {"out": out.detach().double(), "rows": rows.grad.double()}
        results[name].update({k: v.grad.double() for k, v in leaves.items()})
    for key in results["fp64"]:
        ref = results["fp64"][key]
        errors = {
            name: (results[name][key] - ref).abs().max().item() / ref.abs().max().item() for name in ("grouped", "loop")
        }
        print(f"{key}: relative error grouped {errors['grouped']:.2e}, loop {errors['loop']:.2e}")
        assert errors["grouped"] <= 2 * errors["loop"] + 1e-3, (key, errors)


def test_local_experts_with_no_rows_still_join_the_backward_on_cuda():
    from lightning_dist.parallel.expert_parallel.local_experts import run_local_experts

    rows, weights, leaves = _experts_case(False, [0, 0, 0, 0], torch.bfloat16, "cuda")
    out = run_local_experts(rows, [0, 0, 0, 0], weights, _swiglu)
    assert out.shape == (0, 256)
    out.sum().backward()
    assert all(v.grad is not None and v.grad.abs().max().item() == 0 for v in leaves.values())
