"""Mixture-of-experts language models as plain single-device Lightning code: a stock Hugging Face MoE causal LM
(Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert) or litgpt's ``GPT`` with ``LLaMAMoE`` layers, built from a
tiny config. Nothing in them knows about parallelism: ``Trainer(strategy="expert_parallel")`` splits their experts.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F

MoEKind = Literal["mixtral", "qwen3_moe", "qwen2_moe"]

_SPARSE = {"moe_intermediate_size": 24, "intermediate_size": 48, "mlp_only_layers": []}
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {  # transformers class prefix, the MoE part of the config
    "mixtral": ("Mixtral", {"intermediate_size": 48, "router_jitter_noise": 0.0}),
    "qwen3_moe": ("Qwen3Moe", _SPARSE),
    "qwen2_moe": ("Qwen2Moe", {**_SPARSE, "shared_expert_intermediate_size": 40}),
}
_EXPERTS_KEY = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "qwen2_moe": "num_experts"}


class MoECausalLM(L.LightningModule):
    """A stock transformers MoE causal LM (2 layers, ``experts`` experts, top-2), next-token loss on its logits.

    Args:
        vocab_size: Tokens of the vocabulary.
        kind: ``mixtral``, ``qwen3_moe`` or ``qwen2_moe`` (with its shared expert).
        aux: Add the router's load-balancing loss (``output_router_logits=True``), weighted ``router_aux_loss_coef``.
        hidden_size: The model's width.
        experts: Experts per MoE layer.
        seq_len: The longest sequence (``max_position_embeddings``).
        experts_implementation: transformers' experts kernel (``eager``: a loop; ``grouped_mm``: its default).
        aux_weight: ``router_aux_loss_coef``.
        lr: AdamW's learning rate.
        attn_implementation: transformers' attention (``sdpa`` for context parallelism).
    """

    def __init__(
        self,
        vocab_size: int = 64,
        kind: MoEKind = "mixtral",
        aux: bool = False,
        hidden_size: int = 32,
        experts: int = 4,
        seq_len: int = 64,
        experts_implementation: str = "eager",
        aux_weight: float = 0.5,
        lr: float = 1e-2,
        attn_implementation: str = "eager",
    ) -> None:
        super().__init__()
        import transformers

        prefix, extra = _CONFIGS[kind]
        extra = {**extra, _EXPERTS_KEY[kind]: experts}
        if aux:
            extra = {**extra, "output_router_logits": True, "router_aux_loss_coef": aux_weight}
        config = getattr(transformers, f"{prefix}Config")(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=seq_len,
            attn_implementation=attn_implementation, experts_implementation=experts_implementation, **extra,
        )  # fmt: skip
        self.model = getattr(transformers, f"{prefix}ForCausalLM")(config)
        self.lr = lr
        self.aux_losses: list[float] = []  # transformers computes it in fp32: tests compare it apart

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # The loss from the logits in their own dtype (transformers' own loss casts them to fp32).
        out = self.model(input_ids=batch["input_ids"])
        loss = _next_token_loss(out.logits, batch["labels"])
        if out.aux_loss is not None:
            self.aux_losses.append(float(out.aux_loss))
            loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss.to(loss.dtype)
        self.log("train_loss", loss, sync_dist=True)  # the mean over data-parallel ranks: the whole batch's
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LitGPTMoE(L.LightningModule):
    """litgpt's ``GPT`` with ``LLaMAMoE`` layers: a ``ModuleList`` of ``experts`` experts (top-2) routed in the same
    ``forward`` as the loop over them; 2 layers, next-token loss on its logits.

    Args:
        vocab_size: Tokens of the vocabulary.
        hidden_size: The model's width (``n_embd``).
        experts: Experts per MoE layer.
        seq_len: The longest sequence (``block_size``).
        lr: AdamW's learning rate.
    """

    def __init__(
        self, vocab_size: int = 64, hidden_size: int = 32, experts: int = 4, seq_len: int = 64, lr: float = 1e-2
    ) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        config = Config(
            block_size=seq_len, vocab_size=vocab_size, padded_vocab_size=vocab_size, n_layer=2, n_head=4,
            n_embd=hidden_size, n_query_groups=2, mlp_class_name="LLaMAMoE", moe_intermediate_size=24,
            n_expert=experts, n_expert_per_token=2,
        )  # fmt: skip
        self.model = GPT(config)
        self.lr = lr
        self.aux_losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = _next_token_loss(self.model(batch["input_ids"]), batch["labels"])
        self.log("train_loss", loss, sync_dist=True)  # the mean over data-parallel ranks: the whole batch's
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy against the data's labels, the next tokens already aligned per position: nothing is shifted
    here, so a strategy that splits the sequence (context parallelism) splits the labels with it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
