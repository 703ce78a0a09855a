"""Train the example GPT with a lightning_dist strategy.

python examples/train.py --strategy fsdp2 --devices 2 --max-steps 60
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_dist  # noqa: F401  (registers the strategy names)
from examples.data import TextDataModule
from examples.gpt import GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="fsdp2", help="a registered strategy name, e.g. fsdp2, fsdp2_grad_op")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="auto", help="auto (GPUs when there are enough), cpu or gpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.accelerator == "auto":
        # One process per device: with fewer GPUs than --devices, train on the CPU rather than fail.
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.accelerator = "gpu" if gpus >= args.devices else "cpu"
    L.seed_everything(args.seed)
    data = TextDataModule(batch_size=args.batch_size)
    model = GPT(vocab_size=data.vocab_size, seq_len=data.seq_len)
    trainer = L.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        accelerator=args.accelerator,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps // 2 if args.max_steps >= 2 else None,
        limit_val_batches=4,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model, data)
    trainer.validate(model, data)


if __name__ == "__main__":
    main()
