"""Recognising the parts of a transformer: blocks, attention and its head counts, MLPs, embeddings, head, norms.

``recognize(model)`` inspects a single-device model (nothing changes, no communication) and returns a
:class:`ModelStructure` that the tensor-parallel plan, context parallelism's checks and the pipeline split
read. It knows the common naming of hand-written GPTs, Hugging Face decoders (Llama/Mistral/Qwen, GPT-2, GPT-NeoX),
litgpt, and ``torch.nn``'s transformer layers, and sees through PEFT's LoRA wrappers to the projections they wrap. What looks like attention but cannot be understood is listed in
:attr:`ModelStructure.unsupported` with the reason. Pure PyTorch.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_dist.compat import buffer_registry
from lightning_dist.compat.peft import is_adapter_layer, lora_base, why_adapter_is_whole
from lightning_dist.parallel.fused_layouts import FusedLayout, fused_layout

# Names of child projections, by role. Matched exactly against the child's attribute name.
Q_NAMES = ("q_proj", "query", "q", "wq", "q_lin", "to_q", "query_proj")
K_NAMES = ("k_proj", "key", "k", "wk", "k_lin", "to_k", "key_proj")
V_NAMES = ("v_proj", "value", "v", "wv", "v_lin", "to_v", "value_proj")
O_NAMES = ("o_proj", "out_proj", "proj", "dense", "wo", "c_proj", "out_lin", "to_out", "output_proj", "o")
UP_NAMES = (
    "up_proj",
    "gate_proj",
    "up",
    "gate",
    "fc1",
    "fc_1",
    "fc_2",
    "fc",
    "fc_in",
    "w1",
    "w3",
    "c_fc",
    "dense_h_to_4h",
    "wi",
    "wi_0",
    "wi_1",
)
DOWN_NAMES = ("down_proj", "down", "fc2", "fc_out", "w2", "c_proj", "dense_4h_to_h", "wo", "proj", "dense")
FUSED_QKV_NAMES = ("qkv", "c_attn", "query_key_value", "Wqkv", "qkv_proj", "in_proj", "to_qkv", "W_pack")
TOKEN_EMBEDDING_NAMES = (
    "embed_tokens",
    "tok_emb",
    "wte",
    "word_embeddings",
    "embed_in",
    "tok_embeddings",
    "token_embedding",
)
HEAD_NAMES = ("lm_head", "head", "output", "embed_out", "out", "output_layer", "logits")
POSITIONS_ARGUMENTS = ("position_ids", "input_pos", "positions")
# Learned position embeddings held as a parameter (ViT's ``position_embeddings``, timm's ``pos_embed``).
POSITION_PARAMETER_NAMES = (
    "position_embeddings",
    "position_embedding",
    "pos_embed",
    "pos_embedding",
    "positional_embedding",
    "pos_emb",
)
# Rotary tables with one row per position, which a forward slices by the sequence length (``self.cos[:T]``):
# litgpt's ``GPT`` (``cos``/``sin``), torchtitan-style ``freqs_cis``.
ROPE_TABLE_NAMES = (("cos", "sin"), ("freqs_cis",))

# Attributes of an attention module that hold a global count and must become the local (per-rank) count.
Q_HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nheads", "num_q_heads")
KV_HEAD_ATTRIBUTES = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_head_kv")
WIDTH_ATTRIBUTES = ("hidden_size", "all_head_size", "inner_dim")


@dataclass(frozen=True)
class Attention:
    """An attention module and how its projections are laid out.

    Attributes:
        name: Qualified module name.
        query, key, value: Child names of separate projections (``None`` for a fused one).
        fused: Child name of a fused query/key/value projection, or ``"in_proj"`` for ``nn.MultiheadAttention``.
        fused_layout: How the fused projection orders its rows (see :mod:`lightning_dist.parallel.fused_layouts`).
        output: Child name of the output projection.
        num_heads: Query heads (``None`` when the module keeps no count and no head_dim).
        num_kv_heads: Key/value heads (``None`` when unknown; equal to ``num_heads`` without grouped-query attention).
        head_dim: Width of one head, when known.
        count_attributes: Attribute → global value of the counts and widths its forward reshapes with.
    """

    name: str
    output: str
    query: str | None = None
    key: str | None = None
    value: str | None = None
    fused: str | None = None
    fused_layout: FusedLayout | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    count_attributes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MLP:
    """A feed-forward module: ``up`` projections (up/gate, applied to the input) and one ``down`` projection.

    Attributes:
        name: Qualified module name.
        up: Child names of the input projections.
        down: Child name of the output projection.
        fused_up: Child name of a fused gate+up projection (its output is chunked in two), if any.
    """

    name: str
    up: tuple[str, ...]
    down: str
    fused_up: str | None = None


@dataclass
class ModelStructure:
    """What :func:`recognize` found, by qualified module name, in the model's own order.

    Attributes:
        blocks: The outermost repeated blocks (transformer layers).
        attention: Recognised attention modules.
        mlps: Recognised MLPs (``nn.TransformerEncoderLayer``'s ``linear1``/``linear2`` included, under the layer).
        token_embedding: The token embedding, if found.
        other_embeddings: Embeddings of the same width added to it (learned positions); copies tied to the token
            embedding (T5's ``shared``/``decoder.embed_tokens``) are not among them.
        position_parameters: Learned position embeddings held as parameters (``vit.embeddings.position_embeddings``).
        attention_biases: Embeddings inside attention modules (learned relative position biases, T5's
            ``relative_attention_bias``): added to the attention scores, computed from positions.
        rope_tables: ``(module, buffer names)`` of rotary tables with one row per position that the module's forward
            slices by the sequence length (litgpt's ``GPT``: ``cos``/``sin``), when no module takes positions.
        output_head: The output projection to the vocabulary, if found.
        norms: Norms on the residual stream (outside attention and MLP modules).
        positions_argument: ``(module, argument)`` of the outermost module whose forward takes positions.
        unsupported: Module → why it looks like attention or a projection but cannot be understood.
        claimed: Modules whose projections a rule above claimed (attention, MLP, or an unsupported attention).
    """

    blocks: list[str] = field(default_factory=list)
    attention: dict[str, Attention] = field(default_factory=dict)
    mlps: dict[str, MLP] = field(default_factory=dict)
    token_embedding: str | None = None
    other_embeddings: list[str] = field(default_factory=list)
    position_parameters: list[str] = field(default_factory=list)
    attention_biases: list[str] = field(default_factory=list)
    rope_tables: tuple[str, tuple[str, ...]] | None = None
    output_head: str | None = None
    norms: list[str] = field(default_factory=list)
    positions_argument: tuple[str, str] | None = None
    unsupported: dict[str, str] = field(default_factory=dict)
    claimed: list[str] = field(default_factory=list)

    def inside_claimed(self, name: str) -> bool:
        """Whether ``name`` lies strictly inside a claimed module (the root never counts as claiming)."""
        return any(name.startswith(f"{c}.") for c in self.claimed if c)


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name


def is_norm(module: nn.Module) -> bool:
    """LayerNorm/RMSNorm, by class or by a class name ending in one of those."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def is_projection(module: nn.Module) -> bool:
    """An ``nn.Linear`` (exactly, not a subclass with other semantics, except Falcon's plain ``x @ W.T + b`` and
    torchao's ``Float8Linear``, the same product in FP8, which ``float8`` puts in before tensor parallelism) or
    Hugging Face's ``Conv1D``; or such a layer wrapped by PEFT's LoRA (``base_layer(x) + B(A(x))``), which the
    tensor-parallel plan shards as its base layer."""
    return _is_plain_projection(projection_base(module))


def _is_plain_projection(module: nn.Module) -> bool:
    return type(module) is nn.Linear or type(module).__name__ in _LINEAR_SUBCLASSES or is_conv1d(module)


def projection_base(module: nn.Module) -> nn.Module:
    """The layer that holds a projection's weight: ``module`` itself, or the base layer of a LoRA-wrapped one."""
    base = lora_base(module)
    return module if base is None else base


#: ``nn.Linear`` subclasses whose forward is still ``x @ W.T + b`` (tensor-parallel styles apply to them).
_LINEAR_SUBCLASSES = ("FalconLinear", "Float8Linear")


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear whose weight is stored transposed, ``(in, out)``."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.dim() == 2


def projection_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or ``Conv1D`` (the base layer's, when LoRA wraps it)."""
    module = projection_base(module)
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def find_repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified_name, module)`` of the outermost repeated blocks, in registration order.

    A container (``ModuleList``/``ModuleDict``) contributes its children of the most common class when that class
    occurs at least twice and the children hold parameters. Blocks nested inside an already chosen block (experts
    inside a transformer layer) are not returned.
    """
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        if any(name.startswith(f"{prefix}.") for prefix, _ in chosen):
            continue
        children = list(module.named_children())
        counts: dict[type, int] = {}
        for _, child in children:
            counts[type(child)] = counts.get(type(child), 0) + 1
        if not counts:
            continue
        cls = max(counts, key=counts.__getitem__)
        if counts[cls] < 2:
            continue
        for child_name, child in children:
            if type(child) is cls and any(True for _ in child.parameters()):
                chosen.append((join(name, child_name), child))
    return chosen


def recognize(model: nn.Module) -> ModelStructure:
    """Find the blocks, attention modules, MLPs, embeddings, output head, norms and positions argument of ``model``.

    Pure inspection: nothing changes and nothing communicates.
    """
    structure = ModelStructure(blocks=[n for n, _ in find_repeated_blocks(model)])
    skipped: list[str] = []  # subtrees not to look into
    claimed_children: set[str] = set()  # projections a rule at the root claimed
    for name, module in model.named_modules():
        if any(name.startswith(f"{s}.") for s in skipped):
            continue
        if isinstance(module, nn.MultiheadAttention):
            _recognize_multihead(structure, name, module)
            skipped.append(name)
            continue
        children = {n: c for n, c in module.named_children() if is_projection(c)}
        if _adapter_left_whole(structure, name, module, children, skipped):
            continue
        if _recognize_attention(structure, name, module, children, skipped):
            claimed_children.update(join(name, c) for c in children)
            continue
        if _recognize_mlp(structure, name, children):
            claimed_children.update(join(name, c) for c in children)
    for name, module in model.named_modules():
        if is_conv1d(module) and not structure.inside_claimed(name) and name not in claimed_children:
            structure.unsupported[name] = (
                "Hugging Face Conv1D (GPT-2 style, transposed weight) outside a recognised attention or MLP"
            )
    _recognize_embeddings_and_head(model, structure, claimed_children)
    structure.norms = [n for n, m in model.named_modules() if is_norm(m) and not structure.inside_claimed(n)]
    structure.position_parameters = _position_parameters(model)
    structure.attention_biases = [
        n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and _inside_attention(structure, n)
    ]
    rope = find_rope_tables(model)
    structure.positions_argument = find_positions_argument(model, inference_only=rope[0] if rope else None)
    structure.rope_tables = rope if structure.positions_argument is None else None
    return structure


def _inside_attention(structure: ModelStructure, name: str) -> bool:
    return any(name.startswith(f"{a}.") for a in structure.attention)


def _position_parameters(model: nn.Module) -> list[str]:
    """Parameters that are learned position embeddings by name (at least 2-D: one row per position)."""
    return [
        join(module_name, name)
        for module_name, module in model.named_modules()
        for name, parameter in module.named_parameters(recurse=False)
        if name in POSITION_PARAMETER_NAMES and parameter.dim() >= 2
    ]


def find_rope_tables(model: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    """``(module name, buffer names)`` of the outermost module holding rotary tables (``ROPE_TABLE_NAMES``: 2-D or
    more, one row per position, equal row counts) that its forward slices by the sequence length."""
    for name, module in model.named_modules():
        for names in ROPE_TABLE_NAMES:
            tables = [buffer_registry(module).get(n) for n in names]
            if all(isinstance(t, Tensor) and t.dim() >= 2 for t in tables) and len({t.shape[0] for t in tables}) == 1:
                return name, names
    return None


def _recognize_multihead(structure: ModelStructure, name: str, module: nn.MultiheadAttention) -> None:
    if module.in_proj_weight is None or module.bias_k is not None or module.add_zero_attn:
        structure.unsupported[name] = (
            "nn.MultiheadAttention with kdim/vdim other than embed_dim, add_bias_kv or add_zero_attn is not sharded"
            " by heads"
        )
        structure.claimed.append(name)
        return
    structure.attention[name] = Attention(
        name=name,
        output="out_proj",
        fused="in_proj",
        fused_layout=FusedLayout("blocks", module.num_heads, module.num_heads, module.head_dim),
        num_heads=module.num_heads,
        num_kv_heads=module.num_heads,
        head_dim=module.head_dim,
        count_attributes={"num_heads": module.num_heads, "embed_dim": module.embed_dim},
    )
    structure.claimed.append(name)


def _recognize_attention(
    structure: ModelStructure, name: str, module: nn.Module, children: dict[str, nn.Module], skipped: list[str]
) -> bool:
    """Record ``module`` if it is an attention module; returns whether its projections were claimed."""
    q, k, v = _pick(children, Q_NAMES), _pick(children, K_NAMES), _pick(children, V_NAMES)
    fused = _pick(children, FUSED_QKV_NAMES)
    if fused is not None and not (q and k and v):
        output = _pick({n: m for n, m in children.items() if n != fused}, O_NAMES)
        layout = fused_layout(module, fused, projection_base(children[fused]))
        if isinstance(layout, str) or output is None:
            why = layout if isinstance(layout, str) else "no recognised output projection"
            structure.unsupported[join(name, fused)] = f"fused QKV projection: {why}"
        else:
            structure.attention[name] = Attention(
                name=name,
                output=output,
                fused=fused,
                fused_layout=layout,
                num_heads=layout.num_heads,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                count_attributes=layout.count_attributes,
            )
        structure.claimed.append(name)
        return True
    if not (q and k and v):
        return False
    o = _pick({n: m for n, m in children.items() if n not in (q, k, v)}, O_NAMES)
    if o is None:
        structure.unsupported[name] = f"attention with {q}/{k}/{v} but no recognised output projection"
        return False
    if not _head_count_known(module):
        structure.unsupported[name] = (
            f"attention with no recognised head-count attribute ({', '.join(Q_HEAD_ATTRIBUTES)}) or head_dim:"
            " its reshapes could not be adjusted to the per-rank heads"
        )
        structure.claimed.append(name)
        skipped.append(name)
        return True
    q_out, k_out = projection_features(children[q])[1], projection_features(children[k])[1]
    counts = _count_attributes(module, q_out)
    head_dim = getattr(module, "head_dim", None)
    head_dim = head_dim if _positive_int(head_dim) else None
    n_heads = next((counts[a] for a in Q_HEAD_ATTRIBUTES if a in counts), None)
    n_kv = next((counts[a] for a in KV_HEAD_ATTRIBUTES if a in counts), None)
    if head_dim is not None:
        n_heads = n_heads or q_out // head_dim
        n_kv = n_kv or k_out // head_dim
    structure.attention[name] = Attention(
        name=name,
        output=o,
        query=q,
        key=k,
        value=v,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        count_attributes=counts,
    )
    structure.claimed.append(name)
    return True


def _adapter_left_whole(
    structure: ModelStructure, name: str, module: nn.Module, children: dict[str, nn.Module], skipped: list[str]
) -> bool:
    """An attention module or MLP with a projection that is a PEFT adapter layer the plan cannot shard (a LoRA
    variant such as DoRA, another kind of adapter): the module is left whole, each such projection is named with
    why, and returns ``True``."""
    whole = {n: why for n, c in module.named_children() if (why := why_adapter_is_whole(c)) is not None}
    role = _role({*children, *whole}) if whole else None
    if role is None:
        return False
    for child, why in whole.items():
        structure.unsupported[join(name, child)] = f"{why}; the {role} module holding it is left whole"
    structure.claimed.append(name)
    skipped.append(name)
    return True


def _role(names: set[str]) -> str | None:
    """``"attention"`` or ``"MLP"`` when child projections of these names make a module one (as the rules of
    :func:`recognize` read them), else ``None``."""
    if all(_pick(names, role) for role in (Q_NAMES, K_NAMES, V_NAMES)) or _pick(names, FUSED_QKV_NAMES):
        return "attention"
    ups = [n for n in UP_NAMES if n in names]
    down = _pick(names - set(ups), DOWN_NAMES)
    if {"linear1", "linear2"} <= names or (ups or "gate_up_proj" in names) and down is not None:
        return "MLP"
    return None


def _recognize_mlp(structure: ModelStructure, name: str, children: dict[str, nn.Module]) -> bool:
    if "linear1" in children and "linear2" in children:  # nn.TransformerEncoderLayer / DecoderLayer
        structure.mlps[name] = MLP(name, ("linear1",), "linear2")
        structure.claimed.append(name)
        return True
    ups = [n for n in UP_NAMES if n in children]
    down = _pick({n: m for n, m in children.items() if n not in ups}, DOWN_NAMES)
    if not ups and "gate_up_proj" in children and down is not None:
        structure.mlps[name] = MLP(name, ("gate_up_proj",), down, fused_up="gate_up_proj")
        structure.claimed.append(name)
        return True
    if not (ups and down):
        return False
    structure.mlps[name] = MLP(name, tuple(ups), down)
    structure.claimed.append(name)
    return True


def _recognize_embeddings_and_head(model: nn.Module, structure: ModelStructure, claimed_children: set[str]) -> None:
    # an embedding or head wrapped by a PEFT adapter is not sharded (the plan names the adapter as left whole)
    adapters = [n for n, m in model.named_modules() if is_adapter_layer(m)]

    def candidate(name: str) -> bool:
        return not structure.inside_claimed(name) and not any(name.startswith(f"{a}.") for a in adapters)

    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and candidate(n)}
    linears = {
        n: m for n, m in model.named_modules() if type(m) is nn.Linear and candidate(n) and n not in claimed_children
    }
    heads = [n for n in linears if n.rpartition(".")[2] in HEAD_NAMES]
    token = next((n for n in embeddings if n.rpartition(".")[2] in TOKEN_EMBEDDING_NAMES), None)
    if token is None and heads:
        vocab = {linears[h].out_features for h in heads}
        token = next((n for n, m in embeddings.items() if m.num_embeddings in vocab), None)
    if token is not None:
        structure.token_embedding = token
        width, vocab_size = embeddings[token].embedding_dim, embeddings[token].num_embeddings
        tied = embeddings[token].weight
        structure.other_embeddings = [
            n
            for n, m in embeddings.items()
            if n != token
            and m.embedding_dim == width
            and m.weight is not tied  # a copy of the token embedding (T5's shared/decoder.embed_tokens)
            and n.rpartition(".")[2] not in TOKEN_EMBEDDING_NAMES
        ]
        heads.sort(key=lambda h: linears[h].out_features != vocab_size)
    structure.output_head = heads[0] if heads else None


def find_positions_argument(model: nn.Module, inference_only: str | None = None) -> tuple[str, str] | None:
    """``(module name, argument)`` of the outermost module whose ``forward`` takes token positions.

    ``inference_only``: a module (with its submodules) whose ``input_pos`` selects inference with a key/value cache
    rather than training positions (litgpt's ``GPT``: given ``input_pos``, it needs ``set_kv_cache()``; in training
    it slices its rotary tables by the length instead); their ``input_pos`` is not a positions argument.
    """
    for name, module in model.named_modules():
        cached = inference_only is not None and (
            inference_only == "" or name == inference_only or name.startswith(f"{inference_only}.")
        )
        try:
            parameters = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        argument = next((a for a in POSITIONS_ARGUMENTS if a in parameters and not (cached and a == "input_pos")), None)
        if argument is not None:
            return name, argument
    return None


def _pick(children: Collection[str], candidates: tuple[str, ...]) -> str | None:
    return next((n for n in candidates if n in children), None)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _head_count_known(module: nn.Module) -> bool:
    """Whether the attention keeps its query head count (or head_dim) where the plan can adjust or derive it."""
    return any(_positive_int(getattr(module, attr, None)) for attr in (*Q_HEAD_ATTRIBUTES, "head_dim"))


def _count_attributes(module: nn.Module, query_width: int) -> dict[str, int]:
    """Head-count attributes, and the widths a forward reshapes back with, as global values."""
    counts = {
        attr: getattr(module, attr)
        for attr in (*Q_HEAD_ATTRIBUTES, *KV_HEAD_ATTRIBUTES)
        if _positive_int(getattr(module, attr, None))
    }
    if counts:
        counts.update({a: query_width for a in WIDTH_ATTRIBUTES if getattr(module, a, None) == query_width})
    return counts
