"""Stock Hugging Face causal LMs and litgpt's ``GPT`` (tiny configs) in a plain LightningModule: no ``configure_model``, the model in
``self.model``, and a ``training_step`` that passes ``labels=`` and returns the model's own loss.

transformers' ``ForCausalLMLoss`` shifts the labels and casts the logits to float32 before the cross entropy, so
``out.loss`` is a float32 value even in a ``64-true`` run. The step also logs ``loss64``, the same loss computed
from the float64 logits, so a test can compare the forward at float64 precision.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

VOCAB = 64
SEQ_LEN = 32


def llama() -> torch.nn.Module:
    """``LlamaForCausalLM``: 4 layers, 4 query heads, 2 key/value heads, untied ``lm_head``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="eager", bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def gpt2() -> torch.nn.Module:
    """``GPT2LMHeadModel``: 4 layers, ``lm_head.weight`` tied to ``transformer.wte.weight`` (the default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=SEQ_LEN, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def litgpt() -> torch.nn.Module:
    """litgpt's ``GPT``: 4 layers, 4 heads, rotary, LayerNorm (litgpt's RMSNorm computes in fp32 even for fp64
    inputs). It registers ``lm_head`` before ``transformer``: registration order is not the forward's order."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=SEQ_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=32,
        norm_class_name="LayerNorm",
    )  # fmt: skip
    return GPT(config)


MODELS = {"llama": llama, "gpt2": gpt2, "litgpt": litgpt}


class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM trained on ``input_ids`` with ``labels=input_ids`` (the model shifts them)."""

    def __init__(self, kind: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = MODELS[kind]()
        self.kind = kind
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch["input_ids"]
        if self.kind == "litgpt":  # takes no labels and returns the logits
            logits = self.model(x)[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            self.log("loss64", loss)
            self.log("train_loss", loss)
            return loss
        out = self.model(input_ids=x, labels=x)
        logits = out.logits[:, :-1]
        self.log("loss64", F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
