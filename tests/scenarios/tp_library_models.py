"""Tiny models of libraries whose fused projections tensor parallel shards: litgpt's ``GPT`` (fused ``attn.qkv``
with grouped-query attention, ``LLaMAMLP`` with ``fc_1``/``fc_2``/``proj``) and Hugging Face's ``Phi3ForCausalLM``
(fused ``qkv_proj`` and ``gate_up_proj``), each wrapped in LlamaLike's training and validation steps."""

from __future__ import annotations

import torch
from llama_like import LlamaLike  # type: ignore[import-not-found]

VOCAB = 64


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
