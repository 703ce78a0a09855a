"""ContextParallelStrategy: names and options, early errors, batch sharding, position filling and Hugging Face
causal-LM recognition (no launch), and real Trainers (tests/scenarios/context_parallel_runs.py) training exactly as
one process trains on the whole sequence (fp64):

* 2 processes: the unchanged example GPT (ring, all-gather with activation checkpointing, Ulysses) and a stock
  ``transformers`` ``LlamaForCausalLM`` whose labels are shifted inside the model (every algorithm, and uneven
  ignored labels per shard), with controls; a DCP checkpoint resumed under fsdp2 and back;
* 4 processes: cp=4 and dp2 × cp2 for both models, and the counts of benchmarks/studies/context_parallel.py.
"""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from launch import max_abs_diff, run_scenarios
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn

from examples.gpt import GPT
from lightning_dist import ContextParallelStrategy
from lightning_dist.parallel.context_parallel.batch import (
    NotASequenceError,
    fill_positions,
    parse_sequence_keys,
    sequence_entries,
    shard_batch,
)
from lightning_dist.parallel.context_parallel.dispatch import local_positions, shard_sequence
from lightning_dist.parallel.context_parallel.labels import (
    PackedOrPaddedError,
    check_plain_causal,
    find_causal_lm,
    is_causal_lm,
)
from lightning_dist.parallel.context_parallel.outputs import watch_pooled_outputs
from lightning_dist.parallel.context_parallel.rope_tables import global_rope_rows
from lightning_dist.parallel.mesh import MeshConfigError
from lightning_dist.parallel.model_structure import recognize
from lightning_dist.strategies.lifecycle.first_batch import first_batch

TOL = 1e-10  # fp64: the same operations in another order across two processes
# transformers' ForCausalLMLoss computes the loss in fp32 (it upcasts the logits with .float(), so fp64 logits are
# cast down), in the one-process reference too: loss values agree to a few fp32 ulps (2.4e-7 at losses in [2, 4)).
# Its gradient is exact (the per-token fp32 gradients are those of one process times cp, a power of two), so
# gradient norms and parameters are compared at TOL.
HF_LOSS_RTOL = 1e-6  # about 8 fp32 epsilons, relative


def _max_relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _trainer(strategy, devices: int = 2) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, max_steps=1)


def _gpt(**kwargs) -> GPT:
    return GPT(**{"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4, **kwargs})


@pytest.mark.parametrize(
    ("name", "attention", "layout"),
    [
        ("context_parallel", "ring", "zigzag"),
        ("context_parallel_allgather", "allgather", "zigzag"),
        ("context_parallel_ulysses", "ulysses", "contiguous"),
    ],
)
def test_registered_names_and_the_mesh(name, attention, layout):
    assert StrategyRegistry[name]["strategy"] is ContextParallelStrategy and StrategyRegistry[name]["description"]
    strategy = _trainer(name).strategy
    assert (strategy.attention, strategy.load_balance) == (attention, layout)
    assert (strategy.parallel_dims.cp, strategy.parallel_dims.dp_shard) == (2, 1)
    # both cp ranks see the same samples
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_fewer_than_two_cp_ranks_and_unknown_options_are_refused():
    with pytest.raises(MeshConfigError, match=r"context_parallel_size=1: context parallelism needs at least 2"):
        _trainer(ContextParallelStrategy(data_parallel_shard_size=2))
    with pytest.raises(MeshConfigError, match=r"context_parallel_size=1"):
        _trainer("context_parallel", devices=1)
    with pytest.raises(ValueError, match=r"attention='flash' is not one of \['ring', 'allgather', 'ulysses'\]"):
        ContextParallelStrategy(attention="flash")
    with pytest.raises(ValueError, match=r"load_balance='striped'"):
        ContextParallelStrategy(load_balance="striped")
    with pytest.raises(ValueError, match=r"'name' or 'name:dim'"):
        ContextParallelStrategy(sequence_keys=["input_ids:x"])


def test_a_sequence_not_divisible_by_two_cp_names_the_entry_and_the_fix():
    batch = {"input_ids": torch.zeros(2, 30, dtype=torch.long), "labels": torch.zeros(2, 30, dtype=torch.long)}
    entries, seq_len = sequence_entries(batch, None)
    assert (entries, seq_len) == ({"input_ids": 1, "labels": 1}, 30)
    with pytest.raises(ValueError, match=r"(?s)'input_ids' \(sequence length 30\).*divisible by 2·cp = 4.*e\.g\. 32"):
        shard_batch(batch, entries, cp=2, rank=0, layout="zigzag")
    shard_batch(batch, entries, cp=2, rank=0, layout="contiguous")  # 30 is divisible by cp
    with pytest.raises(ValueError, match=r"divisible by cp = 4"):
        shard_batch(batch, entries, cp=4, rank=0, layout="contiguous")


def test_every_sequence_tensor_of_a_nested_batch_is_sharded():
    ids = torch.arange(2 * 8).view(2, 8)
    batch = {"input_ids": ids, "extra": [ids.clone(), torch.ones(2, 3)], "scalar": torch.tensor(1.0), "name": "x"}
    entries, seq_len = sequence_entries(batch, None)
    assert (entries, seq_len) == ({"input_ids": 1, "extra.0": 1}, 8)
    sharded = shard_batch(batch, entries, cp=2, rank=1, layout="zigzag")
    assert torch.equal(sharded["input_ids"], shard_sequence(ids, 2, 1, "zigzag"))
    assert torch.equal(sharded["extra"][0], sharded["input_ids"]) and sharded["extra"][1].shape == (2, 3)
    assert sharded["name"] == "x" and sharded["scalar"] is batch["scalar"]
    keys = parse_sequence_keys(["input_ids", "extra.0:1"])
    assert sequence_entries(batch, keys) == ({"input_ids": 1, "extra.0": 1}, 8)
    with pytest.raises(ValueError, match=r"sequence_keys \['labels'\] are not tensors of the batch"):
        sequence_entries(batch, {"labels": 1})


def test_positions_are_filled_only_when_the_caller_passes_none():
    model, seen = _gpt(), []
    model.pos_emb.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    model.register_forward_pre_hook(fill_positions(model, "position_ids", 16, 2, 1, "zigzag"), with_kwargs=True)
    ids = torch.zeros(3, 8, dtype=torch.long)
    expected = local_positions(16, 2, 1, "zigzag").expand(3, -1)  # [4..7, 8..11]
    model(ids, None)  # as GPT._loss calls it: positions passed positionally, as None
    model(ids)
    model(input_ids=ids)
    assert all(torch.equal(s, expected) for s in seen) and len(seen) == 3
    mine = torch.arange(8).unsqueeze(0)
    model(ids, position_ids=mine)  # positions the caller passes are kept
    assert seen[-1] is mine
    # Lightning's redirection of training_step through the root's __call__: the hook leaves its arguments alone
    model.forward = lambda batch, batch_idx: model.__class__.forward(model, batch["input_ids"])
    model({"input_ids": ids}, 0)
    assert torch.equal(seen[-1], torch.arange(8).unsqueeze(0))


def test_a_keyword_only_positions_argument_is_filled_as_a_keyword():
    class KeywordOnly(nn.Module):
        def forward(self, x: torch.Tensor, *extra: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
            return positions

    module = KeywordOnly()
    module.register_forward_pre_hook(fill_positions(module, "positions", 8, 2, 0, "zigzag"), with_kwargs=True)
    x = torch.zeros(2, 4)
    assert torch.equal(module(x, x, x), local_positions(8, 2, 0, "zigzag").expand(2, -1))


class _NoPositionsArgument(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(64, 16), nn.Embedding(16, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok_emb(input_ids) + self.pos_emb(torch.arange(input_ids.shape[1])))


def test_learned_positions_without_a_positions_argument_fail_before_launch(monkeypatch):
    def refuse(self: _SubprocessScriptLauncher) -> None:
        raise AssertionError("processes were launched although the model cannot be trained correctly")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)
    with pytest.raises(ValueError, match=r"(?s)learned position embedding \(pos_emb\).*_NoPositionsArgument"):
        _trainer("context_parallel").fit(_NoPositionsArgument())
    with pytest.raises(ValueError, match=r"attention='ulysses' splits heads over cp=2, but blocks.0.attn has 3 heads"):
        _trainer("context_parallel_ulysses").fit(_gpt(d_model=48, n_head=3))


def _tiny_llama(**options):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, **options,
    )  # fmt: skip
    return LlamaForCausalLM(config), LlamaModel(config)


def test_hugging_face_causal_lms_are_recognised_by_their_loss():
    lm, base = _tiny_llama()
    wrapper = nn.Module()
    wrapper.model = lm
    assert is_causal_lm(lm) and find_causal_lm(wrapper) == "model" and find_causal_lm(lm) == ""
    assert not is_causal_lm(base) and find_causal_lm(_gpt()) is None  # no loss from labels / not Hugging Face
    lm.loss_function = lambda logits, labels, **kwargs: logits.sum()  # a custom loss: its shift is unknown
    assert not is_causal_lm(lm)


def test_a_hugging_face_model_whose_attention_is_not_sdpa_is_refused_before_launch():
    wrapper = nn.Module()
    wrapper.model = _tiny_llama(attn_implementation="eager")[0]
    with pytest.raises(
        ValueError, match=r"model \(LlamaForCausalLM\) computes attention with attn_implementation='eager'"
    ):
        _trainer("context_parallel").strategy.check_model(wrapper)


def test_padding_masks_and_packed_positions_are_refused_for_a_causal_lm():
    positions = local_positions(16, 2, 1, "zigzag").unsqueeze(0)
    check_plain_causal("LlamaForCausalLM", {"attention_mask": torch.ones(2, 8), "position_ids": positions}, 16, 2, 1,
                       "zigzag")  # fmt: skip
    padded = torch.ones(2, 8).index_fill_(1, torch.tensor([7]), 0)
    with pytest.raises(PackedOrPaddedError, match=r"LlamaForCausalLM got an attention_mask with padding"):
        check_plain_causal("LlamaForCausalLM", {"attention_mask": padded}, 16, 2, 1, "zigzag")
    with pytest.raises(PackedOrPaddedError, match=r"position_ids that are not the global positions 0\.\.15"):
        check_plain_causal("LlamaForCausalLM", {"position_ids": torch.arange(8).unsqueeze(0)}, 16, 2, 1, "zigzag")


def test_a_batch_without_token_sequences_is_refused_naming_its_tensors():
    """Sets of points, feature vectors and images hold no integer ``[batch, sequence]`` tensor: their first dim after
    the batch is not a sequence, and the message says so (not "pad the sequences"). Named entries are split."""
    sets = {"x": torch.randn(4, 16, 4, dtype=torch.float64), "y": torch.randn(4, dtype=torch.float64)}
    for batch, shown in [
        (sets, r"x: \(4, 16, 4\) float64, y: \(4,\) float64"),
        ((torch.randn(4, 16), torch.randn(4)), r"0: \(4, 16\) float32, 1: \(4,\) float32"),
        ({"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 0])},
         r"pixel_values: \(4, 3, 32, 32\) float32, labels: \(4,\) int64"),
    ]:  # fmt: skip
        with pytest.raises(NotASequenceError, match=rf"(?s)holds none.*{shown}.*strategy='fsdp2'.*sequence_keys"):
            sequence_entries(batch, None)
    assert sequence_entries(sets, parse_sequence_keys(["x"])) == ({"x": 1}, 16)
    # token ids decide the length; float per-token entries of that length (inputs_embeds, weights) are split too
    tokens = {"embeds": torch.randn(2, 8, 4), "input_ids": torch.zeros(2, 8, dtype=torch.long), "w": torch.ones(2, 3)}
    assert sequence_entries(tokens, None) == ({"embeds": 1, "input_ids": 1}, 8)


class _Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(dim=1))


def test_a_model_call_that_pools_the_sequence_away_is_found():
    """The first step's model calls are watched: a call given this rank's shard (8 of 16 positions) that returns no
    tensor keeping them is named with its output shape; a per-token model and a scalar loss are not."""

    class Step(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(ids).float().mean()

    ids = torch.zeros(2, 8, dtype=torch.long)
    messages = {}
    for model in (_Pooled(), _gpt()):
        root = Step(model)
        with watch_pooled_outputs(root, 16, 2) as found:
            root(ids)
        messages[type(model).__name__] = [str(err) for err in found]
    assert messages["GPT"] == [] and len(messages["_Pooled"]) == 1
    assert re.search(
        r"(?s)in training_step, model \(_Pooled\) got sequences sharded over cp=2 \(8 of 16 positions.*returned an"
        r" output of shape \(2, 3\), which has no sequence dimension.*strategy='fsdp2'",
        messages["_Pooled"][0],
    )


def _litgpt(seq_len: int = 16) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPT

    return LitGPT(Config(block_size=seq_len, vocab_size=64, padded_vocab_size=64, n_layer=1, n_head=4, n_embd=32,
                         rotary_percentage=1.0, mlp_class_name="LLaMAMLP", intermediate_size=64))  # fmt: skip


def test_litgpt_input_pos_is_inference_and_its_rotary_tables_get_the_global_rows():
    """litgpt's ``GPT.forward(idx, input_pos=None)``: given ``input_pos`` it takes its key/value-cache path, so it is
    no positions argument; in training it slices ``self.cos[:T]``/``self.sin[:T]``, so for a step the tables hold the
    rows of the shard's global positions (and the whole tables again after)."""
    model = _litgpt()
    structure = recognize(model)
    assert structure.positions_argument is None and structure.rope_tables == ("", ("cos", "sin"))
    assert recognize(_gpt()).positions_argument == ("", "position_ids") and recognize(_gpt()).rope_tables is None
    cos, sin = model.cos, model.sin
    with global_rope_rows(model, ("cos", "sin"), 16, 2, 1, "zigzag"):
        rows = local_positions(16, 2, 1, "zigzag")  # 4..7, 8..11
        assert torch.equal(model.cos, cos[rows]) and torch.equal(model.sin, sin[rows])
    assert model.cos is cos and model.sin is sin
    too_long = global_rope_rows(model, ("cos", "sin"), 32, 2, 0, "zigzag")
    with pytest.raises(
        ValueError, match=r"GPT's rotary tables \(cos/sin\) have 16 rows, fewer than the sequence length 32"
    ):
        too_long.__enter__()


def test_vit_and_t5_are_refused_for_their_real_position_encodings():
    """ViT's learned ``position_embeddings`` is a parameter (it was missed: "no learned position embedding"); T5's
    decoder token embedding is a tied copy, not a learned position embedding: T5 is refused for its learned relative
    position bias."""
    from transformers import T5Config, T5ForConditionalGeneration, ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32, num_labels=3))  # fmt: skip
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    structure = recognize(t5)
    assert structure.other_embeddings == [] and structure.position_parameters == []
    assert structure.attention_biases == [f"{part}.block.0.layer.0.SelfAttention.relative_attention_bias"
                                          for part in ("encoder", "decoder")]  # fmt: skip
    strategy = _trainer("context_parallel").strategy
    with pytest.raises(
        ValueError,
        match=r"(?s)learned position embedding \(vit\.embeddings\.position_embeddings\).*not a sequence model.*fsdp2",
    ):
        strategy.check_model(vit)
    with pytest.raises(
        ValueError,
        match=r"(?s)T5ForConditionalGeneration's attention adds a learned relative position bias \(encoder\.block",
    ) as refused:
        strategy.check_model(t5)
    assert "embed_tokens" not in str(refused.value) and "learned position embedding" not in str(refused.value)


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((3,), float(index)), "y": torch.tensor(index * index)}


class _SquaresData(L.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.dataset = _Squares()
        self.split_seed = torch.randint(100, ())  # setup draws from the generator (a random split would)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.dataset, batch_size=2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.dataset, batch_size=4, shuffle=True)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_the_first_batch_is_read_before_launch_leaving_the_random_state_alone():
    """What the entry point was given, collated from the dataset's first samples; ``None`` where it cannot be read
    without launching. The generators draw afterwards exactly what they would have drawn."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=4, shuffle=True)
    batch = first_batch({"train_dataloaders": loader}, "fit")
    assert torch.equal(batch["y"], torch.tensor([0, 1, 4, 9])) and batch["x"].shape == (4, 3)
    assert first_batch({"datamodule": _SquaresData()}, "fit")["x"].shape == (4, 3)
    assert torch.equal(torch.rand(3), expected)
    assert first_batch({"datamodule": _SquaresData()}, "validate")["x"].shape == (2, 3)
    assert first_batch({"dataloaders": [loader]}, "predict")["x"].shape == (4, 3)
    iterable = torch.utils.data.DataLoader(_Stream(), batch_size=2)
    assert first_batch({"train_dataloaders": iterable}, "fit") is None
    assert first_batch({}, "fit") is None  # the LightningModule's own dataloaders: read after launch
    assert first_batch({"datamodule": _SquaresData()}, "test") is None  # no test_dataloader: not an error here


def test_a_datamodule_is_set_up_once_for_every_check_that_reads_the_first_batch():
    """hybrid3d pp × cp asks twice (the context-parallel and the pipeline check): ``setup`` runs once."""

    class Counting(_SquaresData):
        calls = 0

        def setup(self, stage: str) -> None:
            Counting.calls += 1
            super().setup(stage)

    arguments = {"datamodule": Counting()}
    first, second = first_batch(arguments, "fit"), first_batch(arguments, "fit")
    assert first is second and Counting.calls == 1


# ---------------------------------------------------------------------------------------------------- real runs
SCRIPT = "context_parallel_runs.py"
TWO_PROCESSES = [
    *("ring", "allgather_checkpointed", "ulysses", "without_positions"),
    *("hf_ignore_ring", "hf_allgather", "hf_ulysses", "hf_ignore_without_label_shift"),
    *("ckpt_context_parallel", "ckpt_fsdp2"),
    *("resume_context_parallel_under_fsdp2", "resume_fsdp2_under_context_parallel"),
    *("litgpt_ring", "litgpt_allgather", "litgpt_ulysses"),
    *("refused_pooled_classifier", "refused_declared_set", "refused_features"),
]
# each algorithm and each mesh in this launch, both models at cp=4 and dp2 × cp2; the other combinations
# (gpt_cp4_allgather, hf_cp4_allgather, gpt_dp2_cp2_ring...) pass too, left out for suite time (a 4-process
# scenario costs seconds on 2 cores). All-gather at cp=4 is also checked against SDPA in test_cp_attention.py.
FOUR_PROCESSES = [
    *("gpt_cp4_ring", "gpt_cp4_ulysses", "gpt_dp2_cp2_allgather"),
    *("hf_cp4_ring", "hf_dp2_cp2_ulysses"),
]

# Hybrid3DStrategy at pp2 × cp2: litgpt's GPT, and a stock LlamaForCausalLM called without labels (the loss from its
# logits, labels shifted by the dataset); then the same Llama given labels= (refused on the first step)
HYBRID3D_PP_CP = ["litgpt_pp2_cp2", "hf_logits_pp2_cp2", "refused_hf_labels_pp2_cp2"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("context_parallel")


@pytest.fixture(scope="module")
def runs(workdir):
    references = run_scenarios(
        SCRIPT,
        1,
        workdir,
        ["reference", "hf_reference", "hf_ignore_reference", "litgpt_reference", "hf_logits_reference"],
    )
    return {**references, **run_scenarios(SCRIPT, 2, workdir, TWO_PROCESSES)}


@pytest.fixture(scope="module")
def runs4(runs, workdir):
    return run_scenarios(SCRIPT, 4, workdir, [*FOUR_PROCESSES, "attention_counts", *HYBRID3D_PP_CP])


def _reference(runs, name: str) -> dict:
    return runs["hf_ignore_reference" if "ignore" in name else "hf_reference" if name.startswith("hf") else "reference"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring", "allgather_checkpointed", "ulysses"])
def test_cp2_trains_the_unchanged_gpt_as_one_process(runs, name):
    reference, result = runs["reference"], runs[name]
    assert result["positions"] == ["", "position_ids"]
    assert max_abs_diff(result["losses"], reference["losses"]) <= TOL
    assert max_abs_diff(result["grad_norms"], reference["grad_norms"]) <= TOL
    assert result["same_keys"] and result["param_diff"] <= TOL
    assert abs(result["val"]["val_loss"] - reference["val"]["val_loss"]) <= TOL
    assert result["val"]["val_acc"] == reference["val"]["val_acc"]
    # predictions are gathered back to the whole sequence, in order
    assert result["prediction_shapes"] == [[8, 32], [8, 32]] and result["predictions_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["litgpt_ring", "litgpt_allgather", "litgpt_ulysses"])
def test_cp2_trains_a_stock_litgpt_gpt_as_one_process(runs, name):
    """litgpt's ``GPT`` (0.5.13): its ``input_pos`` (key/value-cache inference) is left alone, and its rotary tables
    hold the shard's global rows for each step."""
    reference, result = runs["litgpt_reference"], runs[name]
    assert result["positions"] is None and result["rope_tables"] == ["gpt", ["cos", "sin"]]
    assert max_abs_diff(result["losses"], reference["losses"]) <= TOL
    assert max_abs_diff(result["grad_norms"], reference["grad_norms"]) <= TOL
    assert result["same_keys"] and result["param_diff"] <= TOL
    assert abs(result["val"]["val_loss"] - reference["val"]["val_loss"]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        # a sequence classifier: token ids in, mean-pooled logits out
        ("pooled_classifier", "PooledOutputError", (r"(?s)in training_step, PooledClassifier got sequences sharded"
         r" over cp=2 \(16 of 32 positions.*shape \(8, 3\), which has no sequence dimension.*strategy='fsdp2'")),
        # sequence_keys=["x"] declares the 16 points of a set a sequence: the mean over them is refused
        ("declared_set", "PooledOutputError", r"(?s)SetModel got sequences sharded over cp=2 \(8 of 16.*shape \(4,\)"),
        # the LightningModule's own train_dataloader (not readable before launch): refused on the first batch
        ("features", "NotASequenceError", r"(?s)this batch holds none.*x: \(4, 64\) float64.*strategy='fsdp2'"),
    ],
)  # fmt: skip
def test_what_cp_cannot_split_is_refused_before_the_first_optimizer_step(runs, case, error, message):
    result = runs[f"refused_{case}"]
    assert result["error"] == error and re.search(message, result["message"]), result
    assert result["optimizer_steps"] == 0 and not result["directory_left"]


@pytest.mark.slow
def test_without_global_positions_the_gpt_trains_wrong(runs):
    """The control: the example GPT's own arange positions are wrong on rank 1's shard."""
    assert runs["without_positions"]["positions"] is None
    assert max_abs_diff(runs["without_positions"]["losses"], runs["reference"]["losses"]) > 1e-3


@pytest.mark.slow
def test_a_later_batch_of_another_length_is_checked_too(runs):
    """Each batch is checked when it is sharded: after two steps at length 32, a batch of 24 is sharded and one of
    30 gets the error naming the entry and the fix."""
    later = runs["ring"]["later_batches"]
    assert later["24"] == [2, 12]
    assert "'input_ids' (sequence length 30)" in later["30"] and "divisible by 2·cp = 4" in later["30"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_ignore_ring", "hf_allgather", "hf_ulysses"])
def test_cp2_trains_a_stock_hf_llama_that_shifts_labels_inside(runs, name):
    """``self.model(input_ids=x, labels=x).loss`` with GQA: the strategy passes global positions, computes the causal
    mask the model builds from them as causal attention, and shifts the labels over the whole sequence."""
    reference, result = _reference(runs, name), runs[name]
    assert result["causal_lm"] == "model" and result["explicit_masks"] == "causal"
    assert result["positions"] == ["model", "position_ids"]
    # with the attention mask of ones the strategy passes, the model builds no mask: SDPA gets is_causal and the
    # 2 key/value heads unexpanded (4 query heads), which is what ring and all-gather send
    assert result["attention_heads"] == [[4, 2]] and not result["explicit_mask_seen"]
    assert result["same_keys"] and result["param_diff"] <= TOL
    assert max_abs_diff(result["grad_norms"], reference["grad_norms"]) <= TOL
    assert _max_relative_diff(result["losses"], reference["losses"]) <= HF_LOSS_RTOL
    assert _max_relative_diff([result["val"]["val_loss"]], [reference["val"]["val_loss"]]) <= HF_LOSS_RTOL


@pytest.mark.slow
def test_uneven_ignored_labels_per_shard_give_the_whole_sequence_mean(runs):
    """Labels of frequent tokens are -100, so the shards count different numbers of labels; the loss is still the
    mean over the whole sequence (hf_ignore_ring above). The control leaves the model to shift within each shard
    and average over the shard's own labels."""
    counted = runs["hf_ignore_reference"]["counted_per_shard"]
    assert counted[0] != counted[1]
    control, reference = runs["hf_ignore_without_label_shift"], runs["hf_ignore_reference"]
    assert max_abs_diff(control["losses"], reference["losses"]) > 1e-3 and control["param_diff"] > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(("source", "target"), [("context_parallel", "fsdp2"), ("fsdp2", "context_parallel")])
def test_a_checkpoint_resumes_under_the_other_strategy(runs, source, target):
    """A context_parallel DCP checkpoint (mid-epoch, step 3 of 6) continues under fsdp2 as the uninterrupted
    context_parallel run did, and an fsdp2 checkpoint under context_parallel."""
    saved, resumed = runs[f"ckpt_{source}"], runs[f"resume_{source}_under_{target}"]
    assert saved["checkpoint_is_folder"] and saved["global_step"] == resumed["global_step"] == 6
    assert max_abs_diff(resumed["losses"], saved["losses"][3:]) <= TOL
    assert resumed["param_diff"] <= TOL
    assert max_abs_diff(runs["ckpt_context_parallel"]["losses"], runs["ckpt_fsdp2"]["losses"]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR_PROCESSES)
def test_cp4_and_dp2_cp2_train_as_one_process(runs, runs4, name):
    reference, result = _reference(runs, name), runs4[name]
    cp, dp = (4, 1) if "_cp4_" in name else (2, 2)
    assert result["mesh"] == {"cp": cp, "dp_shard": dp}
    assert result["same_keys"] and result["param_diff"] <= TOL
    assert max_abs_diff(result["grad_norms"], reference["grad_norms"]) <= TOL
    losses = [*result["losses"], result["val"]["val_loss"]]
    expected = [*reference["losses"], reference["val"]["val_loss"]]
    if name.startswith("hf"):
        assert result["attention_heads"] == [[4, 2]] and not result["explicit_mask_seen"]
        assert _max_relative_diff(losses, expected) <= HF_LOSS_RTOL
    else:
        assert max_abs_diff(losses, expected) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference"), [("litgpt_pp2_cp2", "litgpt_reference"),
                                                 ("hf_logits_pp2_cp2", "hf_logits_reference")])  # fmt: skip
def test_hybrid3d_pp2_cp2_trains_litgpt_and_a_llama_called_without_labels(runs, runs4, name, reference):
    """litgpt: each pipeline stage's copy of the rotary tables holds the shard's rows. The Llama module computes its
    loss from the logits, so nothing is refused although its batch has a key ``labels``."""
    result, expected = runs4[name], runs[reference]
    assert result["same_keys"] and result["param_diff"] <= TOL
    losses = [*result["losses"], result["val"]["val_loss"]]
    assert max_abs_diff(losses, [*expected["losses"], expected["val"]["val_loss"]]) <= TOL


@pytest.mark.slow
def test_hybrid3d_pp2_cp2_refuses_labels_that_reach_a_causal_lm_on_the_first_step(runs4):
    result = runs4["refused_hf_labels_pp2_cp2"]
    assert result["error"] == "ValueError" and result["optimizer_steps"] == 0 and not result["directory_left"]
    assert "training_step passes labels= to LlamaForCausalLM. Call the model without labels" in result["message"]


@pytest.mark.slow
def test_attention_memory_falls_as_1_over_cp_and_bytes_sent_equal_the_formulas(runs4):
    """benchmarks/studies/context_parallel.py at a small size: per-rank activation memory at a fixed global length is
    exactly 1/cp of one process's, the longest sequence within a fixed budget grows with cp, and every rank sends
    per layer what attention/costs.py says."""
    counts = runs4["attention_counts"]
    rows = {(row["algorithm"], row["cp"]): row for row in counts["rows"]}
    assert sorted(rows) == sorted((a, cp) for a in ("ring", "allgather", "ulysses") for cp in (1, 2, 4))
    for (algorithm, cp), row in rows.items():
        one = rows[(algorithm, 1)]
        assert row["activation_bytes"] * cp == one["activation_bytes"]
        longest = row["longest"]
        assert longest["bytes"] <= counts["budget"] < longest["next_bytes"]
        assert abs(longest["seq_len"] - cp * one["longest"]["seq_len"]) <= 2 * cp
        assert (row["sent_forward"], row["sent_backward"]) == (row["formula_forward"], row["formula_backward"])
        assert (row["sent_forward"] > 0) == (cp > 1)
