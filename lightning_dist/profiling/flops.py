"""Training FLOPs per token of a transformer, read off the model (any device; the meta device costs nothing).

The formula is PaLM's (Chowdhery et al. 2022, appendix B), as torchtitan computes it::

    flops_per_token = 6 · N + 12 · L · H · S

* ``N``: the parameters a token's matmuls use, forward and backward (2 FLOPs per multiply-add, forward 2N,
  backward 4N). Convention: every parameter **except the embeddings** (the token embedding and learned position
  embeddings: a lookup is no matmul), so the blocks, the final norm and the output head count; a head tied to the
  token embedding counts, once, as the head. Norm weights and biases are counted too, as torchtitan does; they are
  a negligible part of ``N``.
* Mixture of experts: only the *active* parameters count. A layer of ``E`` routed experts of which each token uses
  ``k`` contributes ``k / E`` of its expert parameters; routers and shared experts count in full.
* ``12 · L · H · S``: attention's two matmuls (``QKᵀ`` and ``AV``), forward and backward, for ``L`` layers of query
  width ``H`` (heads × head dim) over a sequence of ``S`` tokens, without halving for the causal mask.

The layers and width come from the mesh planner's :func:`~lightning_dist.planning.model_facts.model_facts`, the
embeddings and attention heads from :func:`~lightning_dist.parallel.model_structure.recognize`, the experts from
expert parallelism's recognizer (:func:`~lightning_dist.parallel.expert_parallel.structure.find_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_dist.parallel.expert_parallel.structure import TOP_K_ATTRIBUTES, find_experts
from lightning_dist.parallel.model_structure import ModelStructure, recognize
from lightning_dist.planning.model_facts import model_facts


def flops_per_token(params: float, layers: int, attention_width: int, seq_len: int) -> float:
    """``6 · params + 12 · layers · attention_width · seq_len``: training FLOPs per token (see the module
    docstring; ``params`` are the active non-embedding parameters)."""
    return 6.0 * params + 12.0 * layers * attention_width * seq_len


@dataclass(frozen=True)
class TokenFlops:
    """What the FLOPs per token of a model depend on.

    Attributes:
        dense_params: Non-embedding parameters every token uses (everything but the embeddings and routed experts).
        expert_params: Parameters of every routed expert of every layer.
        active_expert_params: Of those, what one token uses (``Σ params · k / E`` over the MoE layers).
        layers: Repeated blocks (``L``).
        attention_width: Query width of one attention layer, heads × head dim (``H``).
    """

    dense_params: int
    expert_params: int = 0
    active_expert_params: float = 0.0
    layers: int = 0
    attention_width: int = 0

    @property
    def active_params(self) -> float:
        """``N``: the parameters one token's matmuls use."""
        return self.dense_params + self.active_expert_params

    def per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at sequence length ``seq_len`` (the full sequence, before any sharding)."""
        return flops_per_token(self.active_params, self.layers, self.attention_width, seq_len)


def token_flops(model: nn.Module, experts_per_token: int | None = None) -> TokenFlops:
    """The :class:`TokenFlops` of ``model`` (unsharded: count before parallelizing, where expert or pipeline
    parallelism would leave a rank only its own parameters).

    Args:
        model: The model, on any device (meta included).
        experts_per_token: ``k`` of top-k routing, for a mixture-of-experts model whose modules and config do not
            say it (otherwise read from them).

    Raises:
        ValueError: The model has no repeated blocks, or has routed experts and ``k`` is found nowhere.
    """
    facts = model_facts(model)
    structure = recognize(model)
    head = dict(model.named_modules()).get(structure.output_head or "")
    head_weight = getattr(head, "weight", None)
    non_embedding = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in _embedding_parameters(model, structure) if p is not head_weight
    )
    experts = find_experts(model)
    missing = [layer.name for layer in experts if layer.top_k is None and experts_per_token is None]
    if missing:
        raise ValueError(
            f"{type(model).__name__} has routed experts ({missing[0]}{' and more' if len(missing) > 1 else ''}) but"
            f" no attribute says how many a token uses (looked for {', '.join(TOP_K_ATTRIBUTES)} on the MoE block,"
            " its router and its config): pass experts_per_token=k."
        )
    expert_params = sum(layer.params for layer in experts)
    active = sum(layer.params * (experts_per_token or layer.top_k or 0) / layer.experts for layer in experts)
    attention = next(iter(structure.attention.values()), None)
    width = facts.hidden
    if attention is not None and attention.num_heads and attention.head_dim:
        width = attention.num_heads * attention.head_dim
    return TokenFlops(
        dense_params=non_embedding - expert_params,
        expert_params=expert_params,
        active_expert_params=active,
        layers=facts.blocks,
        attention_width=width,
    )


def _embedding_parameters(model: nn.Module, structure: ModelStructure) -> list[nn.Parameter]:
    """The token embedding's, the learned position embeddings' and other embeddings' parameters, each once."""
    modules = dict(model.named_modules())
    names = [n for n in (structure.token_embedding, *structure.other_embeddings) if n]
    found = {id(p): p for n in names for p in modules[n].parameters()}
    found.update({id(p): p for p in map(model.get_parameter, structure.position_parameters)})
    return list(found.values())
