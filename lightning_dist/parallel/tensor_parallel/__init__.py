"""Tensor parallelism for unchanged models, pure PyTorch (no Lightning import).

A plan maps module names to styles (plain data, YAML-friendly); applying it shards the model over the tp mesh
dimension before FSDP2. Which file holds what:

- :mod:`.plan` — the plan's data model (:class:`TensorParallelPlan`, the styles, the sizes tp must divide).
- :mod:`.inference` — the automatic plan from a model's recognised structure (:func:`infer_plan`), and the
  resolution of explicit plans.
- :mod:`.apply` — :func:`resolve_plan` (explicit or automatic, validated), :func:`apply_tensor_parallel`, and the
  gradient helpers the strategies use on tp-sharded parameters.
- :mod:`.fused` — styles for Hugging Face ``Conv1D`` and fused query/key/value or ``[gate | up]`` projections (how
  each library orders a fused projection's rows: :mod:`lightning_dist.parallel.fused_layouts`, which model
  recognition reads too).
- :mod:`.multihead` — ``nn.MultiheadAttention`` split by heads; :mod:`.kv_heads` — fewer key/value heads than ranks.
- :mod:`.checkpoint_layout` — checkpoints keep a fused projection's original row order.
- :mod:`.loss_parallel` — cross-entropy over vocabulary-sharded logits.
"""

from lightning_dist.parallel.tensor_parallel.apply import (
    apply_tensor_parallel,
    build_style,
    parse_layout,
    resolve_plan,
    shard_gradients_like_parameters,
    tp_sharded_parameters,
)
from lightning_dist.parallel.tensor_parallel.checkpoint_layout import (
    copy_row_orders,
    install_optimizer_layout_hooks,
    permuted_parameters,
    to_checkpoint_order,
)
from lightning_dist.parallel.tensor_parallel.inference import infer_plan, resolve_explicit_plan
from lightning_dist.parallel.tensor_parallel.loss_parallel import (
    LossParallelError,
    VocabParallelCrossEntropy,
    check_local_loss,
    explain_loss_parallel_failure,
)
from lightning_dist.parallel.tensor_parallel.plan import STYLES, TensorParallelPlan, TensorParallelPlanError

__all__ = [
    "STYLES",
    "LossParallelError",
    "TensorParallelPlan",
    "TensorParallelPlanError",
    "VocabParallelCrossEntropy",
    "apply_tensor_parallel",
    "build_style",
    "check_local_loss",
    "copy_row_orders",
    "explain_loss_parallel_failure",
    "infer_plan",
    "install_optimizer_layout_hooks",
    "parse_layout",
    "permuted_parameters",
    "resolve_explicit_plan",
    "resolve_plan",
    "shard_gradients_like_parameters",
    "to_checkpoint_order",
    "tp_sharded_parameters",
]
