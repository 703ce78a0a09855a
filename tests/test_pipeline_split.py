"""Pipeline planning, schedule checks and the stage cut, in one process (fast): which units go to which stage, the
errors for splits and micro-batch settings that cannot run, and stages cut from an unchanged model that, run one
after another, compute exactly what the whole model computes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from examples.gpt import GPT
from lightning_dist.parallel.grad_clip import total_grad_norm
from lightning_dist.parallel.pipeline import (
    PipelinedCallError,
    StageCutError,
    all_reduce_tied_gradients,
    bubble_fraction_formula,
    capture_call,
    count_tied_copies_once,
    cut_pipeline_stages,
    default_n_microbatches,
    find_pipeline_units,
    find_tied_parameters,
    model_inputs_as_kwargs,
    plan_stages,
    rehearse_stages,
    resolve_stages_per_rank,
    stage_ids_for_rank,
    stage_runtime,
    substituted_forward,
    tied_layouts_agree,
    validate_microbatching,
)
from lightning_dist.parallel.pipeline.outputs import rebuild_output


def small_gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, seq_len=16, d_model=16, n_layer=n_layer, n_head=2).double()


def run_in_sequence(parts: list[nn.Module], inputs: dict) -> object:
    """Run stage modules one after another in this process, as the pipeline would across ranks."""
    value = parts[0](**inputs)
    for part in parts[1:]:
        value = part(value, **inputs)
    return rebuild_output(value, stage_runtime(parts[-1]).output_recipe)


# ------------------------------------------------------------------------------------------------ planning
def test_auto_split_balances_blocks_counting_embedding_and_head_as_one_block_each():
    model = small_gpt(4)
    assert find_pipeline_units(model)[0] == ["tok_emb", "pos_emb", *[f"blocks.{i}" for i in range(4)], "ln_f", "head"]
    assert plan_stages(model, 2).describe() == [
        "stage 0: tok_emb, pos_emb, blocks.0-1",
        "stage 1: blocks.2-3, ln_f, head",
    ]
    assert plan_stages(model, 3).describe() == [
        "stage 0: tok_emb, pos_emb, blocks.0",
        "stage 1: blocks.1-2",
        "stage 2: blocks.3, ln_f, head",
    ]
    four = plan_stages(model, 4).stages
    assert four[0] == ("tok_emb", "pos_emb", "blocks.0") and four[3] == ("blocks.3", "ln_f", "head")
    eight = plan_stages(small_gpt(8), 4).describe()
    assert eight == [
        "stage 0: tok_emb, pos_emb, blocks.0-1",
        "stage 1: blocks.2-4",
        "stage 2: blocks.5-6",
        "stage 3: blocks.7, ln_f, head",
    ]


def test_split_by_stage_starts_and_by_lists():
    model = small_gpt(4)
    by_start = plan_stages(model, 2, ["blocks.1"])
    assert by_start.stages[0] == ("tok_emb", "pos_emb", "blocks.0")
    by_lists = plan_stages(
        model, 2, [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]]
    )
    assert by_lists == by_start
    # a container name stands for all the units inside it
    whole_blocks = plan_stages(model, 2, [["tok_emb", "pos_emb", "blocks"], ["ln_f", "head"]])
    assert whole_blocks.stages[0][-1] == "blocks.3"


@pytest.mark.parametrize(
    ("num_stages", "split", "message"),
    [
        (5, "auto", "has 4 blocks"),
        (2, ["blocks.9"], "not pipeline units"),
        (3, ["blocks.1"], "makes 2 stages"),
        (3, ["blocks.2", "blocks.1"], "distinct, in model order"),
        (
            2,
            [["tok_emb", "pos_emb", "blocks.0"], ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]],
            "in stage 0 and in stage 1",
        ),
        (
            2,
            [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]],
            "leaves ['ln_f'] on no stage",
        ),
        (2, [["tok_emb", "pos_emb", "blocks.0.attn"], ["blocks"]], "neither a pipeline unit"),
        (2, "even", "expected 'auto'"),
    ],
)
def test_split_errors_name_the_problem(num_stages, split, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_stages(small_gpt(4), num_stages, split)


def test_parameters_held_beside_the_blocks_are_refused():
    class WithToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls = nn.Parameter(torch.zeros(4))
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    with pytest.raises(ValueError, match=r"holds parameters directly \(cls\)"):
        plan_stages(WithToken(), 2)


def test_stage_ids_per_rank_loop_and_v():
    assert [stage_ids_for_rank(r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids_for_rank(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_ids_for_rank(0, 2, 3, "v")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_tied_parameters_across_stages_are_found():
    model = Tied()
    (tie,) = find_tied_parameters(model, plan_stages(model, 2))
    assert tie.names == ("emb.weight", "head.weight") and tie.stages == (0, 1)
    assert find_tied_parameters(model, plan_stages(model, 1)) == []


@pytest.mark.parametrize("same_layout", [None, [True]])
def test_tied_copies_take_the_summed_gradient_and_count_once_in_the_norm(same_layout):
    """Two copies of a tied weight (as two stages hold them) each get the sum of both gradients; clipping's global
    norm counts that gradient once, as one process does for the one weight (it counted it on every stage)."""
    model = Tied()
    (tie,) = find_tied_parameters(model, plan_stages(model, 2))
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())  # the last stage's own copy
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    summed = model.emb.weight.grad + model.head.weight.grad
    assert tied_layouts_agree(model, [tie], [None]) == [True]
    all_reduce_tied_gradients(model, [tie], [None], same_layout)
    assert torch.equal(model.emb.weight.grad, summed) and torch.equal(model.head.weight.grad, summed)
    assert model.emb.weight.grad is not model.head.weight.grad  # clipping scales each copy once
    count_tied_copies_once(model, [tie])
    once = torch.cat([g.flatten() for g in (summed, *(p.grad for p in model.blocks.parameters()))])
    assert torch.allclose(total_grad_norm(model.parameters()), torch.linalg.vector_norm(once))


def test_units_follow_the_forward_not_registration_order():
    """litgpt's GPT registers lm_head before transformer: ordering by registration put the head on stage 0 (and the
    run failed: "lm_head of the earlier stage 0 runs after this stage's modules began"). With the head tied to the
    embedding, the tie lists the embedding (stage 0) first; stages run in sequence equal the whole model."""
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPT

    torch.manual_seed(0)
    config = Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=4, n_head=4, n_embd=16)
    model = LitGPT(config).double()
    model.lm_head.weight = model.transformer.wte.weight
    units, blocks = find_pipeline_units(model)
    assert units == ["transformer.wte", *blocks, "transformer.ln_f", "lm_head"]
    plan = plan_stages(model, 2)
    assert plan.stages == (
        ("transformer.wte", "transformer.h.0", "transformer.h.1"),
        ("transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"),
    )
    (tie,) = find_tied_parameters(model, plan)
    assert tie.names == ("transformer.wte.weight", "lm_head.weight") and tie.stages == (0, 1)
    reference = copy.deepcopy(model)
    parts = cut_pipeline_stages(model, plan, [0, 1], "cpu")
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(run_in_sequence(parts, model_inputs_as_kwargs(reference, (ids,), {})), reference(ids))


# ------------------------------------------------------------------------------------------------ schedules
def test_schedule_checks_name_option_value_and_fix():
    with pytest.raises(ValueError, match="not a pipeline schedule"):
        resolve_stages_per_rank("chimera", None)
    assert resolve_stages_per_rank("1f1b", None) == 1 and resolve_stages_per_rank("interleaved_1f1b", None) == 2
    with pytest.raises(ValueError, match="stages_per_rank=2.*interleaved_1f1b"):
        resolve_stages_per_rank("1f1b", 2)
    with pytest.raises(ValueError, match="exactly 2 stage"):
        resolve_stages_per_rank("zbv_zero_bubble", 3)
    with pytest.raises(ValueError, match="stages_per_rank=1"):
        resolve_stages_per_rank("looped_bfs", 1)
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by n_microbatches=4.*\[1, 2, 3, 6\]"):
        validate_microbatching("gpipe", 6, 4, 2, 1)
    with pytest.raises(ValueError, match="at least as many micro-batches as stages \\(4\\), but n_microbatches=2"):
        validate_microbatching("1f1b", 8, 2, 4, 1)
    with pytest.raises(ValueError, match="n_microbatches=7 must be a multiple of .* = 3"):
        validate_microbatching("interleaved_1f1b", 14, 7, 2, 2)
    validate_microbatching("dualpipev", 8, 4, 2, 2)


def test_default_microbatches_come_from_the_batch_size():
    assert default_n_microbatches("1f1b", 8, 2, 1) == 4  # at least 4·(p−1)
    assert default_n_microbatches("1f1b", 32, 4, 1) == 16
    assert default_n_microbatches("gpipe", 3, 4, 1) == 3  # the batch is too small: the largest divisor
    with pytest.raises(ValueError, match="No number of micro-batches"):
        default_n_microbatches("1f1b", 2, 4, 1)
    assert bubble_fraction_formula("1f1b", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction_formula("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)


# ------------------------------------------------------------------------------------------------ the stage cut
@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_run_in_sequence_equal_the_whole_model_and_keep_names(num_stages):
    model = small_gpt(4)
    reference = copy.deepcopy(model)
    plan = plan_stages(model, num_stages)
    parts = cut_pipeline_stages(model, plan, list(range(num_stages)), "cpu")
    for batch in (2, 3):  # another batch shape needs no new cut
        ids = torch.randint(0, 64, (batch, 16))
        out = run_in_sequence(parts, model_inputs_as_kwargs(reference, (ids,), {}))
        assert torch.equal(out, reference(ids))
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]
    assert next(n for n, _ in parts[1].named_parameters()).startswith(plan.stages[1][0] + ".")


def test_the_cut_model_keeps_only_this_ranks_parameters_and_meta_stays_meta():
    with torch.device("meta"):
        model = GPT(vocab_size=64, seq_len=16, d_model=16, n_layer=4, n_head=2)
    plan = plan_stages(model, 4)
    (part,) = cut_pipeline_stages(model, plan, [2], "cpu")
    local = [n for n, _ in model.named_parameters()]
    assert local and all(n.startswith("blocks.2.") for n in local)
    assert [n for n, _ in part.named_parameters()] == local
    part.to_empty(device="cpu")  # materialise this stage only
    assert not any(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="lives on pipeline stage 0 of another rank"):
        model.tok_emb(torch.zeros(1, dtype=torch.long))


def test_positional_model_calls_become_keywords():
    model = small_gpt(2)
    ids = torch.zeros(1, 4, dtype=torch.long)
    inputs = model_inputs_as_kwargs(model, (ids,), {})
    assert list(inputs) == ["input_ids"] and inputs["input_ids"] is ids  # defaults stay defaults
    with pytest.raises(TypeError):
        model_inputs_as_kwargs(model, (ids, None, 3), {})


class SkipFromEmbedding(nn.Module):
    """Every block also reads the embedding output: a value that would have to cross stages besides the hidden."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x0 = self.emb(ids)
        x = x0
        for block in self.blocks:
            x = block(x) + x0
        return self.head(x)


class ReadsEmbeddingWeight(SkipFromEmbedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return x @ self.emb.weight.T


class HeadRegisteredFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize(
    ("model_cls", "make_input", "message"),
    [
        (SkipFromEmbedding, lambda: torch.zeros(2, 3, dtype=torch.long), "depends on what modules of an earlier stage"),
        (ReadsEmbeddingWeight, lambda: torch.zeros(2, 3, dtype=torch.long), "reads emb.weight, which lives on"),
        (HeadRegisteredFirst, lambda: torch.zeros(2, 4), "head of the earlier stage 0 runs after this stage's"),
    ],
)
def test_forwards_the_cut_cannot_follow_fail_with_the_split_fix(model_cls, make_input, message):
    model = model_cls()
    parts = cut_pipeline_stages(model, plan_stages(model, 2), [0, 1], "cpu")
    x = make_input()
    with pytest.raises((StageCutError, AttributeError), match=message) as err:
        run_in_sequence(parts, model_inputs_as_kwargs(model, (x,), {}))
    assert "Pass split=" in str(err.value)


# ------------------------------------------------------------------------------------------------ refused before launch
def test_a_one_block_model_is_told_it_has_one_block_for_two_stages():
    model = small_gpt(1)
    with pytest.raises(ValueError, match=r"The model has 1 block \(blocks\.0\) for 2 pipeline stages"):
        plan_stages(model, 2)
    by_hand = plan_stages(model, 2, [["tok_emb", "pos_emb", "blocks"], ["ln_f", "head"]])
    assert by_hand.blocks == ("blocks.0",) and by_hand.describe() == [
        "stage 0: tok_emb, pos_emb, blocks.0",
        "stage 1: ln_f, head",
    ]


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                      decoder_start_token_id=0)  # fmt: skip
    return T5ForConditionalGeneration(config)


@pytest.mark.parametrize("split", ["auto", ["decoder.block.0"], [["shared", "encoder"], ["decoder", "lm_head"]]])
def test_encoder_decoder_models_are_refused_whatever_the_split(split):
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration is an encoder–decoder model \(blocks in"
                       r" encoder\.block\.\*, decoder\.block\.\*\): encoder–decoder models are not supported under"
                       r" pipeline.*Use fsdp2"):  # fmt: skip
        plan_stages(_t5(), 2, split)


def test_torchs_own_transformer_is_an_encoder_decoder_too():
    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 8)
            self.body = nn.Transformer(8, 2, 2, 2, 16, batch_first=True)

        def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return self.body(self.emb(src), self.emb(tgt))

    with pytest.raises(ValueError, match=r"Seq2Seq is an encoder–decoder model \(blocks in body\.encoder\.layers\.\*,"):
        plan_stages(Seq2Seq(), 2)


def _vit(layers: int = 2) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                       intermediate_size=32, num_labels=3)  # fmt: skip
    return ViTForImageClassification(config)


def test_the_rehearsal_on_meta_finds_a_module_read_across_stages_with_the_line_that_reads_it():
    model = _vit()
    before = [(n, type(m), tuple(p.device for p in m.parameters(recurse=False))) for n, m in model.named_modules()]
    images = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 0])}
    with pytest.raises(StageCutError, match=r"(?s)Pipeline stage 1 .*reads vit\.embeddings\.patch_embeddings, which lives"
                       r" on pipeline stage 0.*Found before launch.*modeling_vit\.py:\d+ in forward: expected_dtype ="):  # fmt: skip
        rehearse_stages(model, plan_stages(model, 2), images)
    after = [(n, type(m), tuple(p.device for p in m.parameters(recurse=False))) for n, m in model.named_modules()]
    assert after == before  # the model itself was not cut: a meta copy was
    assert rehearse_stages(model, plan_stages(model, 2)) is False  # token ids do not fit: nothing to rehearse


def test_the_rehearsal_passes_what_the_cut_runs_and_refuses_what_it_cannot_follow():
    gpt = small_gpt(4)
    for stages in (2, 4):
        assert rehearse_stages(gpt, plan_stages(gpt, stages)) is True
    assert rehearse_stages(gpt, plan_stages(gpt, 2), {"input_ids": torch.zeros(3, 5, dtype=torch.long)}) is True
    for model_cls, message in [(SkipFromEmbedding, "depends on what modules of an earlier stage"),
                               (ReadsEmbeddingWeight, r"reads emb\.weight, which lives on.* in forward: return x @")]:  # fmt: skip
        model = model_cls()
        with pytest.raises(StageCutError, match=f"(?s){message}"):
            rehearse_stages(model, plan_stages(model, 2))


# ------------------------------------------------------------------------------------------------ forward substitution
def test_a_step_calling_the_model_once_is_captured_and_substituted():
    model = small_gpt(2)
    ids = torch.zeros(2, 4, dtype=torch.long)

    def step() -> torch.Tensor:
        logits = model(ids)
        return logits.sum()

    args, kwargs = capture_call(model, step)
    assert args[0] is ids and kwargs == {}
    with substituted_forward(model, torch.ones(2, 4, 64)):
        assert step().item() == 2 * 4 * 64
    assert "forward" not in model.__dict__  # restored

    with pytest.raises(PipelinedCallError, match="never called GPT"):
        capture_call(model, lambda: None)
    with pytest.raises(PipelinedCallError, match="more than once"), substituted_forward(model, torch.ones(1)):
        model(ids) + model(ids)
