"""Throughput figures of a training job: tokens/s for the job and per device, TFLOP/s per device and MFU.

Counting on a mesh: every data-parallel replica (``dp_replicate × dp_shard``) reads different samples, context
parallel ranks each hold a different slice of the same samples' sequences, and tensor- and pipeline-parallel ranks
share their samples. So the job's tokens per step are the tokens one rank holds × replicas × context-parallel
shards, and its FLOPs are divided by every device of the job (``world_size``), whatever it does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

#: Batch keys tried first for the token ids (a Hugging Face or example-GPT batch).
TOKEN_KEYS = ("input_ids", "idx", "tokens")


def token_ids(batch: Any) -> Tensor | None:
    """The token ids of a batch: the entry named in :data:`TOKEN_KEYS` of a mapping, else the first integer tensor
    of two or more dimensions (``[batch, seq, ...]``) found depth-first; ``None`` when there is none."""
    if isinstance(batch, Mapping):
        for key in TOKEN_KEYS:
            if isinstance(batch.get(key), Tensor) and batch[key].dim() >= 2:
                return batch[key]
        batch = list(batch.values())
    if isinstance(batch, Tensor):
        floating = batch.is_floating_point() or batch.is_complex()
        return batch if batch.dim() >= 2 and not floating and batch.dtype.is_signed else None
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = token_ids(item)
            if found is not None:
                return found
    return None


def first_tensor(batch: Any) -> Tensor | None:
    """The first tensor of a batch (a tensor, or one inside mappings, lists and tuples), depth-first."""
    if isinstance(batch, Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((t for t in map(first_tensor, items) if t is not None), None)


def throughput_figures(
    tokens: float,
    seconds: float,
    devices: int,
    flops_per_token: float | None = None,
    peak_tflops: float | None = None,
) -> dict[str, float]:
    """Figures of ``tokens`` (the whole job's) processed in ``seconds`` by ``devices`` devices.

    Returns:
        ``tokens_per_s`` (the job), ``tokens_per_s_per_device``; with ``flops_per_token`` also
        ``tflops_per_device`` (model FLOPs: recomputation by activation checkpointing is not counted); with
        ``peak_tflops`` (per device, dense) also ``mfu``, the fraction of that peak.
    """
    job = tokens / seconds
    out = {"tokens_per_s": job, "tokens_per_s_per_device": job / devices}
    if flops_per_token is not None:
        out["tflops_per_device"] = job * flops_per_token / devices / 1e12
        if peak_tflops:
            out["mfu"] = out["tflops_per_device"] / peak_tflops
    return out
