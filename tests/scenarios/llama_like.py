"""A small decoder with Hugging Face Llama naming, written as plain single-device Lightning code.

``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj`` with grouped-query attention (fewer key/value
heads, counts kept as ``num_heads``/``num_key_value_heads`` attributes and used in reshapes, as older transformers
releases do), ``mlp.{gate,up,down}_proj`` (SwiGLU), RMSNorm, rotary embeddings, and ``lm_head``. The attention is
called with keyword arguments, as in transformers.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


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
