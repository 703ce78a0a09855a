"""FP8 training as a precision plugin: ``Trainer(plugins=[Float8Precision("rowwise")])``, the same as a strategy's
``float8="rowwise"`` option (see docs/float8.md)."""

from __future__ import annotations

from lightning_dist.parallel.float8 import Float8Recipe, check_float8_recipe, check_float8_skip
from lightning_dist.plugins.precision import FSDP2Precision, PrecisionFlag


class Float8Precision(FSDP2Precision):
    """:class:`~lightning_dist.FSDP2Precision` whose matmuls run in FP8 through torchao (``pip install
    'lightning-dist[fp8]'``).

    The strategy converts the model's ``nn.Linear`` layers before parallelizing it, exactly as its ``float8`` option
    does; weights, gradients and optimizer state stay in ``precision`` (the base precision: ``"32-true"`` or
    ``"bf16-mixed"``...). Giving both this plugin and a different ``float8`` strategy option is refused.

    Args:
        recipe: ``"rowwise"``, ``"tensorwise"`` (FP8 weight all-gather under FSDP2) or ``"mxfp8"`` (B200).
        precision: The base precision, as for :class:`~lightning_dist.FSDP2Precision`.
        skip: Linear layers left in the base precision: a qualified module name or a regex matched against the whole
            name, or a list of them (the output head is always skipped).
        init_scale: Initial loss scale for ``"16-mixed"``.
        growth_interval: Steps without overflow after which the ``"16-mixed"`` loss scale doubles.
    """

    def __init__(
        self,
        recipe: Float8Recipe = "rowwise",
        precision: PrecisionFlag = "32-true",
        skip: list[str] | str | None = None,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__(precision, init_scale=init_scale, growth_interval=growth_interval)
        if check_float8_recipe(recipe) is None:
            raise ValueError("Float8Precision(recipe=None): give a recipe, or use FSDP2Precision for no FP8.")
        #: Read by the strategy (``float8`` option) when it converts the model.
        self.float8: Float8Recipe = recipe
        self.float8_skip = check_float8_skip(skip)
