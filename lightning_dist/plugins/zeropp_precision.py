"""The precision plugin of :class:`~lightning_dist.ZeroPPStrategy`: FSDP2's, with a choice of gradient-reduce dtype."""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_dist.plugins.precision import FSDP2Precision, PrecisionFlag

ReduceDtype = Literal["fp32", "bf16", "fp16"]
_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroPPPrecision(FSDP2Precision):
    """:class:`~lightning_dist.FSDP2Precision` plus the dtype gradients are reduced in.

    With quantized gradients (qgZ) the wire format is int4/int8 whatever this dtype is: it is the dtype of the
    reduce-scatter's input, and the two hops accumulate in fp32 regardless. Without qgZ it is the dtype on the wire.
    ``reduce_dtype="bf16"`` with ``"bf16-mixed"`` gives a ZeRO-3 run that communicates in bf16 both ways (the
    baseline of the ZeRO++ paper's byte counts).

    Args:
        precision: As for :class:`~lightning_dist.FSDP2Precision`.
        reduce_dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``None``: fp32 for ``*-mixed``, else the parameters' dtype.
        init_scale: Initial loss scale for ``"16-mixed"``.
        growth_interval: Steps without overflow after which the ``"16-mixed"`` loss scale doubles.
    """

    def __init__(
        self,
        precision: PrecisionFlag = "32-true",
        reduce_dtype: ReduceDtype | None = None,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__(precision, init_scale=init_scale, growth_interval=growth_interval)
        if reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype={reduce_dtype!r} is not one of {list(_REDUCE_DTYPES)} (or None).")
        self.reduce_dtype = reduce_dtype

    @property
    @override
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self._with_reduce_dtype(super().mp_policy)

    @property
    @override
    def root_mp_policy(self) -> MixedPrecisionPolicy:
        return self._with_reduce_dtype(super().root_mp_policy)

    def _with_reduce_dtype(self, policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
        if self.reduce_dtype is None:
            return policy
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=_REDUCE_DTYPES[self.reduce_dtype],
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
