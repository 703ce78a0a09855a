"""The third-party models of the compatibility matrix (tiny configs), the task each is trained on, and the
LightningModule that trains it unchanged (the model in ``self.model``, no ``configure_model``).

Every model is built after ``seed_everything(SEED)``, so each rank and the one-process reference start from the same
weights. Dropout is off in every config (a random mask cannot be compared). Tasks, with the loss always computed in
``training_step`` from the model's output (the per-token form every strategy supports):

- ``causal``: next-token prediction; the dataset already shifts the labels (``labels[i]`` is token ``i + 1``), so the
  loss is a per-position cross entropy of the logits, never a shift inside ``training_step``.
- ``masked``: BERT's masked-LM head; 15% of the inputs are replaced by the mask token and every position is labelled
  with its original token (one label per position, so every shard and rank counts the same number).
- ``seq2seq``: T5 with explicit ``decoder_input_ids`` (the target shifted right by the dataset) and per-position labels.
- ``demo``: Lightning's demo ``Transformer`` as its own demo trains it: ``nll_loss(model(inputs, target), target)``.
- ``image``: ViT image classification, one label per image (a pooled output).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SEED = 1234
VOCAB = 64  # divisible by tensor_parallel_size=2
SEQ_LEN = 16  # divisible by 2·cp (cp=2) for the zigzag split
GLOBAL_BATCH = 8  # samples per optimizer step over all data-parallel ranks
STEPS = 3
SAMPLES = 64
IMAGE_SIZE, PATCH, CLASSES = 16, 4, 10
MASK_ID = 1
LAYERS = 4  # 4 pipeline stages for the interleaved and zero-bubble schedules (2 per rank)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
        )
    )  # fmt: skip


def _gpt2() -> torch.nn.Module:  # lm_head tied to wte: the default
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=SEQ_LEN, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
        )
    )  # fmt: skip


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attention_dropout=0.0,
        )
    )  # fmt: skip


def _qwen3() -> torch.nn.Module:  # per-head q_norm/k_norm over head_dim
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ_LEN, attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    )  # fmt: skip


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attention_dropout=0.0,
        )
    )  # fmt: skip


def _gemma() -> torch.nn.Module:  # tied head: the default
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(
        GemmaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ_LEN, attention_dropout=0.0,
        )
    )  # fmt: skip


def _gpt_neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            max_position_embeddings=SEQ_LEN, hidden_dropout=0.0, attention_dropout=0.0,
        )
    )  # fmt: skip


def _phi3() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(
        Phi3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, original_max_position_embeddings=SEQ_LEN,
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0,
        )
    )  # fmt: skip


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ_LEN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
    )  # fmt: skip


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=4,
            dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1,
        )
    )  # fmt: skip


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            image_size=IMAGE_SIZE, patch_size=PATCH, num_channels=3, hidden_size=32, num_hidden_layers=LAYERS,
            num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=CLASSES,
        )
    )  # fmt: skip


def _litgpt() -> torch.nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(
        Config(block_size=SEQ_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=4, n_embd=32)
    )


def _demo() -> torch.nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=LAYERS, dropout=0.0)


@dataclass(frozen=True)
class ModelSpec:
    """A matrix row: how to build the model and the task it is trained on.

    Every model trains in ``64-true``. ``why_fp32`` says why a model computes a part in float32 all the same (then
    its cells are held to the float32 tolerance).
    """

    label: str
    build: Callable[[], torch.nn.Module]
    task: str
    why_fp32: str = ""
    pretrained_from: str = ""  # a row started from ``initial_weights``: the seeded weights of that row's model


def pretrained_folder(workdir: Path, spec: ModelSpec) -> Path | None:
    """Where a row started from ``initial_weights`` reads its weights: the folder of its base row's seeded model as
    its library saves it (fp32, which the fp64 runs convert exactly): ``save_pretrained`` for transformers, a
    ``lit_model.pth`` for litgpt; ``None`` for other rows."""
    return workdir / "pretrained" / spec.pretrained_from if spec.pretrained_from else None


def save_pretrained_folder(workdir: Path, spec: ModelSpec) -> None:
    """Write the folder :func:`pretrained_folder` names, once."""
    folder = pretrained_folder(workdir, spec)
    if folder is None or folder.exists():
        return
    model = CompatModule(spec.pretrained_from).model
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder)
    else:  # litgpt
        folder.mkdir(parents=True)
        torch.save(model.state_dict(), folder / "lit_model.pth")


MODELS: dict[str, ModelSpec] = {
    spec.label: spec
    for spec in (
        ModelSpec("llama", _llama, "causal"),
        ModelSpec("gpt2", _gpt2, "causal"),
        ModelSpec("qwen2", _qwen2, "causal"),
        ModelSpec("qwen3", _qwen3, "causal"),
        ModelSpec("mistral", _mistral, "causal"),
        ModelSpec(
            "gemma",
            _gemma,
            "causal",
            why_fp32="`GemmaRMSNorm` computes in float32, its weight included, so the norm weights' gradients are"
            " float32 sums whose order depends on how the batch is split",
        ),
        ModelSpec("gpt_neox", _gpt_neox, "causal"),
        ModelSpec("phi3", _phi3, "causal"),
        ModelSpec("bert", _bert, "masked"),
        ModelSpec("t5", _t5, "seq2seq"),
        ModelSpec("vit", _vit, "image"),
        ModelSpec("litgpt", _litgpt, "causal"),
        ModelSpec("lightning_demo", _demo, "demo"),
        ModelSpec("llama_initial_weights", _llama, "causal", pretrained_from="llama"),
        ModelSpec("gpt2_initial_weights", _gpt2, "causal", pretrained_from="gpt2"),
        ModelSpec("litgpt_initial_weights", _litgpt, "causal", pretrained_from="litgpt"),
    )
}

TITLES = {  # the table's column titles in docs/compatibility.md
    "llama": "Llama", "gpt2": "GPT-2", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gemma": "Gemma",
    "gpt_neox": "GPT-NeoX", "phi3": "Phi-3", "bert": "BERT", "t5": "T5", "vit": "ViT", "litgpt": "litgpt",
    "lightning_demo": "Lightning demo", "llama_initial_weights": "Llama from initial_weights",
    "gpt2_initial_weights": "GPT-2 from initial_weights", "litgpt_initial_weights": "litgpt from initial_weights",
}  # fmt: skip
DESCRIPTIONS = {  # what docs/compatibility.md says of each model
    "llama": "transformers `LlamaForCausalLM` (GQA 4/2, untied head)",
    "gpt2": "transformers `GPT2LMHeadModel` (tied head, learned positions)",
    "qwen2": "transformers `Qwen2ForCausalLM` (GQA 4/2, q/k/v bias)",
    "qwen3": "transformers `Qwen3ForCausalLM` (GQA 4/2, per-head q/k RMSNorm)",
    "mistral": "transformers `MistralForCausalLM` (GQA 4/2)",
    "gemma": "transformers `GemmaForCausalLM` (tied head, GQA 4/2)",
    "gpt_neox": "transformers `GPTNeoXForCausalLM` (fused qkv, parallel residual)",
    "phi3": "transformers `Phi3ForCausalLM` (fused qkv and gate/up)",
    "bert": "transformers `BertForMaskedLM` (bidirectional, tied decoder)",
    "t5": "transformers `T5ForConditionalGeneration` (encoder-decoder, relative bias)",
    "vit": "transformers `ViTForImageClassification` (pooled output)",
    "litgpt": "litgpt `GPT`",
    "lightning_demo": "`lightning.pytorch.demos.Transformer` (`nn.Transformer`)",
    "llama_initial_weights": "the Llama row's weights saved with `save_pretrained`, loaded by the strategy's"
    " `initial_weights` into the model built under `trainer.init_module(empty_init=True)`",
    "gpt2_initial_weights": "the GPT-2 row's weights (`save_pretrained`: the tied head written once) from"
    " `initial_weights`, the model built on the meta device",
    "litgpt_initial_weights": "the litgpt row's weights as a `lit_model.pth` from `initial_weights`, the model built"
    " on the meta device",
}


class _Samples(Dataset):
    """``SAMPLES`` deterministic samples of ``task`` (sample ``i`` from a generator seeded with ``i``)."""

    def __init__(self, task: str) -> None:
        self.task = task

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        if self.task == "image":
            return {
                "pixel_values": torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=g),
                "labels": torch.randint(0, CLASSES, (), generator=g),
            }
        tokens = torch.randint(2, VOCAB, (SEQ_LEN + 1,), generator=g)
        if self.task in ("causal", "demo"):
            return {"input_ids": tokens[:-1], "labels": tokens[1:]}
        if self.task == "masked":
            masked = torch.rand(SEQ_LEN, generator=g) < 0.15
            return {"input_ids": tokens[:-1].masked_fill(masked, MASK_ID), "labels": tokens[:-1]}
        target = tokens[:-1].flip(0)  # seq2seq: the reversed source
        return {
            "input_ids": tokens[:-1],
            "decoder_input_ids": torch.cat([torch.zeros(1, dtype=torch.long), target[:-1]]),
            "labels": target,
        }


def dataloader(task: str, batch_replicas: int, one_process: bool) -> DataLoader:
    """The training data: ``GLOBAL_BATCH // batch_replicas`` samples per rank.

    In a multi-process run Lightning replaces the sampler with ``DistributedSampler(shuffle=True, seed)``; the
    one-process reference reads the same global batches through a single-replica sampler with the same seed (the
    union of the N ranks' k-th batches is the single replica's k-th batch of N times the size).
    """
    dataset = _Samples(task)
    if not one_process:
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // batch_replicas, drop_last=True)
    seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)


class CompatModule(L.LightningModule):
    """One matrix row's model, unchanged, in a plain LightningModule; the loss is computed here from its output."""

    def __init__(self, name: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.spec = MODELS[name]
        L.seed_everything(SEED, verbose=False)
        self.model = self.spec.build()
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        task, labels = self.spec.task, batch["labels"]
        if task == "image":
            logits = self.model(pixel_values=batch["pixel_values"]).logits
            return F.cross_entropy(logits, labels)
        if task == "demo":
            return F.nll_loss(self.model(batch["input_ids"], labels), labels.reshape(-1))
        if task == "seq2seq":
            out = self.model(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"])
        elif self.spec.build is _litgpt:  # takes the token ids only and returns the logits
            out = self.model(batch["input_ids"])
        else:
            out = self.model(input_ids=batch["input_ids"])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
