"""Fabric scenarios: a training loop written as litgpt's scripts write theirs (``fabric.setup``, ``setup_dataloaders``,
the labels shifted in the loop, ``fabric.backward``, ``clip_gradients``, ``fabric.all_reduce`` of the loss), under the
lightning_dist Fabric strategies selected by name or by class, against the same loop in one process; ``fabric.save``
and ``fabric.load`` into a new run on the same and on another mesh; a Fabric checkpoint loaded by a Trainer's model.

python tests/scenarios/fabric_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2_litgpt,tp_litgpt
python tests/scenarios/fabric_runs.py --devices 1 --out ref.json --workdir DIR --scenarios reference_litgpt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import SEQ_LEN, in_checkpoint_order, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from models import VOCAB, LitGPTLM, litgpt_model  # type: ignore[import-not-found]
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from examples.data import TextDataModule
from lightning_dist import fabric as ld_fabric

GLOBAL_BATCH = 8
STEPS = 6
LR = 1e-2


def _llama() -> torch.nn.Module:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config)


def _litgpt_moe() -> torch.nn.Module:
    """litgpt's ``GPT`` with ``LLaMAMoE`` blocks: 4 experts, 2 per token."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=SEQ_LEN, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_query_groups=2,
        n_embd=32, bias=False, norm_class_name="LayerNorm", mlp_class_name="LLaMAMoE", intermediate_size=64,
        n_expert=4, n_expert_per_token=2, rotary_percentage=1.0, parallel_residual=False,
    )  # fmt: skip
    return GPT(config)


MODELS = {"litgpt": lambda: litgpt_model(SEQ_LEN), "llama": _llama, "litgpt_moe": _litgpt_moe}


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ_LEN + 1), generator=generator)


def train(
    strategy: Any,
    devices: int,
    model_kind: str = "litgpt",
    dtype: torch.dtype = torch.float64,
    steps: int = STEPS,
    save_at: str | None = None,
    load_from: str | None = None,
    precision: str = "32-true",
) -> dict[str, Any]:
    """litgpt's loop (pretrain.py's fit): returns the losses averaged over the data-parallel ranks, one per step."""
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
    fabric.launch()
    torch.set_default_dtype(dtype)
    try:
        fabric.seed_everything(1234)
        with fabric.init_module(empty_init=False):
            model = MODELS[model_kind]()
        model = fabric.setup(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        optimizer = fabric.setup_optimizers(optimizer)
        replicas = fabric.strategy.distributed_sampler_kwargs["num_replicas"] if devices > 1 else 1
        loader = DataLoader(TensorDataset(_tokens()), batch_size=GLOBAL_BATCH // replicas)
        loader = fabric.setup_dataloaders(loader)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iter_num": 0}
        if load_from is not None:
            fabric.load(load_from, state)
        losses = []
        for step, (batch,) in enumerate(loader):
            if step < state["iter_num"]:
                continue
            if step >= steps:
                break
            input_ids, targets = batch[:, :SEQ_LEN], batch[:, 1 : SEQ_LEN + 1]
            logits = _logits(model(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            state["iter_num"] = step + 1
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
            if save_at is not None and state["iter_num"] == 4:
                fabric.save(save_at, state)
        return {"losses": losses, "strategy": type(fabric.strategy).__name__}
    finally:
        torch.set_default_dtype(torch.float32)


def _weights(model: torch.nn.Module) -> dict[str, list]:
    """Every parameter whole, in checkpoint row order (collective)."""
    return {name: in_checkpoint_order(model, name, p).tolist() for name, p in model.named_parameters()}


def _gap(a: dict[str, list], b: dict[str, list]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


def trainer_and_fabric(devices: int, workdir: str | None) -> dict[str, float]:
    """A Trainer's checkpoint of a LightningModule holding litgpt's GPT as ``self.gpt`` loads into the GPT of a Fabric
    loop (tensor_parallel); the Fabric checkpoint of that GPT loads back into a Trainer's module (fsdp2,
    ``initial_weights``). The keys differ by the module's ``gpt.`` prefix."""
    folder = _workdir(workdir)
    L.seed_everything(1234, verbose=False)
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // devices, train_samples=64, val_samples=16)
    module = LitGPTLM(SEQ_LEN)
    trainer = L.Trainer(strategy=lightning_dist.FSDP2Strategy(), max_steps=2, **trainer_kwargs(devices))
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(folder / "trainer.ckpt")
    trained = _weights(module.gpt)

    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="tensor_parallel")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        gpt = litgpt_model(SEQ_LEN)
    gpt = fabric.setup(gpt)
    fabric.load(folder / "trainer.ckpt", {"model": gpt}, strict=False)  # the Trainer's loops are not asked for
    in_fabric = _weights(gpt.module)
    fabric.save(folder / "from_trainer.ckpt", {"model": gpt})

    again = LitGPTLM(SEQ_LEN)
    strategy = lightning_dist.FSDP2Strategy(initial_weights=str(folder / "from_trainer.ckpt"))
    L.Trainer(strategy=strategy, **trainer_kwargs(devices)).validate(again, datamodule=data, verbose=False)
    return {"trainer_to_fabric": _gap(trained, in_fabric), "fabric_to_trainer": _gap(trained, _weights(again.gpt))}


def one_file(devices: int, workdir: str | None) -> dict[str, Any]:
    """``fabric.save`` with FullStateCheckpointIO: one file that litgpt's tools read (``torch.load(...)["model"]``)
    and that ``fabric.load`` restores under another strategy."""
    folder = _workdir(workdir)
    trained = train(ld_fabric.FSDP2Strategy(checkpoint_io=lightning_dist.FullStateCheckpointIO()), devices, steps=4,
                    save_at=str(folder / "one_file.pth"))  # fmt: skip
    resumed = train("tensor_parallel", devices, load_from=str(folder / "one_file.pth"))
    saved = torch.load(folder / "one_file.pth", weights_only=True)
    same = all(torch.equal(saved["model"][k], saved["state_dict"][k]) for k in saved["state_dict"])
    return {"keys": sorted(saved["model"]) == sorted(saved["state_dict"]) and same, "trained": trained["losses"],
            "resumed": resumed["losses"]}  # fmt: skip


def initial_weights(devices: int, workdir: str | None) -> dict[str, float]:
    """A Llama built on the meta device from a published folder's config, its weights read by ``initial_weights``
    after sharding (each rank its slices), against ``from_pretrained``; under fsdp2 and tensor_parallel."""
    import transformers as tf

    folder = _workdir(workdir) / "llama_folder"  # written by the test before launch
    expected = tf.LlamaForCausalLM.from_pretrained(folder).state_dict()
    gaps = {}
    for name, strategy_class in (
        ("fsdp2", ld_fabric.FSDP2Strategy),
        ("tensor_parallel", ld_fabric.TensorParallelStrategy),
    ):
        fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy_class(initial_weights=str(folder)))
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(folder))
        model = fabric.setup(model)
        loaded = _weights(model.module)
        gaps[name] = max(float((torch.tensor(loaded[k]) - expected[k]).abs().max()) for k in loaded)
    return gaps


def _workdir(workdir: str | None) -> Path:
    assert workdir is not None
    return Path(workdir)


SCENARIOS = {
    "reference_litgpt": lambda devices, workdir: train("auto", 1),
    "reference_llama": lambda devices, workdir: train("auto", 1, model_kind="llama"),
    "reference_litgpt_fp32": lambda devices, workdir: train("auto", 1, dtype=torch.float32),
    "reference_litgpt_moe": lambda devices, workdir: train("auto", 1, model_kind="litgpt_moe"),
    # selected by name, as L.Fabric(strategy="...") after `import lightning_dist`
    "fsdp2_litgpt": lambda devices, workdir: train("fsdp2", devices),
    "zeropp_litgpt": lambda devices, workdir: train(
        ld_fabric.ZeroPPStrategy(quantized_weights=False, quantized_gradients=False, hpz_partition_size=None),
        devices,
    ),
    "tp_litgpt": lambda devices, workdir: train("tensor_parallel", devices),
    "tp2d_litgpt": lambda devices, workdir: train("tensor_parallel_2d", devices),
    "hsdp_litgpt": lambda devices, workdir: train(
        ld_fabric.FSDP2Strategy(sharding="hybrid", data_parallel_replicate_size=2), devices
    ),
    "ep_litgpt_moe": lambda devices, workdir: train("expert_parallel", devices, model_kind="litgpt_moe"),
    "cp_litgpt": lambda devices, workdir: train("context_parallel", devices),
    "cp_tp_litgpt": lambda devices, workdir: train(
        ld_fabric.Hybrid3DStrategy(context_parallel_size=2, tensor_parallel_size=2), devices
    ),
    "fsdp2_litgpt_fp32": lambda devices, workdir: train(ld_fabric.FSDP2Strategy(), devices, dtype=torch.float32),
    "tp_litgpt_fp32": lambda devices, workdir: train(
        ld_fabric.TensorParallelStrategy(tensor_parallel_size=devices), devices, dtype=torch.float32
    ),
    "fsdp2_litgpt_bf16_mixed": lambda devices, workdir: train(
        "fsdp2", devices, dtype=torch.float32, precision="bf16-mixed"
    ),
    "tp_litgpt_float8": lambda devices, workdir: train(
        ld_fabric.TensorParallelStrategy(float8="rowwise"), devices, dtype=torch.float32
    ),
    "fsdp2_llama": lambda devices, workdir: train("fsdp2", devices, model_kind="llama"),
    "tp_llama": lambda devices, workdir: train("tensor_parallel", devices, model_kind="llama"),
    "cp_llama": lambda devices, workdir: train("context_parallel", devices, model_kind="llama"),
    # fabric.save at step 4, then a new run loads it and trains on
    "save_fsdp2": lambda devices, workdir: train("fsdp2", devices, save_at=str(_workdir(workdir) / "fabric.ckpt")),
    "resume_fsdp2": lambda devices, workdir: train("fsdp2", devices, load_from=str(_workdir(workdir) / "fabric.ckpt")),
    "trainer_and_fabric": trainer_and_fabric,
    "one_file": one_file,
    "initial_weights": initial_weights,
    "resume_tp": lambda devices, workdir: train(
        "tensor_parallel", devices, load_from=str(_workdir(workdir) / "fabric.ckpt")
    ),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
