"""Throughput and MFU (issue 29, deliverable 5): FLOPs per token against hand computations (Llama-3-8B, a
Mixtral-style MoE), the peak table's device matching, the figures' arithmetic, the callback from YAML, and — in real
2-process Trainer runs — the logged tokens/s against the wall clock and the count over the mesh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_scenarios
from torch import nn

from lightning_dist import MeshThroughputMonitor
from lightning_dist.profiling import (
    PEAK_TFLOPS,
    device_peak_tflops,
    find_experts,
    flops_per_token,
    matmul_dtype,
    peak_tflops,
    throughput_figures,
    token_flops,
    token_ids,
)

# Llama-3-8B's config (Meta's params.json / the Hugging Face config).
LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}
# Mixtral-8x7B's config: Llama-like attention, 8 experts per layer, 2 per token.
MIXTRAL_8X7B = {**LLAMA3_8B, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}


def test_llama3_8b_flops_per_token_is_the_hand_computation() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))
    h, kv, ffn, layers, vocab = 4096, 8 * 128, 14336, 32, 128256
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    n = layers * per_layer + h + vocab * h  # + final norm + untied head; the input embedding is left out
    assert n == 7_504_924_672  # 8.03B parameters less the 0.525B input embedding
    facts = token_flops(model)
    assert (facts.dense_params, facts.expert_params, facts.layers, facts.attention_width) == (n, 0, 32, 4096)
    seq = 8192
    assert facts.per_token(seq) == 6 * n + 12 * layers * h * seq == 57_914_449_920


def test_mixtral_style_moe_counts_the_active_experts_only() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(**MIXTRAL_8X7B))
    h, kv, ffn, layers, vocab, experts, k = 4096, 1024, 14336, 32, 32000, 8, 2
    attention = 2 * h * h + 2 * h * kv
    expert = 3 * h * ffn  # gate, up, down of one expert
    dense = layers * (attention + 2 * h + experts * h) + h + vocab * h  # + norms, router; final norm; head
    active = dense + layers * k * expert
    assert active == 12_748_853_248  # Mixtral's "12.9B active" less its 0.13B input embedding
    facts = token_flops(model)
    assert facts.dense_params == dense and facts.expert_params == layers * experts * expert
    assert facts.active_params == active
    assert facts.per_token(4096) == 6 * active + 12 * layers * h * 4096
    assert token_flops(model, experts_per_token=1).active_params == dense + layers * expert


class _HandMoE(nn.Module):
    """A hand-written MoE block: a router and an ``experts`` ModuleList, ``top_k`` on the block."""

    def __init__(self, width: int, experts: int, top_k: int | None) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(experts))
        if top_k is not None:
            self.top_k = top_k


def test_expert_lists_and_a_missing_top_k() -> None:
    layers = nn.ModuleList(_HandMoE(8, 4, 1) for _ in range(3))
    assert [(e.name, e.params, e.experts, e.top_k) for e in find_experts(layers)] == [
        (f"{i}.experts", 4 * 64, 4, 1) for i in range(3)
    ]
    from examples.gpt import GPT

    model = GPT(vocab_size=16, seq_len=8, d_model=8, n_layer=2, n_head=2)
    for block in model.blocks:
        block.mlp = _HandMoE(8, 4, None)
    with pytest.raises(ValueError, match=r"routed experts \(blocks.0.mlp.experts and more\).*experts_per_token=k"):
        token_flops(model)
    assert token_flops(model, experts_per_token=2).active_params == token_flops(model, 4).active_params - 2 * 2 * 64


def test_embeddings_are_left_out_and_a_tied_head_counted_once() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples.gpt import GPT

    gpt = GPT(vocab_size=64, seq_len=32, d_model=32, n_layer=3, n_head=4)  # token and position embeddings
    assert token_flops(gpt).dense_params == sum(p.numel() for p in gpt.parameters()) - 64 * 32 - 32 * 32
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100, tie_word_embeddings=True)  # fmt: skip
    tied = LlamaForCausalLM(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert token_flops(tied).dense_params == sum(p.numel() for p in tied.parameters())  # the head's, once
    assert flops_per_token(10, 2, 4, 8) == 6 * 10 + 12 * 2 * 4 * 8


@pytest.mark.parametrize(
    ("name", "bf16", "fp8"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 1979.0),  # SXM: no form factor in the name
        ("NVIDIA H100 PCIe", 756.0, 1513.0),
        ("NVIDIA H100 NVL", 835.0, 1671.0),
        ("NVIDIA H200", 989.0, 1979.0),
        ("NVIDIA GH200 480GB", 989.0, 1979.0),
        ("NVIDIA B200", 2250.0, 4500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, None),  # no FP8 on Ampere
        ("NVIDIA A100 80GB PCIe", 312.0, None),
        ("AMD Instinct MI300X", 1307.4, 2614.9),
        ("NVIDIA L40S", 362.0, 733.0),
        ("NVIDIA L40", None, None),  # not an L4
        ("Tesla T4", None, None),
    ],
)
def test_peak_table_matches_device_names(name: str, bf16: float | None, fp8: float | None) -> None:
    assert (peak_tflops(name, "bf16"), peak_tflops(name, "fp8")) == (bf16, fp8)


def test_peaks_are_dense_and_cpu_has_none() -> None:
    for device, peaks in PEAK_TFLOPS.items():  # an FP8 peak is twice the dense BF16 one, never the sparse 4x
        assert peaks.get("fp8", 2 * peaks["bf16"]) == pytest.approx(2 * peaks["bf16"], rel=0.02), device
    assert device_peak_tflops(torch.device("cpu"), "bf16") is None
    assert (matmul_dtype("bf16-mixed"), matmul_dtype("16-mixed"), matmul_dtype("64-true")) == ("bf16", "fp16", "fp64")
    with pytest.raises(ValueError, match="not a matmul dtype"):
        peak_tflops("NVIDIA H100", "int8")


def test_figures_and_token_ids() -> None:
    figures = throughput_figures(tokens=8000, seconds=2.0, devices=4, flops_per_token=1e9, peak_tflops=2.0)
    assert figures == {"tokens_per_s": 4000, "tokens_per_s_per_device": 1000, "tflops_per_device": 1.0, "mfu": 0.5}
    assert "mfu" not in throughput_figures(8000, 2.0, 4, 1e9) and "tflops_per_device" not in throughput_figures(1, 1, 1)
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert token_ids({"labels": ids + 1, "input_ids": ids}) is ids
    assert token_ids((torch.ones(2, 3), [ids])) is ids and token_ids(torch.ones(2, 5)) is None


def test_the_callback_is_a_yaml_trainer_callback(tmp_path: Path) -> None:
    from jsonargparse import ArgumentParser
    from lightning.pytorch.callbacks import Callback

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[Callback])
    config = tmp_path / "c.yaml"
    config.write_text(
        "callbacks:\n  - class_path: lightning_dist.MeshThroughputMonitor\n    init_args: {peak_tflops: 312, prog_bar: true}\n"
    )
    (callback,) = parser.instantiate_classes(parser.parse_path(str(config))).callbacks
    assert isinstance(callback, MeshThroughputMonitor) and (callback.peak_tflops, callback.prog_bar) == (312, True)
    with pytest.raises(ValueError, match="peak_tflops=0"):
        MeshThroughputMonitor(peak_tflops=0)


GLOBAL_TOKENS = 8 * 32  # tests/scenarios/common.py: a global batch of 8 samples of 32 tokens, for any mesh
EVERY = 4


def _gpt_flops_per_token(vocab: int, h: int = 32, layers: int = 3, seq: int = 32) -> float:
    """The test GPT (examples/gpt.py, d_model 32, 3 blocks) by hand: 6·N + 12·L·H·S, N without the embeddings."""
    block = 4 * h * h + (h * 4 * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h  # attention, MLP with biases, 2 LayerNorms
    n = layers * block + 2 * h + h * vocab  # + final LayerNorm + bias-free head
    return 6 * n + 12 * layers * h * seq


def interval_brackets(before: dict, after: dict) -> list[tuple[float, float]]:
    """For each logged interval, the shortest and longest seconds the monitor can have measured, validation left out:
    each of its readings lies between the clock before it and the clock after it."""
    out, previous = [], (before["start"], after["start"])
    for b, a in zip(before["logs"], after["logs"]):
        inside = [
            (vb, va) for vb, va in zip(before["validations"], after["validations"]) if previous[0] <= vb[0] < b["at"]
        ]
        shortest = b["at"] - previous[1] - sum(va[1] - vb[0] for vb, va in inside)
        longest = a["at"] - previous[0] - sum(vb[1] - va[0] for vb, va in inside)
        out.append((shortest, longest))
        previous = (b["at"], a["at"])
    return out


@pytest.mark.slow
def test_logged_throughput_is_the_wall_clock_s_and_counts_the_mesh(tmp_path: Path) -> None:
    """Real 2-process Trainer runs (fsdp2 with 2 micro-batches per step, tensor_parallel, context_parallel; CPU,
    gloo), validation after every 6 batches, a value logged every 4 optimizer steps. The tokens are the global batch
    the test knows, 8 × 32 per micro-batch on every mesh. Two clocks, one callback before the monitor and one after it, bracket each of the monitor's
    readings, so a process descheduled on the loaded machine widens the bracket instead of failing the test:

    * each logged tokens/s is within 5% of the tokens over the wall-clock seconds of the same steps (validation
      left out), and TFLOP/s per device and MFU follow from it with the hand-counted FLOPs of the model;
    * the whole loop's tokens over its wall clock (on_train_start to on_train_end, less validation) is within 5%
      of the rate the logged values give.

    Counting tokens × world size (2) on tensor_parallel, or one rank's tokens on fsdp2, misses by 2×;
    the sharded sequence's length in the attention term on context_parallel misses TFLOP/s by 7%."""
    runs = run_scenarios("throughput_runs.py", 2, tmp_path, ["fsdp2", "tensor_parallel", "context_parallel"])
    for name, run in runs.items():
        before, after, flops = run["before"], run["after"], _gpt_flops_per_token(run["vocab_size"])
        logs, tokens = after["logs"], EVERY * GLOBAL_TOKENS * run["accumulate"]
        assert [log["step"] for log in logs] == [4, 8, 12], name
        assert len(after["validations"]) == 12 * run["accumulate"] // 6  # every 6 batches
        for log, (shortest, longest) in zip(logs, interval_brackets(before, after)):
            logged = log["throughput/tokens_per_s"]
            assert 0.95 * tokens / longest <= logged <= 1.05 * tokens / shortest, (name, log, shortest, longest)
            assert log["throughput/tokens_per_s_per_device"] == pytest.approx(logged / 2)
            tflops = logged * flops / 2 / 1e12
            assert log["throughput/tflops_per_device"] == pytest.approx(tflops, rel=1e-6), (name, log)
            if name == "tensor_parallel":  # on a CPU, no MFU without peak_tflops
                assert "throughput/mfu" not in log
            else:
                assert log["throughput/mfu"] == pytest.approx(tflops / 0.5, rel=1e-6), (name, log)
        loop = after["end"] - before["start"] - sum(end - start for start, end in after["validations"])
        logged_seconds = sum(tokens / log["throughput/tokens_per_s"] for log in logs)
        assert len(logs) * tokens / loop == pytest.approx(len(logs) * tokens / logged_seconds, rel=0.05), name


def test_the_docs_peak_table_is_the_code_s() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "throughput.md").read_text()
    table = text.split("<!-- peak-table:start -->")[1].split("<!-- peak-table:end -->")[0].strip().splitlines()
    header = [c.strip().lower() for c in table[0].strip("|").split("|")][1:]
    rows = {}
    for line in table[2:]:
        device, *cells = (c.strip() for c in line.strip("|").split("|"))
        rows[device] = {dtype: float(c) for dtype, c in zip(header, cells) if c != "-"}
    assert rows == PEAK_TFLOPS


def test_a_model_without_blocks_logs_tokens_per_second_only(tmp_path: Path) -> None:
    """One process: a model the FLOPs count cannot read (no repeated blocks) and a batch without token ids. With
    tokens_per_sample the monitor logs tokens/s and says, once, why it logs no TFLOP/s or MFU; the fit goes on."""
    import lightning as L
    from torch.utils.data import DataLoader

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monitor = MeshThroughputMonitor(tokens_per_sample=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=2, callbacks=[monitor],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.warns(UserWarning, match=r"logs no TFLOP/s or MFU: Regression has no repeated blocks.*flops_per_token"):
        trainer.fit(Regression(), DataLoader(torch.randn(16, 8), batch_size=4))
    assert set(monitor.last_figures) == {"tokens_per_s", "tokens_per_s_per_device"}
    logged = float(trainer.callback_metrics["throughput/tokens_per_s"])  # a float32 tensor
    assert logged == pytest.approx(monitor.last_figures["tokens_per_s"], rel=1e-6) and logged > 0
