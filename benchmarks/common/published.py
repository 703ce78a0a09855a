"""A folder laid out as a published Hugging Face model is: safetensors shards in bf16 with their index, the config,
the generation config and a tokenizer with a chat template (a word-level one over the model's vocabulary: no
download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens (``<s>`` 0, ``</s>`` 1, ``<pad>`` 2, ``<unk>`` 3, the letters,
    then numbers) with a chat template, saved as transformers saves one (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<pad>", "<unk>", *[chr(ord("a") + i) for i in range(26)]]
    words += [str(i) for i in range(vocab_size - len(words))]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    fast.save_pretrained(folder)


def save_published_folder(model: Any, folder: Path, max_shard_size: str = "5GB") -> None:
    """``model`` (a transformers causal LM) saved in bf16 in shards, with a tokenizer over its vocabulary."""
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=max_shard_size)
    save_word_tokenizer(folder, model.config.vocab_size)
