"""LoRA fine-tuning of a published causal LM, written for one device: PEFT's ``get_peft_model`` over the model built
from the folder's config. The weights are not read here: the strategy's ``initial_weights`` reads them after the
model was sharded (``configs/finetune_lora.yaml``, docs/finetune.md). Run alone (no ``initial_weights``), pass
``from_pretrained=True``."""

from __future__ import annotations

import lightning as L
import torch

from examples.causal_lm import CausalLM


class LoraFineTune(CausalLM):
    """PEFT LoRA (``r``, ``lora_alpha`` on ``target_modules``) over ``AutoModelForCausalLM`` of ``folder``.

    Args:
        folder: The published model's folder (``config.json``, ``*.safetensors``, tokenizer files).
        target_modules: The projections LoRA wraps.
        r: The adapters' rank.
        lora_alpha: Their scale (``lora_alpha / r`` multiplies ``B @ A``).
        lr: AdamW's learning rate over the adapters.
        dtype: The dtype the model is built in (``from_config`` builds the config's, bf16 for most published
            folders, unless told): ``float32`` weights under ``precision: bf16-mixed`` is the usual choice.
        from_pretrained: Read the weights here with ``from_pretrained`` (one device, no ``initial_weights``).
    """

    def __init__(
        self,
        folder: str,
        target_modules: list[str] | None = None,
        r: int = 8,
        lora_alpha: int = 16,
        lr: float = 2e-4,
        dtype: str = "float32",
        from_pretrained: bool = False,
    ) -> None:
        L.LightningModule.__init__(self)  # the model is not CausalLM's: only its training step is shared
        import transformers
        from peft import LoraConfig, get_peft_model

        self.save_hyperparameters()
        kind = getattr(torch, dtype)
        if from_pretrained:
            base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=kind)
        else:
            base = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(folder), dtype=kind
            )
        config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules or ["q_proj", "v_proj"])
        self.model = get_peft_model(base, config)
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
