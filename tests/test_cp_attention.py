"""Context-parallel attention (pure PyTorch): layouts, block plans and kernels in this process; each algorithm
against full SDPA, the SDPA dispatch and the bytes sent in one 4-process gloo launch (cp=4 and two cp=2 groups)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from launch import run_scenarios
from torch.nn.functional import scaled_dot_product_attention as early_bound_sdpa

from lightning_dist.parallel.context_parallel.attention import bytes_per_layer
from lightning_dist.parallel.context_parallel.attention.blocks import block_tasks
from lightning_dist.parallel.context_parallel.attention.kernels import CPU_FLASH, MATH
from lightning_dist.parallel.context_parallel.attention.ulysses import UlyssesHeadsError, check_heads
from lightning_dist.parallel.context_parallel.dispatch import (
    ContextParallelAttention,
    ContextParallelAttentionError,
    check_sequence_length,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

FP64_TOL = 1e-10
FP32_TOL = 1e-5  # flash CPU kernel; one-process fp32 SDPA is ~1e-6 off fp64 on these inputs
BF16_TOL = 5e-2  # absolute, on O(1) values; and at most 1.5× one-process bf16 SDPA's error (checked below)


# ---------------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip_and_positions(layout, cp):
    seq = 8 * cp
    x = torch.arange(2 * seq * 3).view(2, seq, 3)
    shards = [shard_sequence(x, cp, rank, layout, dim=1) for rank in range(cp)]
    assert torch.equal(unshard_sequence(shards, layout, dim=1), x)
    positions = [local_positions(seq, cp, rank, layout) for rank in range(cp)]
    for shard, pos in zip(shards, positions):
        assert torch.equal(shard, x[:, pos])  # the positions name exactly the tokens of the shard
    assert sorted(torch.cat(positions).tolist()) == list(range(seq))


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert local_positions(16, 4, 1, "contiguous").tolist() == [4, 5, 6, 7]


def test_sequence_lengths_that_do_not_divide_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"divisible by 2·cp = 8, but it is 30 \(cp=4\).*multiple of 8 \(e.g. 32\)"):
        check_sequence_length(30, 4, "zigzag")
    with pytest.raises(ValueError, match=r"divisible by cp = 4, but it is 30 \(cp=4\)"):
        check_sequence_length(30, 4, "contiguous")
    with pytest.raises(ValueError, match="divisible by 2·cp"):
        shard_sequence(torch.zeros(1, 12), 4, 0, "zigzag")
    with pytest.raises(ValueError, match="Unknown context-parallel layout"):
        check_sequence_length(32, 4, "striped")
    check_sequence_length(32, 4, "zigzag")


# ---------------------------------------------------------------------------------------------------- block plans
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plans_cover_exactly_the_causal_mask(layout, cp):
    """For every (rank, source) pair, the block tasks mark exactly the (query, key) pairs with key ≤ query."""
    seq = 4 * cp
    local = seq // cp
    for rank, source in itertools.product(range(cp), repeat=2):
        q_pos, k_pos = local_positions(seq, cp, rank, layout), local_positions(seq, cp, source, layout)
        want = k_pos[None, :] <= q_pos[:, None]
        got = torch.zeros(local, local, dtype=torch.bool)
        for task in block_tasks(rank, source, local, layout, causal=True):
            block = torch.ones(task.q_rows.stop - task.q_rows.start, task.kv_cols.stop - task.kv_cols.start).bool()
            got[task.q_rows, task.kv_cols] |= block.tril() if task.causal else block
        assert torch.equal(got, want), (rank, source)


# ---------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize(("kernel", "dtype", "tol"), [(MATH, torch.float64, 1e-12), (CPU_FLASH, torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_equal_sdpa_with_their_own_lse(kernel, dtype, tol, causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, generator=gen, dtype=dtype) for _ in range(4))
    scale = 0.3
    out, lse = kernel.forward(q, k, v, causal, scale)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale)
    ref.backward(dout)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    assert (out - ref).abs().max() < tol
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert (got - want).abs().max() < tol


# ---------------------------------------------------------------------------------------------------- dispatch (one process)
def test_dispatch_refuses_masks_dropout_and_unknown_names_before_any_communication():
    context = ContextParallelAttention(group=None, algorithm="ring", layout="zigzag")
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ContextParallelAttentionError, match="explicit attn_mask.*Pass is_causal=True"):
        context.attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ContextParallelAttentionError, match="dropout_p=0.1.*Set the model's attention dropout to 0"):
        context.attention(q, q, q, None, 0.1)
    with pytest.raises(ValueError, match="Unknown context-parallel attention 'striped'"):
        ContextParallelAttention(None, "striped")
    with pytest.raises(ValueError, match="Unknown context-parallel layout"):
        ContextParallelAttention(None, "ring", "random")
    with pytest.raises(ValueError, match="explicit_masks='ignore'"):
        ContextParallelAttention(None, explicit_masks="ignore")


def test_only_self_attention_over_the_local_shard_is_accepted():
    context = ContextParallelAttention(group=None)
    with pytest.raises(ValueError, match="self-attention over this rank's sequence shard"):
        context.attention(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))


def test_ulysses_heads_must_divide_by_cp():
    check_heads(8, 4, 4)
    with pytest.raises(UlyssesHeadsError, match=r"query heads \(8\) and key/value heads \(2\).*cp=4"):
        check_heads(8, 2, 4)


def test_dispatch_patches_every_name_while_entered_and_restores_them():
    original = F.scaled_dot_product_attention
    context = ContextParallelAttention(group=None)
    with context:
        assert F.scaled_dot_product_attention == context.attention
        assert torch._C._nn.scaled_dot_product_attention == context.attention
        assert globals()["early_bound_sdpa"] == context.attention  # a module that imported it by name
        with pytest.raises(RuntimeError, match="not reentrant"), context:
            pass
    assert F.scaled_dot_product_attention is original
    assert torch._C._nn.scaled_dot_product_attention is original
    assert early_bound_sdpa is original


# ---------------------------------------------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> dict[str, Any]:
    return run_scenarios(
        "cp_attention_runs.py", 4, tmp_path_factory.mktemp("cp_attention"), ["kernels", "dispatch", "comm_bytes"]
    )


def _worst(errors: dict[str, float], prefix: str = "") -> float:
    return max(errors[f"{prefix}{name}"] for name in ("out", "dq", "dk", "dv"))


@pytest.mark.slow
def test_every_algorithm_equals_sdpa_in_fp64(cp_runs):
    """ring and allgather (zigzag, contiguous), ulysses (contiguous, zigzag) × causal/full × MHA/GQA × cp=2, 4."""
    fp64 = {name: errors for name, errors in cp_runs["kernels"].items() if name.endswith("float64")}
    assert len(fp64) == 2 * 3 * 2 * 2 * 2
    worst = {name: _worst(errors) for name, errors in fp64.items()}
    assert max(worst.values()) <= FP64_TOL, worst


@pytest.mark.slow
def test_fp32_and_bf16_are_as_close_to_fp64_as_one_process(cp_runs):
    for name, errors in cp_runs["kernels"].items():
        if name.endswith("float32"):
            assert _worst(errors) <= FP32_TOL, (name, errors)
        elif name.endswith("bfloat16"):
            assert _worst(errors) <= BF16_TOL, (name, errors)
            assert _worst(errors) <= 1.5 * _worst(errors, "plain_"), (name, errors)


@pytest.mark.slow
def test_dispatch_catches_every_spelling_with_activation_checkpoint_recompute(cp_runs):
    dispatch = cp_runs["dispatch"]
    for cp, algorithm, spelling in itertools.product(
        (2, 4), ("ring", "allgather", "ulysses"), ("F", "early_bound", "torch_C")
    ):
        assert dispatch[f"cp{cp}-{algorithm}-{spelling}-ac"]["grad"] <= FP64_TOL
    for cp, spelling in itertools.product((2, 4), ("F", "early_bound", "torch_C", "stored")):
        assert dispatch[f"cp{cp}-ring-{spelling}-noac"]["grad"] <= FP64_TOL
    for cp in (2, 4):  # explicit_masks="causal": a mask built over local shapes is replaced by global causality
        assert dispatch[f"cp{cp}-ring-explicit_causal_mask-ac"]["grad"] <= FP64_TOL
    # A reference to SDPA kept in an attribute is caught in forward only: its recompute fails loudly.
    for cp in (2, 4):
        assert dispatch[f"cp{cp}-ring-stored-ac"]["error"].startswith("CheckpointError")
    assert dispatch["restored"] is True
    assert all(dispatch["gathered_positions"])
    assert cp_runs["lightning_imported"] is False


@pytest.mark.slow
def test_dispatch_refusals_name_the_problem(cp_runs):
    refusals = cp_runs["dispatch"]["refusals"]
    assert refusals["attn_mask"].startswith("ContextParallelAttentionError: Context parallel attention got an explicit")
    assert "dropout_p=0.1" in refusals["dropout"]
    assert "query heads (6) and key/value heads (3) must both be divisible by cp=4" in refusals["ulysses_heads"]
    assert "enable_gqa=True" in refusals["gqa_without_enable_gqa"]


@pytest.mark.slow
def test_bytes_sent_per_layer_equal_the_formulas(cp_runs):
    measured = dict(cp_runs["comm_bytes"])
    shape = measured.pop("shape")
    assert len(measured) == 6  # three algorithms × fp32, bf16
    for name, counts in measured.items():
        algorithm, dtype = name.split("-")
        want = bytes_per_layer(algorithm, **shape, dtype=getattr(torch, dtype))
        assert sum(counts["forward"].values()) == want.forward, name
        assert sum(counts["backward"].values()) == want.backward, name
