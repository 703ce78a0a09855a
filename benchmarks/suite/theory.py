"""Textbook per-rank, per-optimizer-step communication and memory figures the measurements are compared with.

Every byte figure here is *sent bytes of one rank*, the same quantity the comm counter's ``sent_bytes`` measures
(:mod:`lightning_dist.profiling.comm_traffic`): for an all-gather or reduce-scatter of ``X`` bytes in total over ``n`` ranks
a rank sends ``X·(n-1)/n`` (ring or direct exchange), for an all-reduce of ``X`` bytes ``2X·(n-1)/n``. Cross-node
bytes use the counter's direct-exchange model: of what a rank sends in a uniform collective, the fraction
``(n - r)/n`` goes to the ``n - r`` ranks on other nodes (``r`` ranks per node).

Formulas (``M`` = parameter bytes at the communication dtype, ``P`` = parameter count, ``n`` = sharding group size):

* ZeRO-3 / FSDP (``zero3``): ``3M·(n-1)/n`` — all-gather in forward, all-gather again in backward, reduce-scatter of
  gradients (ZeRO paper; ZeRO++ paper §2).
* FSDP2 as applied by ``fsdp2`` and the hand-written baselines (``fsdp2_exact``): ``(3·M_blocks + 2·M_root)·(n-1)/n``
  — the root module (embeddings, final norm, head) keeps its parameters gathered from forward to backward
  (``reshard_after_forward=False`` for the root, FSDP2's own default), so it is gathered once, not twice.
* DDP (``ddp``): ``2M·(n-1)/n`` — one all-reduce of the gradients.
* ZeRO++ cross-node (``zeropp_cross_node``): qwZ int8 forward all-gather (1 byte per parameter), hpZ backward
  all-gather inside the node (0 cross-node), qgZ int4 gradient exchange (0.5 byte per parameter): ``1.5·P`` bytes of
  collective payload, times the cross-node fraction. In the paper's fp16 units that is ``0.5M + 0 + 0.25M = 0.75M``
  against ZeRO-3's ``3M``; against an fp32 ZeRO-3 baseline (this suite on CPU) the expected ratio is
  ``1.5 / (3·4) = 0.125`` (fp16/bf16 baseline: ``0.25``). Scales and padding are not included.
* Tensor parallel (``tensor_parallel``, Megatron-LM): per transformer block 2 all-reduces of the ``B·S·H``
  activations in forward (after the attention output and MLP down projections) and 2 in backward (gradients of the
  inputs of the column-parallel projections), each sending ``2·(t-1)/t·B·S·H·b`` bytes per rank: ``L·4·2(t-1)/t·BSHb``
  in all. A model with *separate* q/k/v projections (the example GPT) all-reduces the gradient of each of them in
  backward with DTensor (3 instead of 1), so ``tensor_parallel_unfused_qkv`` counts ``2 + 4 = 6`` all-reduces per
  block.

Memory: sharded state (parameters, gradients, optimizer state) ideally takes ``1/n`` of the unsharded bytes per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


def _ring(n: int) -> Fraction:
    return Fraction(n - 1, n) if n > 0 else Fraction(0)


def cross_node_fraction(n: int, ranks_per_node: int | None) -> Fraction:
    """Fraction of a rank's uniform collective traffic addressed to other nodes: ``(n - r)/n`` (0 on one node)."""
    if ranks_per_node is None or ranks_per_node >= n:
        return Fraction(0)
    return Fraction(n - ranks_per_node, n)


@dataclass(frozen=True)
class CommDtypes:
    """Bytes per element of what FSDP/DDP communicate: gathered parameters and reduced gradients."""

    gather: int
    reduce: int


def comm_dtypes(precision: str) -> CommDtypes:
    """Communication element sizes of a Lightning precision flag with FSDP2's mixed-precision policy: ``*-mixed``
    gathers 16-bit parameters and reduces fp32 gradients; ``*-true`` communicates in the parameter dtype."""
    if precision.endswith("-mixed"):
        return CommDtypes(gather=2, reduce=4)
    if precision.startswith(("bf16", "16")):
        return CommDtypes(gather=2, reduce=2)
    if precision.startswith("64"):
        return CommDtypes(gather=8, reduce=8)
    return CommDtypes(gather=4, reduce=4)


def zero3_bytes(num_params: int, n: int, dtypes: CommDtypes) -> float:
    """ZeRO-3 per-rank sent bytes per step: ``3M·(n-1)/n`` (two parameter all-gathers, one gradient
    reduce-scatter; ``M`` at each one's dtype)."""
    return float((2 * dtypes.gather + dtypes.reduce) * num_params * _ring(n))


def fsdp2_exact_bytes(block_params: int, root_params: int, n: int, dtypes: CommDtypes) -> float:
    """FSDP2 with resharded blocks and a root kept gathered: ``(2·M_blocks + M_root)`` gathered, ``M`` reduced."""
    gathered = (2 * block_params + root_params) * dtypes.gather
    return float((gathered + (block_params + root_params) * dtypes.reduce) * _ring(n))


def ddp_bytes(num_params: int, n: int, dtypes: CommDtypes) -> float:
    """DDP per-rank sent bytes per step: one gradient all-reduce, ``2M·(n-1)/n``."""
    return float(2 * dtypes.reduce * num_params * _ring(n))


def zero3_cross_node_bytes(num_params: int, n: int, ranks_per_node: int | None, dtypes: CommDtypes) -> float:
    """ZeRO-3 cross-node bytes: ``3M · (n - r)/n``."""
    return float((2 * dtypes.gather + dtypes.reduce) * num_params * cross_node_fraction(n, ranks_per_node))


def zeropp_cross_node_bytes(num_params: int, n: int, ranks_per_node: int | None) -> float:
    """ZeRO++ cross-node bytes: ``(1 + 0 + 0.5)·P · (n - r)/n`` (int8 qwZ, hpZ, int4 qgZ)."""
    return float(Fraction(3, 2) * num_params * cross_node_fraction(n, ranks_per_node))


def zeropp_over_zero3(dtypes: CommDtypes) -> float:
    """Expected ZeRO++ / ZeRO-3 cross-node byte ratio: ``1.5 / (2·gather + reduce)`` bytes per parameter (0.25 for
    a 16-bit baseline — the paper's 0.75M/3M — and 0.125 for fp32)."""
    return 1.5 / (2 * dtypes.gather + dtypes.reduce)


def tensor_parallel_bytes(
    n_layer: int, batch: int, seq_len: int, d_model: int, element_bytes: int, t: int, all_reduces_per_block: int = 4
) -> float:
    """Tensor-parallel per-rank sent bytes per step: ``L · k · 2(t-1)/t · B·S·H·b`` with ``k`` all-reduces per block
    (Megatron-LM: ``k = 4``, two forward and two backward)."""
    activation = batch * seq_len * d_model * element_bytes
    return float(n_layer * all_reduces_per_block * 2 * activation * _ring(t))


def ideal_sharded_bytes(full_bytes: int, n: int) -> float:
    """Per-rank bytes of state sharded perfectly over ``n`` ranks: ``full / n``."""
    return full_bytes / n
