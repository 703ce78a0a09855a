"""Structures and idioms the strategies refused or crashed on now train exactly like one process (fp64, 2 ranks):
Lightning's ``gradient_clip_algorithm="value"``, ``fc1``/``fc2`` beside a norm or ``nn.MultiheadAttention`` in a
block, trainable q/k norms over head_dim (summed over tp), and one ``nn.Linear`` shared by two blocks
(tensor_parallel and fsdp2). What would really diverge is still refused."""

from __future__ import annotations

import pytest
import torch
from launch import max_abs_diff, run_scenarios
from torch import nn

from lightning_dist.parallel.fsdp import shared_submodules
from lightning_dist.parallel.model_structure import MLP, recognize
from lightning_dist.parallel.tensor_parallel.inference import infer_plan
from lightning_dist.parallel.tensor_parallel.plan import TensorParallelPlanError

FP64_TOL = 1e-10
CASES = [
    "gpt_clip_by_value_tp",
    "gpt_clip_by_value_fsdp2",
    "norm_mlp_tp",
    "mha_tp",
    "qk_norm_tp",
    "shared_linear_tp",
    "shared_linear_fsdp2",
]


@pytest.mark.slow
def test_structures_train_like_one_process(tmp_path):
    ours = run_scenarios("structure_runs.py", 2, tmp_path, CASES)
    reference = run_scenarios("structure_runs.py", 1, tmp_path, CASES)
    for case in CASES:
        assert max_abs_diff(ours[case]["losses"], reference[case]["losses"]) < FP64_TOL, case
        assert max_abs_diff(ours[case]["grad_norms"], reference[case]["grad_norms"]) < FP64_TOL, case
        mine, ref = torch.load(tmp_path / f"{case}_d2.pt"), torch.load(tmp_path / f"{case}_d1.pt")
        assert mine.keys() == ref.keys(), case
        assert max((mine[k] - ref[k]).abs().max().item() for k in ref) < FP64_TOL, case


def _block(extra: nn.Module | None = None, name: str = "norm") -> nn.Module:
    block = nn.Module()
    block.fc1, block.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
    if extra is not None:
        block.add_module(name, extra)
    return nn.ModuleDict({"block": block})


def test_parameters_over_the_model_width_or_frozen_are_not_refused():
    infer_plan(_block(nn.LayerNorm(8))).validate(2)
    infer_plan(_block(nn.MultiheadAttention(8, 2), "mha")).validate(2)
    frozen = nn.LayerNorm(32)
    frozen.requires_grad_(False)
    infer_plan(_block(frozen)).validate(2)


def test_parameters_over_the_sharded_hidden_units_are_still_refused():
    with pytest.raises(TensorParallelPlanError, match=r"block.norm.weight: .*of shape \(32,\).*MLP hidden units"):
        infer_plan(_block(nn.LayerNorm(32))).validate(2)  # a norm between fc1 and fc2 (NormFormer style)
    scalar = nn.Module()
    scalar.register_parameter("scale", nn.Parameter(torch.ones(1)))
    with pytest.raises(TensorParallelPlanError, match=r"block.norm.scale"):
        infer_plan(_block(scalar)).validate(2)


def test_a_parameter_shared_by_modules_of_two_units_is_refused_with_a_fix():
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))
    assert shared_submodules(blocks, list(blocks)) == []
    blocks[1][0] = blocks[0][0]  # the whole module shared: its own unit
    assert shared_submodules(blocks, list(blocks)) == [blocks[0][0]]
    other = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))
    other[1][0].weight = other[0][0].weight  # one Parameter in two different modules
    with pytest.raises(ValueError, match=r"registered in 0.0 and 1.0, which belong to different FSDP units"):
        shared_submodules(other, list(other))


def test_recognize_finds_the_parts_of_a_gpt_and_a_hugging_face_style_decoder():
    from examples.gpt import GPT
    from tests.scenarios.models import LlamaLike

    gpt = recognize(GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4))
    assert gpt.blocks == ["blocks.0", "blocks.1"]
    attn = gpt.attention["blocks.0.attn"]
    assert (attn.query, attn.key, attn.value, attn.output) == ("query", "key", "value", "proj")
    assert (attn.num_heads, attn.num_kv_heads, attn.fused) == (4, 4, None)
    assert gpt.mlps["blocks.0.mlp"] == MLP("blocks.0.mlp", ("up",), "down")
    assert (gpt.token_embedding, gpt.other_embeddings, gpt.output_head) == ("tok_emb", ["pos_emb"], "head")
    assert gpt.norms == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"]
    llama = recognize(LlamaLike(num_heads=8, num_key_value_heads=4))
    attn = llama.attention["model.layers.1.self_attn"]
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (8, 4, attn.head_dim)
    assert llama.mlps["model.layers.0.mlp"].up == ("up_proj", "gate_proj")
    assert (llama.token_embedding, llama.output_head) == ("model.embed_tokens", "lm_head")
    assert llama.positions_argument == ("model.rotary_emb", "position_ids")


def test_recognize_reads_multihead_attention_and_names_what_it_cannot_tell():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True), 2)
    structure = recognize(encoder)
    mha = structure.attention["layers.0.self_attn"]
    assert (mha.fused, mha.output, mha.num_heads, mha.head_dim) == ("in_proj", "out_proj", 2, 8)
    assert mha.fused_layout.order == "blocks"
    assert structure.mlps["layers.1"].up == ("linear1",) and structure.blocks == ["layers.0", "layers.1"]
    fused = nn.ModuleDict({"attn": nn.ModuleDict({"Wqkv": nn.Linear(16, 48), "out_proj": nn.Linear(16, 16)})})
    reason = recognize(fused).unsupported["attn.Wqkv"]
    assert "could not be told from the module and its config" in reason


def test_a_tied_weight_planned_at_one_end_only_is_refused_before_launch():
    """BERT's MLM decoder is tied to its word embeddings; the automatic plan shards the embedding on the vocabulary but
    does not recognise the decoder as the head. Applied, the tie failed on every rank after launch; the plan's
    validation (run before launch) now refuses it, naming both ends. Stock GPT-2 (both ends sharded alike) passes."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64))  # fmt: skip
    with pytest.raises(TensorParallelPlanError, match="tied to cls.predictions.decoder.weight") as error:
        infer_plan(bert).validate(2)
    assert "bert.embeddings.word_embeddings.weight" in str(error.value) and "fsdp2" in str(error.value)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0))
    infer_plan(gpt2).validate(2)


def test_activation_checkpointing_turns_off_a_hugging_face_generation_cache():
    """T5's decoder fills a key/value cache during forward when ``use_cache`` is on, so a recomputed block saves fewer
    tensors and torch refuses the backward (51 vs 47). transformers turns the cache off under its own gradient
    checkpointing; the blocks we checkpoint from outside get the same."""
    from transformers import T5Config, T5ForConditionalGeneration

    from lightning_dist.parallel.activation_checkpointing import (
        apply_activation_checkpointing,
        turn_off_generation_cache,
    )

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                dropout_rate=0.0, decoder_start_token_id=0))  # fmt: skip
    stacks = ("encoder.block", "decoder.block")
    blocks = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[0] in stacks]
    assert len(apply_activation_checkpointing(model, blocks)) == 4
    x = torch.randint(2, 64, (2, 8))
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        model(input_ids=x, decoder_input_ids=x, labels=x).loss.backward()
    model.zero_grad()
    changed = turn_off_generation_cache(model)
    assert changed and not model.config.use_cache and not model.decoder.config.use_cache
    model(input_ids=x, decoder_input_ids=x, labels=x).loss.backward()
