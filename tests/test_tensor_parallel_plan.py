"""Tensor-parallel plans and TensorParallelStrategy configuration: no processes are launched here.

Plan inference is pure inspection, so it is tested on the example GPT, a Llama-like module with Hugging Face naming,
GPT-NeoX/Falcon style separate projections, ``nn.TransformerEncoderLayer`` and models it must refuse.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from yaml_configs import cli_from_config

from examples.gpt import GPT
from lightning_dist import TensorParallelStrategy
from lightning_dist.commands import TOOLS
from lightning_dist.commands import plan as plan_command
from lightning_dist.parallel.mesh import MeshConfigError
from lightning_dist.parallel.tensor_parallel import (
    LossParallelError,
    TensorParallelPlanError,
    VocabParallelCrossEntropy,
    build_style,
    infer_plan,
    parse_layout,
    resolve_explicit_plan,
)
from lightning_dist.parallel.tensor_parallel.apply import _check_sequence_length
from tests.scenarios.models import LlamaLike

GPT_PLAN = {
    "tok_emb": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "replicate"},
    "blocks.*.attn.query": "colwise",
    "blocks.*.attn.key": "colwise",
    "blocks.*.attn.value": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": {"style": "colwise", "output_layouts": "replicate"},
}


def small_gpt(**kwargs) -> GPT:
    return GPT(**{"vocab_size": 64, "d_model": 32, "n_layer": 2, "n_head": 4, **kwargs})


def test_gpt_auto_plan_shards_attention_mlp_embedding_and_head():
    model = small_gpt()
    plan = infer_plan(model)
    assert plan.compact(model) == GPT_PLAN
    assert plan.head_attributes == {"blocks.0.attn": {"n_head": 4}, "blocks.1.attn": {"n_head": 4}}
    assert plan.token_embedding == "tok_emb" and plan.loss_parallel_head is None and not plan.unplanned
    plan.validate(2)
    plan.validate(4)


def test_gpt_sequence_and_loss_parallel_plan():
    model = small_gpt()
    plan = infer_plan(model, sequence_parallel=True, loss_parallel=True)
    styles = plan.compact(model)
    assert styles["tok_emb"]["output_layouts"] == "shard(1)"
    assert styles["pos_emb"] == {
        "style": "prepare_output",
        "output_layouts": "replicate",
        "desired_output_layouts": "shard(1)",
    }
    for norm in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
        assert styles[norm] == "sequence_parallel"
    for parent in ("blocks.*.attn", "blocks.*.mlp"):
        assert styles[parent]["style"] == "prepare_input"
    assert styles["blocks.*.attn.proj"] == {"style": "rowwise", "output_layouts": "shard(1)"}
    assert styles["head"] == {
        "style": "colwise",
        "input_layouts": "shard(1)",
        "output_layouts": "shard(-1)",
        "use_local_output": False,
    }
    assert plan.loss_parallel_head == "head" and plan.sequence_parallel


def test_hugging_face_llama_naming_with_grouped_query_attention():
    model = LlamaLike(num_heads=8, num_key_value_heads=4)
    plan = infer_plan(model)
    styles = plan.compact(model)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert styles[f"model.layers.*.self_attn.{proj}"] == "colwise"
    assert styles["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert styles["model.layers.*.mlp.gate_proj"] == styles["model.layers.*.mlp.up_proj"] == "colwise"
    assert styles["model.layers.*.mlp.down_proj"] == "rowwise"
    assert styles["model.embed_tokens"]["style"] == "rowwise" and styles["lm_head"]["style"] == "colwise"
    assert plan.head_attributes["model.layers.0.self_attn"] == {"num_heads": 8, "num_key_value_heads": 4}
    plan.validate(4)
    sp = infer_plan(model, sequence_parallel=True)
    assert sp.styles["model.layers.0.input_layernorm"] == "sequence_parallel"  # RMSNorm by class name
    assert sp.styles["model.norm"] == "sequence_parallel"


def test_kv_heads_fewer_than_tp_are_replicated_and_other_counts_refused():
    plan = infer_plan(LlamaLike(num_heads=8, num_key_value_heads=2))
    plan.validate(2)
    plan.validate(4)  # each key/value head replicated over 2 ranks
    assert plan.grouped_query["model.layers.0.self_attn"] == {
        "heads": 8,
        "kv_heads": 2,
        "projections": ["k_proj", "v_proj"],
    }
    with pytest.raises(TensorParallelPlanError) as err:
        infer_plan(LlamaLike(num_heads=12, num_key_value_heads=4, hidden_size=48)).validate(6)
    message = str(err.value)
    assert (  # one line for every layer with the same problem (a 28-layer model: one line, not 28)
        "model.layers.0–1.self_attn: key/value heads (grouped-query attention) = 4 is not divisible by"
        " tensor_parallel_size=6 and does not divide it (2 modules)" in message
    )
    assert "model.layers.1.self_attn:" not in message and message.count("model.layers.0–1.mlp.up_proj") == 1


def test_heads_and_vocabulary_not_divisible():
    plan = infer_plan(GPT(vocab_size=63, d_model=48, n_layer=1, n_head=3))
    with pytest.raises(TensorParallelPlanError) as err:
        plan.validate(2)
    message = str(err.value)
    assert "blocks.0.attn: attention heads = 3 is not divisible by tensor_parallel_size=2" in message  # one block
    assert "tok_emb: vocabulary (Embedding.num_embeddings) = 63" in message
    assert "head: vocabulary (Linear.out_features) = 63" in message
    assert "pad the vocabulary to a multiple of tp" in message


class NeoXAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.num_attention_heads = 4
        self.query, self.key, self.value, self.dense = (nn.Linear(d, d) for _ in range(4))


class NeoXMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(d, 4 * d)
        self.dense_4h_to_h = nn.Linear(4 * d, d)


class NeoXLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.attention = NeoXAttention(d)
        self.mlp = NeoXMLP(d)


class NeoXLike(nn.Module):
    def __init__(self, d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(NeoXLayer(d) for _ in range(2))
        self.embed_out = nn.Linear(d, vocab, bias=False)


def test_neox_falcon_style_separate_projections():
    model = NeoXLike()
    styles = infer_plan(model).compact(model)
    assert styles == {
        "embed_in": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "replicate"},
        "layers.*.attention.query": "colwise",
        "layers.*.attention.key": "colwise",
        "layers.*.attention.value": "colwise",
        "layers.*.attention.dense": "rowwise",
        "layers.*.mlp.dense_h_to_4h": "colwise",
        "layers.*.mlp.dense_4h_to_h": "rowwise",
        "embed_out": {"style": "colwise", "output_layouts": "replicate"},
    }
    assert infer_plan(model).head_attributes["layers.0.attention"] == {"num_attention_heads": 4}


def test_transformer_encoder_layer_attention_is_sharded_by_heads_and_its_mlp_planned():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True), 2)
    plan = infer_plan(model)
    assert plan.compact(model) == {
        "layers.*.self_attn": "multihead_attention",
        "layers.*.linear1": "colwise",
        "layers.*.linear2": "rowwise",
    }
    assert plan.head_attributes["layers.0.self_attn"] == {"num_heads": 2, "embed_dim": 16}
    assert not plan.unplanned
    plan.validate(2)
    with pytest.raises(TensorParallelPlanError, match=r"layers.0–1.self_attn: attention heads.* = 2 is not divisible.*\(2 modules\)"):
        plan.validate(4)
    sp = infer_plan(model, sequence_parallel=True)  # the layer keeps its norms and residual stream inside
    assert sp.styles["layers.0.self_attn"] == {"style": "multihead_attention", "sequence_dim": 1}
    assert sp.styles["layers.0.norm1"] == {"style": "sequence_parallel", "use_local_output": True}
    assert not sp.unplanned and not sp.unreduced
    seq_first = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32), 2)
    sp = infer_plan(seq_first, sequence_parallel=True)
    assert "batch_first=False under sequence_parallel" in sp.unplanned["layers.0.self_attn"]
    with pytest.raises(TensorParallelPlanError, match=r"layers.0–1.self_attn.*only this rank's slice of the sequence"):
        sp.validate(2)


class Conv1D(nn.Module):  # Hugging Face GPT-2's layer: a transposed Linear
    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nx, nf))


class FusedAttention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)


def test_fused_qkv_of_unknown_layout_and_stray_conv1d_are_named_and_an_empty_plan_is_an_error():
    fused = nn.ModuleDict({"attn": FusedAttention()})  # no head count: the row order cannot be told
    plan = infer_plan(fused)
    assert "could not be told from the module and its config" in plan.unplanned["attn.c_attn"]
    with pytest.raises(TensorParallelPlanError, match=r"plan is empty.*attn.c_attn: fused QKV.*explicit `plan=`"):
        plan.validate(2)
    gpt2 = nn.ModuleDict({"c_attn": Conv1D(48, 16), "c_proj": Conv1D(16, 16)})
    assert "no num_heads/split_size matching its 48 output features" in infer_plan(gpt2).unplanned["c_attn"]
    stray = nn.ModuleDict({"odd": Conv1D(16, 16)})
    with pytest.raises(TensorParallelPlanError, match="odd: Hugging Face Conv1D .* outside a recognised attention"):
        infer_plan(stray).validate(2)


def test_sequence_parallel_needs_the_token_embedding_and_head():
    model = nn.ModuleDict({"mlp": nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})})
    infer_plan(model).validate(2)
    with pytest.raises(TensorParallelPlanError, match="sequence_parallel: no token embedding was recognised"):
        infer_plan(model, sequence_parallel=True).validate(2)


def test_explicit_plan_patterns_checks_and_head_attributes():
    model = small_gpt()
    plan = resolve_explicit_plan(model, {"blocks.*.attn.query": "colwise", "blocks.*.attn.key": "colwise"})
    assert set(plan.styles) == {"blocks.0.attn.query", "blocks.0.attn.key", "blocks.1.attn.query", "blocks.1.attn.key"}
    assert plan.head_attributes == {}  # value is not column-wise: the user owns the head bookkeeping
    full = resolve_explicit_plan(model, GPT_PLAN)
    assert full.styles == infer_plan(model).styles and full.head_attributes == infer_plan(model).head_attributes
    with pytest.raises(TensorParallelPlanError, match=r"'blocks.\*.attn.qkv' matches no module of GPT"):
        resolve_explicit_plan(model, {"blocks.*.attn.qkv": "colwise"})
    with pytest.raises(TensorParallelPlanError, match=r"unknown style 'columnwise'; the styles are \['colwise'"):
        resolve_explicit_plan(model, {"head": "columnwise"})
    with pytest.raises(TensorParallelPlanError, match=r"blocks.0.attn is a CausalSelfAttention: colwise/rowwise"):
        resolve_explicit_plan(model, {"blocks.0.attn": "colwise"})
    with pytest.raises(TensorParallelPlanError, match=r"blocks.0–1.mlp.up: output features.*= 128 is not divisible.*\(2 modules\)"):
        resolve_explicit_plan(model, {"blocks.*.mlp.up": "colwise"}).validate(3)


def test_explicit_plan_must_provide_the_requested_sequence_and_loss_parallel():
    model = small_gpt()
    strategy = TensorParallelStrategy(plan=GPT_PLAN, loss_parallel=True)
    with pytest.raises(TensorParallelPlanError, match="loss_parallel=True, but the explicit plan keeps no output"):
        strategy.tensor_parallel_plan(model)
    strategy = TensorParallelStrategy(plan=GPT_PLAN, sequence_parallel=True)
    with pytest.raises(TensorParallelPlanError, match="sequence_parallel=True, but the explicit plan has no"):
        strategy.tensor_parallel_plan(model)
    lp_plan = {**GPT_PLAN, "head": {"style": "colwise", "output_layouts": "shard(-1)", "use_local_output": False}}
    assert TensorParallelStrategy(plan=lp_plan, loss_parallel=True).tensor_parallel_plan(model).loss_parallel_head


def test_styles_and_layouts_build():
    assert parse_layout("shard(-1)").dim == -1 and parse_layout("Replicate").is_replicate()
    with pytest.raises(TensorParallelPlanError, match="Unknown layout 'shard'"):
        parse_layout("shard")
    style = build_style({"style": "colwise", "output_layouts": "shard(-1)", "use_local_output": False})
    assert style.output_layouts == (parse_layout("shard(-1)"),) and not style.use_local_output
    with pytest.raises(TensorParallelPlanError, match=r"'colwise' takes \['input_layouts'"):
        build_style({"style": "colwise", "sequence_dim": 1}, "x")


def test_sequence_parallel_checks_the_sequence_length():
    embedding = nn.Embedding(8, 4)
    _check_sequence_length(embedding, "tok_emb", 4)
    embedding(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(TensorParallelPlanError, match="tok_emb has sequence length 6, which is not divisible by"):
        embedding(torch.zeros(2, 6, dtype=torch.long))


def test_loss_parallel_refuses_unsupported_cross_entropy_arguments():
    logits, target = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(LossParallelError, match="class weights, label smoothing"):
        VocabParallelCrossEntropy._cross_entropy(logits, target, label_smoothing=0.1)  # type: ignore[arg-type]
    with VocabParallelCrossEntropy():  # plain tensors pass through untouched
        loss = torch.nn.functional.cross_entropy(logits, target)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(8.0)).item())


def test_registered_names_and_mesh_sizes():
    assert StrategyRegistry["tensor_parallel"]["strategy"] is TensorParallelStrategy
    assert StrategyRegistry["tensor_parallel_2d"]["init_params"] == {"data_parallel_shard_size": "auto"}
    trainer = L.Trainer(strategy="tensor_parallel", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.parallel_dims.tp == 2
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}  # TP peers: one batch
    trainer = L.Trainer(strategy="tensor_parallel_2d", accelerator="cpu", devices=4, logger=False)
    dims = trainer.strategy.parallel_dims
    assert (dims.dp_shard, dims.tp) == (2, 2)
    assert [dims.batch_rank(r) for r in range(4)] == [0, 0, 1, 1]  # ranks 0,1 form a tp group: same batch
    with pytest.raises(MeshConfigError, match="cannot be split into 2 data-parallel groups"):
        L.Trainer(strategy="tensor_parallel_2d", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(MeshConfigError, match="tensor_parallel_size=1: tensor parallelism needs at least 2"):
        L.Trainer(strategy=TensorParallelStrategy(data_parallel_size=2), accelerator="cpu", devices=2)
    with pytest.raises(TensorParallelPlanError, match="unknown style 'col'"):
        TensorParallelStrategy(plan={"head": "col"})


@pytest.mark.parametrize("config", ["configs/tensor_parallel.yaml", "configs/tensor_parallel_2d.yaml"])
def test_yaml_configs_build_the_strategy(config):
    cli = cli_from_config(config)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, TensorParallelStrategy)
    with open(config) as f:
        expected = yaml.safe_load(f)["trainer"]["strategy"]["init_args"].get("plan")
    assert strategy.plan == expected
    if expected:  # the explicit plan in YAML is the auto plan, written out
        model = cli.model
        assert resolve_explicit_plan(model, strategy.plan).styles == infer_plan(model).styles


def test_plan_tool_prints_a_plan_that_parses_back(capsys):
    assert "plan" in TOOLS
    plan_command.main(["--model", "examples.gpt.GPT", "--init-args", '{"n_layer": 2}', "--tensor-parallel-size", "2"])
    out = capsys.readouterr().out
    assert "# blocks.*.attn: n_head=4 become the per-rank counts" in out
    assert yaml.safe_load(out)["plan"] == {**GPT_PLAN}
    with pytest.raises(SystemExit):
        plan_command.main(["--model", "examples.gpt.GPT", "--tensor-parallel-size", "3"])
    assert "attention heads = 4 is not divisible by tensor_parallel_size=3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_command.main(["--model", "examples.gpt.GPT", "--tensor-parallel-size", "0"])
    assert "--tensor-parallel-size: '0' is not a positive int" in capsys.readouterr().err


class QKNormAttention(nn.Module):  # Qwen3 style: RMSNorm over head_dim on the (head-sharded) queries and keys
    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(d // heads), nn.RMSNorm(d // heads)


def test_per_head_norms_are_summed_over_tp_and_other_attention_parameters_are_refused():
    """Qwen3's q_norm/k_norm (shape head_dim) act alike on every head: each rank's gradient is its heads' part, so
    the plan marks them to be summed over tp. A parameter over the projection width is still refused."""
    model = nn.ModuleDict({"attn": QKNormAttention()})
    plan = infer_plan(model)
    assert not plan.unreduced and set(plan.partial_over_tp) == {"attn.q_norm.weight", "attn.k_norm.weight"}
    plan.validate(2)
    model["attn"].register_parameter("gain", nn.Parameter(torch.ones(16)))  # over the projection width: ambiguous
    with pytest.raises(TensorParallelPlanError, match=r"attn.gain: a parameter of QKNormAttention 'attn'"):
        infer_plan(model).validate(2)
    gqa = nn.ModuleDict({"attn": QKNormAttention()})
    gqa["attn"].num_key_value_heads = 2
    gqa["attn"].k_proj, gqa["attn"].v_proj = nn.Linear(16, 8), nn.Linear(16, 8)
    infer_plan(gqa).validate(2)
    with pytest.raises(
        TensorParallelPlanError,
        match=r"attn.k_norm.weight: a per-head norm in an attention module with 2 key/value heads; with tp=4",
    ):
        infer_plan(gqa).validate(4)
    mlp = nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})
    mlp.register_parameter("scale", nn.Parameter(torch.ones(16)))
    with pytest.raises(
        TensorParallelPlanError, match=r"(?s)mlp.scale: .*this rank.s MLP hidden units.*explicit `plan=`"
    ):
        infer_plan(nn.ModuleDict({"mlp": mlp})).validate(2)
    explicit = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise"}
    resolve_explicit_plan(model, explicit).validate(2)  # an explicit plan is the user's responsibility


class OddNorm(nn.Module):  # a norm whose class name the plan does not recognise
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


def test_sequence_parallel_refuses_parameters_it_does_not_cover():
    model = small_gpt()
    model.blocks[0].register_parameter("gamma", nn.Parameter(torch.ones(32)))  # layer scale on the residual stream
    model.blocks[1].ln1 = OddNorm(32)
    infer_plan(model).validate(2)  # without sequence parallel the residual stream is whole on every rank
    plan = infer_plan(model, sequence_parallel=True)
    assert set(plan.unreduced) == {"blocks.0.gamma", "blocks.1.ln1.weight"}
    with pytest.raises(TensorParallelPlanError, match=r"blocks.0.gamma: not in a module the plan covers \(Block\)"):
        plan.validate(2)
    infer_plan(small_gpt(), sequence_parallel=True).validate(2)


class HeadlessAttention(nn.Module):  # no head count and no head_dim to adjust
    def __init__(self, d: int = 16, kv: int = 8) -> None:
        super().__init__()
        self.h = 4
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, kv), nn.Linear(d, kv), nn.Linear(d, d)


def test_attention_without_a_head_count_is_left_replicated_and_qkv_widths_are_checked():
    plan = infer_plan(nn.ModuleDict({"attn": HeadlessAttention(), "mlp": nn.ModuleDict({"up": nn.Linear(16, 32)})}))
    assert "attn" in plan.unplanned and "no recognised head-count attribute" in plan.unplanned["attn"]
    assert not any(n.startswith("attn.") for n in plan.styles)
    model = LlamaLike(num_heads=8, num_key_value_heads=4)
    model.model.layers[0].self_attn.k_proj = nn.Linear(model.model.layers[0].self_attn.q_proj.in_features, 6)
    with pytest.raises(TensorParallelPlanError, match=r"self_attn: key projection output features = 6 is not div"):
        infer_plan(model).validate(4)


def test_loss_parallel_checks_targets_and_reduction():
    from lightning_dist.parallel.tensor_parallel.loss_parallel import check_targets

    check_targets(torch.tensor([0, 7, -100]), 8, -100)
    with pytest.raises(LossParallelError, match=r"target 8 is out of bounds for 8 classes"):
        check_targets(torch.tensor([0, 8]), 8, -100)
    with pytest.raises(LossParallelError, match=r"target -1 is out of bounds"):
        check_targets(torch.tensor([-1, 3]), 8, -100)
    logits, target = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="bogus is not a valid value for reduction"):
        VocabParallelCrossEntropy._cross_entropy(logits, target, reduction="bogus")  # type: ignore[arg-type]


def test_loss_parallel_needs_a_recognised_head_and_explicit_layouts_are_parsed():
    model = nn.ModuleDict(
        {
            "embed_tokens": nn.Embedding(32, 16),
            "mlp": nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)}),
        }
    )
    with pytest.raises(
        TensorParallelPlanError, match="loss_parallel=True, but the automatic plan recognised no output"
    ):
        TensorParallelStrategy(loss_parallel=True).tensor_parallel_plan(model)
    lp_plan = {**GPT_PLAN, "head": {"style": "colwise", "output_layouts": "Shard( -1 )", "use_local_output": False}}
    assert resolve_explicit_plan(small_gpt(), lp_plan).loss_parallel_head == "head"


def test_transformers_plan_styles_and_the_models_own_plan():
    """``plan=`` takes the styles transformers ships in ``base_model_tp_plan`` (pasted as they are), refuses those
    with no counterpart by name, and ``plan="model"`` reads the model's own plan under the names of the module."""
    import lightning as L

    from lightning_dist.parallel.tensor_parallel import resolve_plan
    from lightning_dist.parallel.tensor_parallel.hugging_face import shipped_plan
    from tests.scenarios.models import tiny_hf_causal_lm

    class Wrapped(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_hf_causal_lm("llama")

    module = Wrapped()
    shipped = shipped_plan(module)
    assert shipped["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert shipped["model.lm_head"] == "colwise_gather_output" and shipped["model.model.embed_tokens"] == "embedding_rowwise"
    plan = resolve_plan(module, "model")
    assert plan.styles["model.lm_head"] == {"style": "colwise", "output_layouts": "replicate"}
    assert plan.styles["model.model.embed_tokens"] == {"style": "rowwise", "input_layouts": "replicate"}
    assert resolve_plan(module, {"model.model.layers.*.mlp.down_proj": "rowwise"}).styles
    for style, why in [("moe_tp_experts", "expert_parallel_size"), ("replicated_with_grad_allreduce", "plan=None"),
                       ("local_colwise", "use 'colwise'")]:  # fmt: skip
        with pytest.raises(TensorParallelPlanError, match=rf"transformers' style '{style}' cannot be used here: .*{why}"):
            TensorParallelStrategy(plan={"model.lm_head": style})
    with pytest.raises(TensorParallelPlanError, match=r"plan='auto': give a mapping .* or 'model'"):
        TensorParallelStrategy(plan="auto")
    with pytest.raises(TensorParallelPlanError, match=r"plan='model': GPT holds no Hugging Face model"):
        resolve_plan(GPT(vocab_size=64, d_model=32, n_layer=1, n_head=2), "model")
