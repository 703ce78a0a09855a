"""The models the scenario scripts share: single-device Lightning code, no parallelism in them.

- :class:`LlamaLike` (and :class:`EncoderLM`): a small decoder with Hugging Face Llama naming, written out here.
  ``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj`` with grouped-query attention (fewer key/value
  heads, counts kept as ``num_heads``/``num_key_value_heads`` attributes and used in reshapes, as older transformers
  releases do), ``mlp.{gate,up,down}_proj`` (SwiGLU), RMSNorm, rotary embeddings, and ``lm_head``. The attention is
  called with keyword arguments, as in transformers.
- Tiny models of libraries whose fused projections tensor parallel shards: litgpt's ``GPT`` (fused ``attn.qkv``
  with grouped-query attention, ``LLaMAMLP`` with ``fc_1``/``fc_2``/``proj``), Hugging Face's ``Phi3ForCausalLM``
  (fused ``qkv_proj`` and ``gate_up_proj``) and Falcon, GPT-2 and GPT-NeoX (:func:`hf_model`); :class:`LitGPTLM`
  wraps litgpt's in LlamaLike's training and validation steps.
- :class:`HFCausalLM`: stock Hugging Face causal LMs and litgpt's ``GPT`` (tiny configs) in a plain
  LightningModule: no ``configure_model``, the model in ``self.model``, and a ``training_step`` that passes
  ``labels=`` and returns the model's own loss. transformers' ``ForCausalLMLoss`` shifts the labels and casts the
  logits to float32 before the cross entropy, so ``out.loss`` is a float32 value even in a ``64-true`` run. The step
  also logs ``loss64``, the same loss computed from the float64 logits, so a test can compare the forward at float64
  precision.
- :func:`tiny_hf_causal_lm`: stock Llama, GPT-2, Qwen3 or Mixtral causal LMs with their default config
  (``use_cache=True``), as users build them.
- :class:`LoraCausalLM`: a stock Llama or Qwen3 wrapped by PEFT's LoRA (``get_peft_model``) as users write it.
- :class:`HFLlama`: a stock ``LlamaForCausalLM`` whose loss is computed inside the model (context parallelism's
  label shift), or from its logits.
- :class:`QKNormAttention`: Qwen3-style attention normalizing queries and keys over head_dim (``q_norm``,
  ``k_norm``): under tensor parallelism each rank sees its heads only, and the norms' gradients are summed over tp.
- :class:`UserMoE`: a mixture-of-experts model as a user writes it, with names no library uses: each layer's
  experts in a ``ModuleList`` called ``expert_list``, routed by ``scorer`` in the same ``forward`` as the loop.

Only torch, Lightning, torchmetrics and (imported where used) transformers, peft and litgpt: the module imports nothing
from the scenario scripts, so both the scripts (``from models import ...``) and the tests
(``from tests.scenarios.models import ...``) can use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

VOCAB = 64
SEQ_LEN = 32  # the scenarios' sequence length (common.SEQ_LEN)


# ------------------------------------------------------------------------------------------------------------ LlamaLike


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, head_dim, 2).double() / head_dim), False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_key_value_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_groups = num_heads // num_key_value_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden_size, num_heads, num_kv_heads)
        self.mlp = LlamaMLP(hidden_size, intermediate_size)
        self.input_layernorm = LlamaRMSNorm(hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        residual = hidden_states
        hidden_states = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), position_embeddings=position_embeddings
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, layers: int, heads: int, kv_heads: int, inter: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden_size, heads, kv_heads, inter) for _ in range(layers))
        self.norm = LlamaRMSNorm(hidden_size)
        self.rotary_emb = RotaryEmbedding(hidden_size // heads)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings)
        return self.norm(hidden_states)


class LlamaLike(L.LightningModule):
    """``LlamaForCausalLM``-shaped: ``model`` + ``lm_head``, next-token cross-entropy, validation accuracy and a
    token count (a sum state: it shows double counting of tensor-parallel peers)."""

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_heads: int = 8,
        num_key_value_heads: int = 4,
        intermediate_size: int = 64,
        lr: float = 1e-2,
        tie_word_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = LlamaModel(vocab_size, hidden_size, num_layers, num_heads, num_key_value_heads, intermediate_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.val_tokens = torchmetrics.SumMetric()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.val_accuracy(logits.argmax(-1).flatten(), batch["labels"].flatten())
        self.val_tokens(float(batch["labels"].numel()))
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_accuracy)
        self.log("val_tokens", self.val_tokens)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class EncoderLM(LlamaLike):
    """A causal LM built from ``nn.TransformerEncoderLayer`` s: its attention is an ``nn.MultiheadAttention`` (4 heads,
    sharded by heads under tensor parallel) and its MLP ``linear1``/``linear2``."""

    def __init__(self, vocab_size: int = 64, d_model: int = 32, layers: int = 2) -> None:
        super().__init__(vocab_size=vocab_size)
        del self.model, self.lm_head
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], dtype=self.lm_head.weight.dtype)
        return self.lm_head(self.encoder(self.embed_tokens(input_ids), mask=mask, is_causal=True))


# ------------------------------------------------------------------------------------------------------ QKNormAttention


class QKNormAttention(nn.Module):
    """Causal self-attention with Qwen3-style RMSNorms over head_dim on the queries and keys (see the module
    docstring); a drop-in for the example GPT's ``CausalSelfAttention``."""

    def __init__(self, d_model: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d_model // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


# ------------------------------------------------------------------------------------------------------- library models


def litgpt_model(seq_len: int) -> torch.nn.Module:
    """litgpt ``GPT``: 2 layers, 4 query heads in 2 query groups of width 8, LLaMAMLP, rotary.

    LayerNorm, not litgpt's RMSNorm: that one computes in fp32 even for fp64 inputs (its weight's gradient is an fp32
    sum over the batch), so splitting the batch over data-parallel ranks moves it by ~1e-7 relative (observed 3e-9
    at dp2 × tp2), which fp64 parity at 1e-10 cannot tell from a bug."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=seq_len, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_query_groups=2,
        n_embd=32, bias=False, norm_class_name="LayerNorm", mlp_class_name="LLaMAMLP", intermediate_size=64,
        rotary_percentage=1.0, parallel_residual=False,
    )  # fmt: skip
    return GPT(config)


def phi3_model(seq_len: int) -> torch.nn.Module:
    """``Phi3ForCausalLM``: 2 layers, 4 query heads, 2 key/value heads, fused qkv_proj and gate_up_proj."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq_len, original_max_position_embeddings=seq_len,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    return Phi3ForCausalLM(config)


def falcon_model(seq_len: int, new_decoder_architecture: bool) -> torch.nn.Module:
    """``FalconForCausalLM``, 4 heads: ``new_decoder_architecture`` (2 key/value heads, query_key_value per group) or
    multi-query (one key/value head, ``[Q | k | v]``)."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=new_decoder_architecture, multi_query=not new_decoder_architecture,
        max_position_embeddings=seq_len, hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=64, bias=False,
        parallel_attn=True, alibi=False, attn_implementation="eager",
    )  # fmt: skip
    return FalconForCausalLM(config)


class LitGPTLM(LlamaLike):
    """litgpt's ``GPT`` (``gpt``) with LlamaLike's training and validation steps."""

    def __init__(self, seq_len: int) -> None:
        super().__init__(vocab_size=VOCAB)
        del self.model, self.lm_head
        self.gpt = litgpt_model(seq_len)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids)


def hf_model(kind: str) -> torch.nn.Module:
    """A tiny library model by name, without dropout: ``GPT2LMHeadModel`` (tied embeddings), ``GPTNeoXForCausalLM``
    (``neox``), ``LlamaForCausalLM`` (``hf_llama``), Phi-3 or Falcon."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    if kind == "phi3":
        return phi3_model(SEQ_LEN)
    if kind.startswith("falcon"):
        return falcon_model(SEQ_LEN, new_decoder_architecture=kind == "falcon_gqa")
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True, attn_implementation="eager",
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if kind == "hf_llama":  # grouped-query attention: 8 query heads, 2 key/value heads
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attn_implementation="eager",
        )  # fmt: skip
        return LlamaForCausalLM(config)
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=SEQ_LEN, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    return GPTNeoXForCausalLM(config)


def tiny_hf_causal_lm(kind: str, **overrides: Any) -> nn.Module:
    """A stock transformers causal LM (``llama``, ``gpt2``, ``qwen3``, ``mixtral``) with a tiny config, as a user writes
    it (``use_cache`` left at its default), without dropout; Qwen3 and Mixtral with a padding token (an embedding
    row the constructor zeroes)."""
    import transformers as tf

    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ_LEN,
              "attn_implementation": "eager", "bos_token_id": 0, "eos_token_id": 1}  # fmt: skip
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=64, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0,
                               eos_token_id=1, **overrides)  # fmt: skip
        return tf.GPT2LMHeadModel(config)
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8, pad_token_id=2, **overrides))
    if kind == "mixtral":
        config = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, pad_token_id=2,
                                  experts_implementation="eager", **overrides)  # fmt: skip
        return tf.MixtralForCausalLM(config)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common, **overrides))


# ---------------------------------------------------------------------------------- causal LMs computing their own loss


def _causal_llama() -> torch.nn.Module:
    """``LlamaForCausalLM``: 4 layers, 4 query heads, 2 key/value heads, untied ``lm_head``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="eager", bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _causal_gpt2() -> torch.nn.Module:
    """``GPT2LMHeadModel``: 4 layers, ``lm_head.weight`` tied to ``transformer.wte.weight`` (the default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=SEQ_LEN, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _causal_litgpt() -> torch.nn.Module:
    """litgpt's ``GPT``: 4 layers, 4 heads, rotary, LayerNorm (litgpt's RMSNorm computes in fp32 even for fp64
    inputs). It registers ``lm_head`` before ``transformer``: registration order is not the forward's order."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=SEQ_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=32,
        norm_class_name="LayerNorm",
    )  # fmt: skip
    return GPT(config)


CAUSAL_LMS = {"llama": _causal_llama, "gpt2": _causal_gpt2, "litgpt": _causal_litgpt}


class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM trained on ``input_ids`` with ``labels=input_ids`` (the model shifts them)."""

    def __init__(self, kind: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = CAUSAL_LMS[kind]()
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


def lora_base_model(kind: str) -> torch.nn.Module:
    """A stock ``LlamaForCausalLM`` (4 query heads, 2 key/value heads), ``Qwen3ForCausalLM`` (the same, with
    per-head ``q_norm``/``k_norm``) or ``Phi3ForCausalLM`` (fused ``qkv_proj``, ``gate_up_proj``), 2 layers, for
    :class:`LoraCausalLM`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "phi3":
        return phi3_model(SEQ_LEN)

    sizes = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ_LEN,
        "attn_implementation": "eager", "use_cache": False,
    }  # fmt: skip
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **sizes))
    return LlamaForCausalLM(LlamaConfig(**sizes))


class LoraCausalLM(L.LightningModule):
    """LoRA fine-tuning as users write it: a stock transformers causal LM wrapped by PEFT's
    ``get_peft_model(model, LoraConfig(r=8, target_modules=...))`` in ``__init__``, AdamW over the trainable
    parameters. The loss is computed from the logits (transformers' own loss casts them to float32, which would
    limit a float64 comparison)."""

    def __init__(
        self, kind: str = "llama", targets: tuple[str, ...] = ("q_proj", "v_proj"), lora_dropout: float = 0.0
    ) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=8, target_modules=list(targets), lora_dropout=lora_dropout)
        self.model = get_peft_model(lora_base_model(kind), config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch["input_ids"]
        logits = self.model(input_ids=x).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class HFLlama(L.LightningModule):
    """A stock ``transformers`` ``LlamaForCausalLM`` (4 heads, 2 KV heads) in a plain LightningModule: the labels
    are the inputs, shifted inside the model. ``ignore_below`` > 0 sets the labels of tokens below it to -100
    (an uneven number of ignored labels on each sequence shard)."""

    def __init__(self, vocab_size: int, ignore_below: int = 0, logits_loss: bool = False) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)
        self.ignore_below = ignore_below
        self.logits_loss = logits_loss

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["input_ids"]
        if self.logits_loss:  # the model gets no labels: the loss from its logits, labels shifted by the dataset
            logits = self.model(x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        labels = x.masked_fill(x < self.ignore_below, -100) if self.ignore_below else x
        return self.model(input_ids=x, labels=labels).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class UserMoELayer(nn.Module):
    """Top-2 routing by ``scorer`` over ``expert_list`` (GELU MLPs), weights softmaxed over the chosen two."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.scorer = nn.Linear(hidden, experts, bias=False)
        self.expert_list = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.scorer(flat).topk(2, dim=-1)
        weights = weights.softmax(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.expert_list):
            tokens, slot = torch.where(chosen == e)
            out[tokens] += weights[tokens, slot, None] * expert(flat[tokens])
        return out.view_as(x)


class UserMoE(nn.Module):
    """An embedding, 2 residual MoE layers (:class:`UserMoELayer`, 4 experts) and a head."""

    def __init__(self, vocab: int = 64, hidden: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(UserMoELayer(hidden, experts) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return self.head(x)


# ---------------------------------------------------------------------------------- pretrained weights (issue 42)
class PretrainedCausalLM(L.LightningModule):
    """A causal LM of a Hugging Face folder: built from its ``config.json`` (the strategy's ``initial_weights`` then
    loads the weights), or with ``from_pretrained`` in fp64 (the one-process reference)."""

    def __init__(self, folder: str, from_pretrained: bool = False, lr: float = 1e-3) -> None:
        super().__init__()
        import transformers as tf

        if from_pretrained:  # the experts as a loop: grouped_mm, transformers' CPU default, takes no fp64
            moe = {"experts_implementation": "eager"} if "mixtral" in Path(folder).name else {}
            self.model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **moe)
        else:
            self.model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(folder))
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # the loss in the model's dtype (transformers' own casts the logits to fp32), on the data's shifted labels
        logits = self.model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class PretrainedLitGPT(PretrainedCausalLM):
    """A litgpt ``GPT`` of a litgpt folder (``model_config.yaml``, ``lit_model.pth``): built from the config, or with
    the weights loaded in fp64 (the one-process reference)."""

    def __init__(self, folder: str, from_pretrained: bool = False, lr: float = 1e-3) -> None:
        L.LightningModule.__init__(self)
        from litgpt.config import Config
        from litgpt.model import GPT

        self.model = GPT(Config.from_file(Path(folder) / "model_config.yaml"))
        if from_pretrained:
            self.model.to(torch.float64).load_state_dict(torch.load(Path(folder) / "lit_model.pth", weights_only=True))
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def save_litgpt_folder(folder: Path) -> None:
    """A tiny litgpt ``GPT`` in bf16 as litgpt stores one: ``lit_model.pth`` and ``model_config.yaml``."""
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import save_config

    config = Config(block_size=SEQ_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32,
                    n_query_groups=2, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64,
                    bias=False)  # fmt: skip
    folder.mkdir(parents=True)
    torch.save(GPT(config).to(torch.bfloat16).state_dict(), folder / "lit_model.pth")
    save_config(config, folder)


class PretrainedLoraLM(PretrainedCausalLM):
    """LoRA fine-tuning of a Hugging Face folder as users write it: PEFT's ``get_peft_model(model, LoraConfig(r=4,
    target_modules=["q_proj", "v_proj"]))`` over the model built in ``dtype`` from the folder's config (the strategy's
    ``initial_weights`` then reads the base weights), or over ``from_pretrained`` (the one-process reference); AdamW
    over the adapters."""

    def __init__(self, folder: str, from_pretrained: bool = False, lr: float = 1e-2, dtype: str = "float64") -> None:
        L.LightningModule.__init__(self)
        import transformers as tf
        from peft import LoraConfig, get_peft_model

        if from_pretrained:
            base = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        else:  # from_config builds in the config's dtype (the folder's bf16) unless told
            base = tf.AutoModelForCausalLM.from_config(
                tf.AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype)
            )
        self.model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        self.lr = lr

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def save_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of :data:`VOCAB` tokens with a chat template, as a published folder holds one."""
    from benchmarks.common import save_word_tokenizer

    save_word_tokenizer(folder, VOCAB)


class PretrainedLitLoRA(PretrainedLitGPT):
    """litgpt's LoRA ``GPT`` (``litgpt.lora``: r=4 on the query and value rows of the fused ``qkv``) over a litgpt
    folder's config, only the adapters trainable, as litgpt's ``finetune lora`` builds it; ``from_pretrained``: the
    base weights loaded in fp64 as that script loads them (``load_state_dict(strict=False)``)."""

    def __init__(self, folder: str, from_pretrained: bool = False, lr: float = 1e-2) -> None:
        L.LightningModule.__init__(self)
        from dataclasses import asdict

        from litgpt import lora
        from litgpt.config import Config

        base = asdict(Config.from_file(Path(folder) / "model_config.yaml"))
        config = lora.Config(**base, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True)
        self.model = lora.GPT(config)
        if from_pretrained:
            state = torch.load(Path(folder) / "lit_model.pth", weights_only=True)
            self.model.to(torch.float64).load_state_dict(state, strict=False)
        lora.mark_only_lora_as_trainable(self.model)
        self.lr = lr

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
